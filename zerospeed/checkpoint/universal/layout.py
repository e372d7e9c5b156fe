"""File names and keys of a universal folder (DeepSpeed's `deepspeed/checkpoint/ds_to_universal.py`).

    <parent>/latest_universal              the basename of the folder, no newline (written last)
    <parent>/<folder>/                     the model-states files of the source tag, copied
                     zero/optimizer_state.pt   the optimizer's small state: param_groups, loss scaler
                     zero/<param>/fp32.pt      {"param": full fp32 value, "cat_dim": 0}
                     zero/<param>/exp_avg.pt   the same for each per-element moment
                     zero/<param>/step.pt      the step count as the optimizer kept it
                     zs_manifest.json          ours: size and sha256 of every file above

DeepSpeed's stage-3 conversion stores bare flat tensors instead of the dict and no `step.pt`
(the step is then read from `optimizer_state.pt`); the reader takes both.
"""

from __future__ import annotations

import os

__all__ = ["LATEST_UNIVERSAL", "ZERO_DIR", "OPTIMIZER_STATE_FILE", "FP32", "STEP", "PARAM", "CAT_DIM",
           "UNIVERSAL_CHECKPOINT_INFO", "UNIVERSAL_CHECKPOINT_VERSION_KEY", "UNIVERSAL_CHECKPOINT_VERSION_VALUE",
           "param_dir", "state_file"]

LATEST_UNIVERSAL = "latest_universal"
ZERO_DIR = "zero"
OPTIMIZER_STATE_FILE = "optimizer_state.pt"
FP32 = "fp32"
STEP = "step"
PARAM = "param"
CAT_DIM = "cat_dim"
UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"
UNIVERSAL_CHECKPOINT_VERSION_KEY = "universal_checkpoint_version"
UNIVERSAL_CHECKPOINT_VERSION_VALUE = 0.4


def param_dir(name: str) -> str:
    """The folder of one parameter, relative to the universal folder."""
    if not name or name.startswith(".") or "/" in name or os.sep in name:
        raise ValueError(f"parameter name {name!r} cannot name a folder of a universal checkpoint")
    return os.path.join(ZERO_DIR, name)


def state_file(name: str, key: str) -> str:
    """`zero/<name>/<key>.pt`, relative to the universal folder."""
    return os.path.join(param_dir(name), f"{key}.pt")
