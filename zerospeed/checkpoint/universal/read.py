"""A universal folder (written by zerospeed or by DeepSpeed's `ds_to_universal`) as the full optimizer state.

The folder already holds every parameter whole, so reading it gives [Note: full layout]
(full_state.py) directly, and the current optimizer's `load_full_state` cuts its own partition
from it, at any stage and data-parallel size. Each file read is checked against the folder's
manifest when it has one (zerospeed wrote it); a missing, truncated or corrupt file is refused
naming it.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from zerospeed.checkpoint import constants as C
from zerospeed.checkpoint.full_state import FullOptimizerState
from zerospeed.checkpoint.manifest import CheckpointIntegrityError, load_file, read_manifest, verify_files
from zerospeed.checkpoint.universal.layout import FP32, OPTIMIZER_STATE_FILE, PARAM, STEP, ZERO_DIR, param_dir

__all__ = ["read_universal_state"]


class _Folder:
    """Verified reads of one universal folder."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.verified = read_manifest(folder) is not None

    def load(self, relative: str) -> Any:
        path = os.path.join(self.folder, relative)
        if not os.path.exists(path):
            raise CheckpointIntegrityError(f"universal checkpoint file {path} is missing")
        if self.verified:
            verify_files(self.folder, [relative])
        return load_file(path)

    def keys(self, name: str) -> list[str]:
        """The state keys saved for one parameter (`exp_avg` for `zero/<name>/exp_avg.pt`)."""
        folder = os.path.join(self.folder, param_dir(name))
        if not os.path.isdir(folder):
            raise CheckpointIntegrityError(f"universal checkpoint {self.folder} has no folder {folder} for "
                                           f"parameter {name!r}")
        return sorted(entry[:-3] for entry in os.listdir(folder) if entry.endswith(".pt"))

    def tensor(self, name: str, key: str, shape: torch.Size) -> torch.Tensor:
        """`{"param": tensor}` (zerospeed, DeepSpeed stage 1/2) or a bare flat tensor (DeepSpeed stage 3)."""
        relative = os.path.join(param_dir(name), f"{key}.pt")
        value = self.load(relative)
        value = value.get(PARAM) if isinstance(value, dict) else value
        if not torch.is_tensor(value) or value.numel() != math.prod(shape):
            found = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
            raise ValueError(f"universal checkpoint file {os.path.join(self.folder, relative)} holds {found}; "
                             f"parameter {name!r} has shape {tuple(shape)}")
        return value.reshape(shape)


def read_universal_state(folder: str, shapes: dict[str, torch.Size], load_moments: bool) -> FullOptimizerState:
    """The parameters `shapes` names (full-state names -> full shapes) from `folder`: fp32 values,
    and with `load_moments` every per-element state, the step and the param groups' hyperparameters."""
    reader = _Folder(folder)
    optimizer_state = reader.load(os.path.join(ZERO_DIR, OPTIMIZER_STATE_FILE))
    full = FullOptimizerState()
    for name, shape in shapes.items():
        full.fp32[name] = reader.tensor(name, FP32, shape).float()
        if not load_moments:
            continue
        keys = reader.keys(name)
        full.moments[name] = {key: reader.tensor(name, key, shape) for key in keys if key not in (FP32, STEP)}
        step = reader.load(os.path.join(param_dir(name), f"{STEP}.pt")) if STEP in keys else _saved_step(
            optimizer_state)
        if step is not None:
            full.scalars[name] = {STEP: step}
    if load_moments:
        groups = optimizer_state.get("param_groups") or optimizer_state[C.OPTIMIZER_STATE_DICT]["param_groups"]
        full.param_groups = [{k: v for k, v in group.items() if k != "params"} for group in groups]
        full.loss_scaler = optimizer_state.get(C.LOSS_SCALER)
        full.overflow = bool(optimizer_state.get("overflow", False))
    return full


def _saved_step(optimizer_state: dict[str, Any]) -> Any:
    """DeepSpeed's stage-3 folders keep no `step.pt`: the step of the first optimizer state entry,
    as DeepSpeed's stage-3 loader reads it (every parameter has the same step)."""
    entries = (optimizer_state.get(C.OPTIMIZER_STATE_DICT) or {}).get("state") or {}
    for entry in entries.values():
        if STEP in entry:
            return entry[STEP]
    return None
