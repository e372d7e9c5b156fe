"""Checkpoints cross between DeepSpeed 0.19.8 and zerospeed in both directions, at every stage.

Each library loads the checkpoint the other wrote (conftest.py `cross_loaded`) into a model with
different initial weights and continues. It must hold exactly the parameters the writer had when
it saved, and then step exactly as the writer did when it continued (the Adam moments, step
counts, loss scaler and scheduler came across): losses, grad norms and lrs within the dtype's
tolerance of the writer's own continuation.
"""

import pytest

from compat_cases import BLOCK_CASES, FROZEN_CASES, OFFLOAD_CASES, OTHER, PRECISION_CASES, STEPS, case_name
from compat_compare import assert_close_lists, assert_steps_match

CASES = PRECISION_CASES + OFFLOAD_CASES + BLOCK_CASES + FROZEN_CASES
DIRECTIONS = sorted(OTHER.items())   # (loader, writer)


@pytest.mark.parametrize("loader,writer", DIRECTIONS, ids=lambda v: v)
@pytest.mark.parametrize("case", CASES, ids=case_name)
def test_resume_from_the_other_library(saved_runs, cross_loaded, case, loader, writer):
    name = case_name(case)
    for rank, (wrote, read) in enumerate(zip(saved_runs[writer], cross_loaded[loader])):
        what = f"{loader} loading {writer}'s {name}, rank {rank}"
        assert "error" not in read[name], f"{what}: {read[name].get('error')}: {read[name].get('message')}"
        assert read[name]["loaded"] and read[name]["global_steps"] == STEPS, what
        assert read[name]["params_saved"] == wrote[name]["params_saved"], f"{what}: parameters after load"
        keys = ("loss", "lr") if _no_norm_on_one_side(case) else ("loss", "grad_norm", "lr")
        assert_steps_match(wrote[name]["continued"], read[name]["continued"], case["dtype"], what, keys)
        for param, values in wrote[name]["params"].items():
            assert_close_lists(values, read[name]["params"][param], case["dtype"], f"{what} {param}")


def _no_norm_on_one_side(case):
    # DeepSpeed's bare stage-0 fp32 optimizer reports no grad norm without clipping (test_training.py)
    return case["stage"] == 0 and case["dtype"] == "fp32" and not case.get("clip")


@pytest.mark.parametrize("case", CASES, ids=case_name)
def test_checkpoint_files_are_named_alike(saved_runs, case):
    """Same tag directory, same file names, except the documented differences: zerospeed adds
    its integrity manifest (improvement), and copies zero_to_fp32.py and zero_to_torch.py at stage 0
    too, where its converters work (improvement)."""
    name = case_name(case)
    theirs = set(saved_runs["deepspeed"][0][name]["files"])
    ours = set(saved_runs["zerospeed"][0][name]["files"])
    tag = f"global_step{STEPS}"
    assert f"{tag}/zs_manifest.json" in ours and {"zero_to_fp32.py", "zero_to_torch.py"} <= ours
    if case["stage"] == 0:
        assert "zero_to_fp32.py" not in theirs and "zero_to_torch.py" not in theirs
        theirs |= {"zero_to_fp32.py", "zero_to_torch.py"}
    assert theirs == ours - {f"{tag}/zs_manifest.json"}
