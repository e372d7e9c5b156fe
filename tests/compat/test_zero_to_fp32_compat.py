"""zero_to_fp32 on both libraries' checkpoints, by both libraries' converters.

Phase 1 (`saved_runs`) ran each library's converter on its own checkpoint, phase 2
(`cross_loaded`) on the other's. On the same files both converters must return the same tensors,
bit for bit; in fp32 they are the parameters the writer saved.
"""

import pytest

from compat_cases import FROZEN_CASES, OFFLOAD_CASES, PRECISION_CASES, case_name

ZERO_CASES = [case for case in PRECISION_CASES + OFFLOAD_CASES if case["stage"] >= 1]
STAGE0_CASES = [case for case in PRECISION_CASES if case["stage"] == 0]


def converted(saved_runs, cross_loaded, name):
    """{(converter, writer): state} for the four combinations (rank 0 converts)."""
    return {("deepspeed", "deepspeed"): saved_runs["deepspeed"][0][name]["zero_to_fp32"],
            ("zerospeed", "zerospeed"): saved_runs["zerospeed"][0][name]["zero_to_fp32"],
            ("deepspeed", "zerospeed"): cross_loaded["deepspeed"][0][name]["zero_to_fp32"],
            ("zerospeed", "deepspeed"): cross_loaded["zerospeed"][0][name]["zero_to_fp32"]}


@pytest.mark.parametrize("case", ZERO_CASES, ids=case_name)
def test_both_converters_agree_on_both_checkpoints(saved_runs, cross_loaded, case):
    name = case_name(case)
    states = converted(saved_runs, cross_loaded, name)
    for writer in ("deepspeed", "zerospeed"):
        theirs, ours = states[("deepspeed", writer)], states[("zerospeed", writer)]
        assert "error" not in theirs and "error" not in ours, (writer, theirs.get("error"), ours.get("error"))
        assert theirs == ours, f"the converters differ on {writer}'s {name}"
        if case["dtype"] == "fp32":
            assert ours == saved_runs[writer][0][name]["params_saved"], f"{writer}'s {name}: not the saved params"


@pytest.mark.parametrize("case", STAGE0_CASES, ids=case_name)
def test_stage0_checkpoints_convert_with_zerospeed_only(saved_runs, cross_loaded, case):
    """Improvement (docs/compatibility.md): DeepSpeed's converter rejects a checkpoint without
    ZeRO; zerospeed's converts it (the fp32 masters, or the fp32 weights), DeepSpeed's included."""
    name = case_name(case)
    states = converted(saved_runs, cross_loaded, name)
    assert "error" in states[("deepspeed", "deepspeed")] and "error" in states[("deepspeed", "zerospeed")]
    for writer in ("deepspeed", "zerospeed"):
        ours = states[("zerospeed", writer)]
        assert "error" not in ours, (writer, ours)
        assert set(ours) == set(saved_runs[writer][0][name]["params_saved"])
        if case["dtype"] == "fp32":
            assert ours == saved_runs[writer][0][name]["params_saved"]


@pytest.mark.parametrize("case", FROZEN_CASES, ids=case_name)
def test_frozen_params_of_a_deepspeed_stage1_checkpoint(saved_runs, cross_loaded, case):
    """DeepSpeed's converter drops stage 1's frozen params; zerospeed's returns them, from the
    model-states file (improvement)."""
    name = case_name(case)
    states = converted(saved_runs, cross_loaded, name)
    saved = saved_runs["deepspeed"][0][name]["params_saved"]
    assert "0.bias" not in states[("deepspeed", "deepspeed")]
    assert states[("zerospeed", "deepspeed")] == saved
    assert states[("zerospeed", "zerospeed")] == saved_runs["zerospeed"][0][name]["params_saved"]
