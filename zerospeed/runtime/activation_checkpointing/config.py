"""The ds_config `activation_checkpointing` block (DeepSpeed's
`deepspeed/runtime/activation_checkpointing/config.py::DeepSpeedActivationCheckpointingConfig`) and how
`configure` reads it."""

from __future__ import annotations

from typing import Any

from zerospeed.runtime.config_sections import ActivationCheckpointingConfig
from zerospeed.runtime.config_keys import validate_section

__all__ = ["DeepSpeedActivationCheckpointingConfig", "activation_checkpointing_block"]

DeepSpeedActivationCheckpointingConfig = ActivationCheckpointingConfig


def activation_checkpointing_block(deepspeed_config: Any) -> ActivationCheckpointingConfig:
    """The validated block from a ds_config dict, JSON path, base64 string, or `DeepSpeedConfig`.

    Only this block is read (DeepSpeed parses the whole config, batch triangle included, so a
    config without batch sizes fails there; here it does not)."""
    existing = getattr(deepspeed_config, "activation_checkpointing_config", None)
    if isinstance(existing, ActivationCheckpointingConfig):
        return existing
    from zerospeed.runtime.config import load_ds_config

    block = load_ds_config(deepspeed_config).get("activation_checkpointing", {})
    return validate_section(ActivationCheckpointingConfig, block, "activation_checkpointing")
