"""The cases of the suite's shared run (conftest.py `train_and_cross_load`), and their names."""

import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN_SCRIPT = os.path.join(_HERE, "scripts", "train.py")
STEPS, RESUME_STEPS = 3, 2
OTHER = {"deepspeed": "zerospeed", "zerospeed": "deepspeed"}

PRECISION_CASES = [{"stage": stage, "dtype": dtype} for stage in (0, 1, 2, 3) for dtype in ("fp32", "bf16")]
OFFLOAD_CASES = [{"stage": stage, "dtype": "fp32", "offload": True} for stage in (1, 2, 3)]
BLOCK_CASES = [{"stage": 2, "dtype": "fp32", "scheduler": True, "clip": 0.5},
               {"stage": 0, "dtype": "bf16", "scheduler": True, "clip": 0.5}]
FROZEN_CASES = [{"stage": 1, "dtype": "fp32", "frozen": True}]
ALL_CASES = PRECISION_CASES + OFFLOAD_CASES + BLOCK_CASES + FROZEN_CASES


def _load_script(path):
    # The script imports its neighbours (seeded_batch.py), as it does when the harness runs it.
    if os.path.dirname(path) not in sys.path:
        sys.path.append(os.path.dirname(path))
    spec = importlib.util.spec_from_file_location("compat_train_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


case_name = _load_script(TRAIN_SCRIPT).case_name
