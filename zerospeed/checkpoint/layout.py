"""File names inside a checkpoint directory, per ZeRO stage (DeepSpeed's
`deepspeed/runtime/engine.py::DeepSpeedEngine._get_ckpt_name`, `_get_zero_ckpt_name`).

    <save_dir>/latest                       the tag, no trailing newline
    <save_dir>/zero_to_fp32.py              the standalone merger
    <save_dir>/<tag>/mp_rank_00_model_states.pt                          stage 0/1/2
    <save_dir>/<tag>/zero_pp_rank_{dp}_mp_rank_00_model_states.pt        stage 3, one per dp rank
    <save_dir>/<tag>/[bf16_]zero_pp_rank_{dp}_mp_rank_00_optim_states.pt stage >= 1, one per dp rank
    <save_dir>/<tag>/zs_manifest.json       ours: size and sha256 of every file above (manifest.py)
"""

from __future__ import annotations

import glob
import os
import re

__all__ = [
    "LATEST", "MANIFEST", "ZERO_TO_FP32", "default_tag", "model_states_name", "optim_states_name",
    "find_optim_files", "natural_key",
]

LATEST = "latest"
MANIFEST = "zs_manifest.json"
ZERO_TO_FP32 = "zero_to_fp32.py"
BF16_PREFIX = "bf16_"


def default_tag(global_steps: int) -> str:
    return f"global_step{global_steps}"


def model_states_name(zero_stage: int, dp_rank: int = 0, mp_rank: int = 0) -> str:
    if zero_stage >= 3:
        return f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_model_states.pt"
    return f"mp_rank_{mp_rank:02d}_model_states.pt"


def optim_states_name(dp_rank: int, bf16: bool, mp_rank: int = 0) -> str:
    prefix = BF16_PREFIX if bf16 else ""
    return f"{prefix}zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def natural_key(path: str) -> list[object]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path)]


def find_optim_files(tag_dir: str, bf16_first: bool = True, mp_rank: int = 0) -> list[str]:
    """Every dp rank's optim file of model-parallel rank `mp_rank`, in dp-rank order; our own prefix
    first, then the other one."""
    prefixes = [BF16_PREFIX, ""] if bf16_first else ["", BF16_PREFIX]
    for prefix in prefixes:
        pattern = f"{prefix}zero_pp_rank_*_mp_rank_{mp_rank:02d}_optim_states.pt"
        files = [f for f in glob.glob(os.path.join(tag_dir, pattern))
                 if prefix or not os.path.basename(f).startswith(BF16_PREFIX)]
        if files:
            return sorted(files, key=natural_key)
    return []


def find_model_files(tag_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(tag_dir, "*_model_states.pt")), key=natural_key)
