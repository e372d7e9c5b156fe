"""Ulysses against the real DeepSpeed 0.19.8 (compat_harness: fresh processes per library).

`DistributedAttention` agrees to fp32 rounding. With the loss recipe transformers' Trainer uses under
sequence parallelism, both libraries report the same loss, and DeepSpeed's SGD update is exactly
sp times ours: DeepSpeed divides the gradients by the data-parallel size only (DeepSpeed issue
5248), zerospeed's equal full-sequence training (tests/runtime/sequence_parallel). Documented in
docs/compatibility.md; this test pins the factor so a change on either side shows.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.compat
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "ulysses_hf.py")


def test_ulysses_attention_and_alst_step_against_deepspeed(tmp_path) -> None:
    from compat_harness import require_deepspeed, run_both

    require_deepspeed()
    results = run_both(SCRIPT, str(tmp_path))
    for theirs, ours in zip(results["deepspeed"], results["zerospeed"]):
        for a, b in zip(ours["attention"], theirs["attention"]):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-6)
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-6)
        torch.testing.assert_close(torch.tensor(theirs["update"]), 2 * torch.tensor(ours["update"]),
                                   rtol=1e-4, atol=1e-6)  # updates are differences of fp32 weights
