"""`engine.offload_states()` / `reload_states()` between steps: DeepSpeed 0.19.8 and zerospeed side by side.

One run per library (scripts/offload_states.py), several engines in it: train two steps, offload,
reload, train two more (the losses and final weights compared with the suite's dtype tolerances:
the two libraries step alike, not bit for bit, without offload too; that the round trip itself
changes nothing is tests/runtime/zero/test_state_offload.py's bit-for-bit test). DeepSpeed's offload runs on its CPU accelerator at stages 1 and 2 with every
state, and at stage 3 only without `optim_states` / `hp_params` (it asserts the base optimizer is
its FusedAdam, which needs CUDA); zerospeed offloads every state at every stage
(docs/compatibility.md).
"""

import os

import pytest

from compat_compare import assert_close_lists
from compat_harness import run_both

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "offload_states.py")
NO_MASTERS = ["lp_params", "lp_grads", "contiguous_grad_buffer"]
CASES = {
    "stage1": {"stage": 1, "bf16": False, "include": None, "non_blocking": False},
    "stage2": {"stage": 2, "bf16": False, "include": None, "non_blocking": True},
    "stage2_bf16": {"stage": 2, "bf16": True, "include": None, "non_blocking": False},
    "stage3_all": {"stage": 3, "bf16": False, "include": None, "non_blocking": False},
    "stage3_no_masters": {"stage": 3, "bf16": False, "include": NO_MASTERS, "non_blocking": True},
}

pytestmark = pytest.mark.compat


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_both(SCRIPT, str(tmp_path_factory.mktemp("offload_states")), cases=CASES)


def _assert_trains_alike(theirs, ours, case, rank):
    dtype = "bf16" if CASES[case]["bf16"] else "fp32"
    assert_close_lists(theirs["losses"], ours["losses"], dtype, f"{case} rank {rank} losses")
    for name, values in theirs["weights"].items():
        assert_close_lists(values, ours["weights"][name], dtype, f"{case} rank {rank} {name}")


def _pairs(runs, case):
    return [(rank, theirs[case], ours[case])
            for rank, (theirs, ours) in enumerate(zip(runs["deepspeed"], runs["zerospeed"]))]


@pytest.mark.parametrize("case", ["stage1", "stage2", "stage2_bf16", "stage3_no_masters"])
def test_training_after_offload_and_reload_matches_deepspeed(runs, case):
    for rank, theirs, ours in _pairs(runs, case):
        assert theirs["offload_error"] is None and theirs["reload_error"] is None, theirs["offload_error"]
        assert ours["offload_error"] is None and ours["reload_error"] is None, ours["offload_error"]
        _assert_trains_alike(theirs, ours, case, rank)


def test_stage3_offloads_masters_and_optimizer_state_where_deepspeed_cannot(runs):
    for rank, theirs, ours in _pairs(runs, "stage3_all"):
        assert theirs["offload_error"].startswith("AssertionError") and "FusedAdam" in theirs["offload_error"]
        assert ours["offload_error"] is None and ours["reload_error"] is None
        # DeepSpeed trained on (nothing had moved); zerospeed's round trip changed nothing either
        _assert_trains_alike(theirs, ours, "stage3_all", rank)


def test_nvme_is_refused_as_deepspeed_does(runs):
    for _, theirs, ours in _pairs(runs, "stage1"):
        assert ours["nvme_error"] == theirs["nvme_error"]
        assert theirs["nvme_error"] == "ValueError: NVMe offload is not supported for offloading states."
