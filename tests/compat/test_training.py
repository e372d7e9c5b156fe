"""Training at ZeRO stages 0-3 in fp32 and bf16: DeepSpeed 0.19.8 and zerospeed step alike.

One run per library trains every case (process start-up dominates); the test then compares, per
case and rank, the losses, global grad norms, learning rates and final parameters.
"""

import os

import pytest

from compat_harness import run_both
from compat_compare import assert_close_lists, assert_steps_match

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "train.py")
CASES = [{"stage": stage, "dtype": dtype} for stage in (0, 1, 2, 3) for dtype in ("fp32", "bf16")]
# Differences this suite found, reported to the lead (outside the checkpoint area); strict, so a fix shows.
KNOWN = {
    "stage0-bf16": "DeepSpeed's stage-0 bf16 (DDP_BFLOAT16, FP16_Optimizer) steps differently from its own "
                   "stage 1-3 bf16 from step 2 on; zerospeed matches stages 1-3 there",
}
STEPS = 3


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return run_both(SCRIPT, str(tmp_path_factory.mktemp("train")), cases=CASES, steps=STEPS)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"stage{c['stage']}-{c['dtype']}")
def test_training_matches_deepspeed(trained, case, request):
    name = f"stage{case['stage']}-{case['dtype']}"
    if name in KNOWN:
        request.applymarker(pytest.mark.xfail(reason=KNOWN[name], strict=True))
    for rank, (theirs, ours) in enumerate(zip(trained["deepspeed"], trained["zerospeed"])):
        keys = ("loss", "grad_norm", "lr")
        if case["stage"] == 0 and case["dtype"] == "fp32":
            # DeepSpeed's bare optimizer (no ZeRO, no wrapper) reports no grad norm unless
            # gradient_clipping is set; zerospeed reports it (a difference found by this suite,
            # reported to the lead; asserted so that a change shows).
            assert all(step["grad_norm"] is None for step in theirs[name]["steps"])
            assert all(step["grad_norm"] > 0 for step in ours[name]["steps"])
            keys = ("loss", "lr")
        assert_steps_match(theirs[name]["steps"], ours[name]["steps"], case["dtype"], f"{name} rank {rank}", keys)
        for param, values in theirs[name]["params"].items():
            assert_close_lists(values, ours[name]["params"][param], case["dtype"], f"{name} rank {rank} {param}")
