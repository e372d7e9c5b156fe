"""Training at ZeRO stages 0-3 in fp32 and bf16, with optimizer offload, the scheduler and
gradient clipping: DeepSpeed 0.19.8 and zerospeed step alike (losses, grad norms, lrs, params).

The runs are the suite's shared phase 1 (conftest.py `saved_runs`).
"""

import pytest

from compat_compare import assert_close_lists, assert_steps_match
from compat_cases import ALL_CASES, FROZEN_CASES, case_name

# Differences this suite found, reported to the lead (outside the checkpoint area); strict, so a fix shows.
KNOWN = {
    "stage0-bf16": "DeepSpeed's stage-0 bf16 (DDP_BFLOAT16, FP16_UnfusedOptimizer) steps differently from its "
                   "own stage 1-3 bf16 from step 2 on; zerospeed matches stages 1-3 there",
}
CASES = [case for case in ALL_CASES if case not in FROZEN_CASES]


@pytest.mark.parametrize("case", CASES, ids=case_name)
def test_training_matches_deepspeed(saved_runs, case, request):
    name = case_name(case)
    if name in KNOWN:
        request.applymarker(pytest.mark.xfail(reason=KNOWN[name], strict=True))
    for rank, (theirs, ours) in enumerate(zip(saved_runs["deepspeed"], saved_runs["zerospeed"])):
        what = f"{name} rank {rank}"
        steps_theirs, steps_ours = theirs[name]["steps"] + theirs[name]["continued"], \
            ours[name]["steps"] + ours[name]["continued"]
        keys = ("loss", "grad_norm", "lr")
        if case["stage"] == 0 and case["dtype"] == "fp32" and not case.get("clip"):
            # DeepSpeed's bare optimizer (no ZeRO, no wrapper) reports no grad norm unless
            # gradient_clipping is set; zerospeed reports it (found by this suite, reported to
            # the lead; asserted so that a change shows).
            assert all(step["grad_norm"] is None for step in steps_theirs)
            assert all(step["grad_norm"] > 0 for step in steps_ours)
            keys = ("loss", "lr")
        assert_steps_match(steps_theirs, steps_ours, case["dtype"], what, keys)
        for param, values in theirs[name]["params"].items():
            assert_close_lists(values, ours[name]["params"][param], case["dtype"], f"{what} {param}")


def test_scheduler_and_clipping_are_in_effect(saved_runs):
    """The blocks must change something, or the comparison above proves nothing about them."""
    ours = saved_runs["zerospeed"][0]
    lrs = [step["lr"] for step in ours["stage2-fp32-scheduler-clip"]["steps"]]
    assert lrs[0] < lrs[-1] and lrs != [step["lr"] for step in ours["stage2-fp32"]["steps"]]
    assert ours["stage2-fp32-scheduler-clip"]["params"] != ours["stage2-fp32"]["params"]
