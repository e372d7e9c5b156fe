"""The Muon optimizer type: DeepSpeed 0.19.8 and zerospeed side by side (scripts/muon.py), with
`offload_optimizer: cpu` and with `per_head_muon` too.

DeepSpeed's Newton-Schulz precision is patched to fp32 (zerospeed's) so the arithmetic can be
compared at fp32 rounding. Where DeepSpeed is right, the two agree: which parameters get Muon,
the param groups and their lrs, and every number at stage 0. At ZeRO 1-3 DeepSpeed 0.19.8
departs from its own stage 0 and from single-process Muon (zerospeed's stages 1-3 equal the
single-process reference: tests/runtime/zero/test_muon_zero.py), and reports the norm of its
orthogonalized update as the gradient norm; the test asserts that difference
(docs/compatibility.md, "Muon").
"""

import os

import pytest
import torch
from compat_harness import run_both

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "muon.py")
RUNS = ["stage0", "stage1", "stage2", "stage3", "stage3_zero_init"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_both(SCRIPT, str(tmp_path_factory.mktemp("muon")), fp32_ns=True)


def _pairs(runs):
    return list(zip(runs["deepspeed"], runs["zerospeed"]))


@pytest.mark.parametrize("run", RUNS)
def test_same_params_get_muon_with_the_same_groups(runs, run):
    for theirs, ours in _pairs(runs):
        assert ours[run]["flags"] == theirs[run]["flags"]   # under zero.Init too (ds_shape, PR#8438)
        assert sorted(n for n, f in ours[run]["flags"].items() if f) == \
            ["down.weight", "odd.weight", "q_proj.weight", "up.weight"]
        assert ours[run]["groups"] == theirs[run]["groups"]


def test_stage0_trains_as_deepspeed(runs):
    for theirs, ours in _pairs(runs):
        torch.testing.assert_close(torch.tensor(ours["stage0"]["losses"]), torch.tensor(theirs["stage0"]["losses"]),
                                   rtol=1e-5, atol=1e-6)
        for name, values in theirs["stage0"]["params"].items():
            torch.testing.assert_close(torch.tensor(ours["stage0"]["params"][name]), torch.tensor(values),
                                       rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("run", RUNS[1:])
def test_zerospeed_keeps_stage0s_numbers_at_every_stage(runs, run):
    for _, ours in _pairs(runs):
        torch.testing.assert_close(torch.tensor(ours[run]["losses"]), torch.tensor(ours["stage0"]["losses"]),
                                   rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(ours[run]["norms"]), torch.tensor(ours["stage0"]["norms"]),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("run", RUNS[1:])
def test_deepspeed_zero_stages_depart_from_its_stage0(runs, run):
    """Documented difference: DeepSpeed's ZeRO 1-3 Muon moves the matrices far less than its own
    stage 0 (= single-process Muon), and its grad norm is the norm of the orthogonalized update."""
    theirs = runs["deepspeed"][0]
    initial = runs["zerospeed"][0]["initial"]
    moved = {}
    for key in (run, "stage0"):
        delta = torch.tensor(theirs[key]["params"]["q_proj.weight"]) - torch.tensor(initial["q_proj.weight"])
        moved[key] = delta.norm().item()
    assert moved[run] < 0.5 * moved["stage0"]
    assert theirs[run]["norms"][0] > 2 * runs["zerospeed"][0][run]["norms"][0]


# --- offload_optimizer: cpu at ZeRO 1-3 (scripts/muon.py with offload=True) -------------------------
OFFLOADED = ["stage1_cpu", "stage2_cpu", "stage3_cpu"]


@pytest.fixture(scope="module")
def offloaded(tmp_path_factory):
    return run_both(SCRIPT, str(tmp_path_factory.mktemp("muon_offload")), fp32_ns=True, offload=True)


@pytest.mark.parametrize("run", OFFLOADED)
def test_offloaded_muon_keeps_stage0s_numbers(offloaded, run):
    """zerospeed: the host-side Muon step is stage 0's (= single-process Muon); DeepSpeed runs it too,
    departing from its stage 0 as its ZeRO 1-3 Muon does without offload (docs/compatibility.md)."""
    for theirs, ours in _pairs(offloaded):
        assert "error" not in theirs[run] and "error" not in ours[run]
        torch.testing.assert_close(torch.tensor(ours[run]["losses"]), torch.tensor(ours["stage0"]["losses"]),
                                   rtol=1e-5, atol=1e-6)
        for name, values in ours["stage0"]["params"].items():
            torch.testing.assert_close(torch.tensor(ours[run]["params"][name]), torch.tensor(values),
                                       rtol=0, atol=1e-5, msg=name)
        torch.testing.assert_close(torch.tensor(ours["stage0"]["losses"]), torch.tensor(theirs["stage0"]["losses"]),
                                   rtol=1e-5, atol=1e-6)
        assert theirs[run]["norms"][0] > 2 * ours[run]["norms"][0]   # DeepSpeed: the norm of the update


def test_nvme_offloaded_muon_keeps_stage0s_numbers(offloaded):
    """zerospeed's stage-3 NVMe Muon (each Muon partition one swap unit) against its stage 0, which
    equals DeepSpeed's stage 0 (above); DeepSpeed's own NVMe run is not made (scripts/muon.py)."""
    for ours in offloaded["zerospeed"]:
        run = ours["stage3_nvme"]
        assert "error" not in run, run
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ours["stage0"]["losses"]),
                                   rtol=1e-5, atol=1e-6)
        for name, values in ours["stage0"]["params"].items():
            torch.testing.assert_close(torch.tensor(run["params"][name]), torch.tensor(values), rtol=0, atol=1e-5,
                                       msg=name)


# --- per_head_muon at stage 0 on a tiny HF Llama (scripts/muon.py with per_head=True) ----------------
@pytest.fixture(scope="module")
def per_head(tmp_path_factory):
    return run_both(SCRIPT, str(tmp_path_factory.mktemp("muon_per_head")), fp32_ns=True, per_head=True)


def test_per_head_muon_splits_the_same_projections_with_the_same_update(per_head):
    for theirs, ours in _pairs(per_head):
        assert ours["per_head"]["heads"] == theirs["per_head"]["heads"]
        assert {n: h for n, h in ours["per_head"]["heads"].items() if h[0]} == {
            "model.layers.0.self_attn.q_proj.weight": [4, 8], "model.layers.0.self_attn.k_proj.weight": [2, 8],
            "model.layers.0.self_attn.v_proj.weight": [2, 8]}
        torch.testing.assert_close(torch.tensor(ours["one_update"]), torch.tensor(theirs["one_update"]),
                                   rtol=0, atol=1e-5)
        _assert_same_run(ours["whole"], theirs["whole"])


def test_deepspeed_ignores_per_head_muon_at_stage0(per_head):
    """Documented difference: DeepSpeed 0.19.8's stage-0 step (`MuonWithAuxAdam.step` on whole
    parameters) does not pass the head count to `muon_update`, so its per-head run is its
    whole-matrix run; zerospeed's differs from its whole-matrix run (tests/runtime/zero/
    test_muon_per_head.py holds it to the per-head reference)."""
    for theirs, ours in _pairs(per_head):
        _assert_same_run(theirs["per_head"], theirs["whole"])
        moved = max(abs(a - b) for a, b in zip(ours["per_head"]["params"]["model.layers.0.self_attn.q_proj.weight"],
                                               ours["whole"]["params"]["model.layers.0.self_attn.q_proj.weight"]))
        assert moved > 1e-3


def _assert_same_run(a: dict, b: dict) -> None:
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), rtol=1e-5, atol=1e-6)
    for name, values in b["params"].items():
        torch.testing.assert_close(torch.tensor(a["params"][name]), torch.tensor(values), rtol=0, atol=1e-5, msg=name)
