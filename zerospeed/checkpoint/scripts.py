"""The standalone scripts every save copies beside `latest` (DeepSpeed 0.19.8 copies these two).

`zero_to_fp32.py` merges the shards into fp32 weights; `zero_to_torch.py` does the same in fp32,
fp16 or bf16 and imports the `zero_to_fp32.py` copied beside it, so both always travel together.
"""

from __future__ import annotations

import os

__all__ = ["CHECKPOINT_SCRIPTS", "checkpoint_scripts"]

CHECKPOINT_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")


def checkpoint_scripts() -> dict[str, str]:
    """{file name in the save dir: the source file in zerospeed/utils} for every script."""
    from zerospeed import utils

    here = os.path.dirname(os.path.abspath(utils.__file__))
    return {name: os.path.join(here, name) for name in CHECKPOINT_SCRIPTS}
