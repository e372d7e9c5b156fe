"""DeepSpeed 0.19.8's ds_config sections that zerospeed does not implement, and what it does with each.

[Note: refuse or warn]
A section zerospeed does not implement is refused, naming it and saying what to do, whenever
ignoring it could change the numbers (a model meant to train quantized, sparse, under autocast or
at an elastic batch size would otherwise train otherwise, silently). It is dropped with one warning
saying why only where ignoring it cannot change what is trained. Three kinds of key, each a table:

* `REMOVED_UPSTREAM`: features DeepSpeed itself has removed. DeepSpeed 0.19.8 refuses these keys
  whenever they are present, whatever their value (its `DeepSpeedConfig` raises before anything
  else); zerospeed refuses the same keys, at the same point, with its own words;
* `NOT_IMPLEMENTED`: sections DeepSpeed 0.19.8 implements and zerospeed does not. Each entry says
  when the section is live (refused) and why it is harmless otherwise (warned);
* `KNOWN_ELSEWHERE`: keys DeepSpeed ignores that clients, examples and tutorials write. They are
  never taken for a typo of a real key (`comms_config` is not a misspelt `comms_logger`), only
  dropped with the usual unknown-key warning.

docs/config.md ("Top-level sections") lists every DeepSpeed 0.19.8 top-level key with its status.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from zerospeed.runtime.config_utils import warn_config

__all__ = ["KNOWN_ELSEWHERE", "NOT_IMPLEMENTED", "REMOVED_UPSTREAM", "ZERO_REMOVED_UPSTREAM", "Unimplemented",
           "screen_sections"]

REMOVAL_ISSUE = "https://github.com/deepspeedai/DeepSpeed/issues/8489"

# key -> what the removed feature did, i.e. what a run that ignored the key would silently lose.
REMOVED_UPSTREAM: dict[str, str] = {
    "amp": "NVIDIA Apex AMP mixed precision; use the 'fp16' or 'bf16' section instead",
    "nebula": "Nebula checkpointing; checkpoints would be plain torch.save files instead",
    "compression_training": "the compression library (quantization, pruning, layer reduction); the model "
                            "would train uncompressed",
    "quantize_training": "Mixture-of-Quantization (MoQ); the model would train unquantized",
    "sparse_gradients": "sparse reduction of dense embedding gradients; use torch.nn.Embedding(sparse=True) "
                        "where sparse gradients are wanted",
    "eigenvalue": "eigenvalue-based Mixture-of-Quantization",
    "sparse_attention": "Sparse Attention kernels; attention would run dense",
    "elasticity": "elastic training; set train_batch_size, train_micro_batch_size_per_gpu and "
                  "gradient_accumulation_steps directly",
    "graph_harvesting": "graph harvesting",
    "curriculum_learning": "legacy curriculum learning; the sequence-length schedule would not apply",
    "progressive_layer_drop": "Progressive Layer Dropping; every layer would run at every step",
}

# zero_optimization keys DeepSpeed 0.19.8 refuses the same way.
ZERO_REMOVED_UPSTREAM: dict[str, str] = {
    "mics_shard_size": "MiCS sharding",
    "mics_hierarchical_params_gather": "MiCS sharding",
    "zeropp_loco_param": "LoCo-ZeRO++ error feedback; remove it to keep ZeRO++ quantized gradients without LoCo",
}


class Unimplemented(NamedTuple):
    """A section DeepSpeed implements and zerospeed does not."""

    feature: str
    live: Callable[[Any], bool]
    """True when the section's value would change the numbers: then it is refused."""
    action: str
    """What to do instead, in the refusal."""
    harmless: str
    """Why a warning suffices when the section is not live."""


def _enabled(value: Any) -> bool:
    return isinstance(value, dict) and value.get("enabled") is True


def _any_quantization(value: Any) -> bool:
    return isinstance(value, dict) and any(value.get(key) for key in ("quantized_initialization", "post_init_quant"))


def _never(value: Any) -> bool:
    return False


