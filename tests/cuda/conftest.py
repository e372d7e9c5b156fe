"""tests/cuda: the GPU check (`make gpu-check`), marker `cuda`.

Every test here is marked `cuda` and skipped, with the reason, when torch sees no CUDA device, so
the CPU suite (and CI) collects them and passes. On a GPU machine `make gpu-check` runs them all
in one command: multi-rank tests use every visible GPU (NCCL), at least world size 1.
"""

import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

_NO_GPU = "no CUDA device (torch.cuda.is_available() is False); `make gpu-check` runs these on a GPU machine"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if str(item.fspath).startswith(HERE + os.sep):
            item.add_marker(pytest.mark.cuda)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason=_NO_GPU))