NOT_IMPLEMENTED: dict[str, Unimplemented] = {
    "torch_autocast": Unimplemented(
        "torch.autocast mixed precision", _enabled,
        "remove it (or set enabled to false) and use the 'bf16' or 'fp16' section",
        "it is disabled"),
    "data_efficiency": Unimplemented(
        "data efficiency (curriculum data sampling, random-LTD)", _enabled,
        "remove the section or set enabled to false", "it is disabled"),
    "expert_parallel": Unimplemented(
        "AutoEP (expert-parallel replacement of the model's MoE layers)", _enabled,
        "remove the section or set enabled to false; zerospeed's MoE is deepspeed.moe.layer.MoE",
        "it is disabled"),
    "weight_quantization": Unimplemented(
        "ZeRO weight quantization (quantized_initialization, post_init_quant)", _any_quantization,
        "remove the section", "it quantizes nothing"),
    "hybrid_engine": Unimplemented(
        "the hybrid engine", _never, "",
        "it changes how generation runs inside RLHF training, not the training step"),
    "autotuning": Unimplemented(
        "the autotuner", _never, "", "the launcher's --autotuning mode reads it; a training run does not"),
    "datastates_ckpt": Unimplemented(
        "DataStates asynchronous checkpointing", _never, "",
        "it changes how checkpoint files are written, not what they hold"),
    "disable_python_gc": Unimplemented(
        "scheduled Python garbage collection", _never, "", "it only changes when Python frees memory"),
}

# zero_optimization keys DeepSpeed implements and zerospeed does not; always live when given.
ZERO_NOT_IMPLEMENTED: dict[str, str] = {
    "zenflow": "ZenFlow (stale, top-k selective optimizer updates)",
}

# Top-level keys DeepSpeed 0.19.8 ignores that real configs carry -> where they come from.
KNOWN_ELSEWHERE: dict[str, str] = {
    "comms_config": "LLaMA-Factory examples/deepspeed/ds_z3_fp8_config.json and ds_z3_alst_config.json",
    "monitor_config": "LLaMA-Factory examples/deepspeed/ds_z3_fp8_config.json and ds_z3_alst_config.json",
    "_comment": "LLaMA-Factory examples/deepspeed/ds_z2_autotp_config.json (a JSON comment)",
    "msamp": "accelerate's FP8 (MS-AMP) integration",
    "cuda_visible_devices": "DeepSpeedExamples training/imagenet/config/ds_fp16_z1_config.json",
}


def screen_sections(data: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """`data` without the unimplemented sections; a refusal per live one is appended to `problems`."""
    out = dict(data)
    for key, lost in REMOVED_UPSTREAM.items():
        if key in out:
            problems.append(f"{key}: removed from DeepSpeed, which refuses this section too ({REMOVAL_ISSUE}): "
                            f"{lost}. Remove '{key}' from the config")
            del out[key]
    for key, entry in NOT_IMPLEMENTED.items():
        if key not in out:
            continue
        value = out.pop(key)
        if entry.live(value):
            problems.append(f"{key}: {entry.feature} is not implemented by zerospeed, and ignoring it would "
                            f"change the training run: {entry.action}")
        else:
            warn_config(f"ds_config section '{key}' ({entry.feature}) is not implemented by zerospeed and is "
                        f"ignored: {entry.harmless}")
    zero = out.get("zero_optimization")
    if isinstance(zero, dict):
        out["zero_optimization"] = _screen_zero(zero, problems)
    return out


def _screen_zero(zero: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    zero = dict(zero)
    for key, lost in ZERO_REMOVED_UPSTREAM.items():
        if key in zero:
            problems.append(f"zero_optimization.{key}: removed from DeepSpeed, which refuses this key too "
                            f"({REMOVAL_ISSUE}): {lost}. Remove it from the config")
            del zero[key]
    for key, feature in ZERO_NOT_IMPLEMENTED.items():
        if zero.get(key) is not None:
            problems.append(f"zero_optimization.{key}: {feature} is not implemented by zerospeed, and ignoring "
                            f"it would change the training run: remove zero_optimization.{key}")
        zero.pop(key, None)
    return zero
