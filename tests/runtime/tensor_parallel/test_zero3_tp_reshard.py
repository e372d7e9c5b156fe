"""A ZeRO-3 checkpoint resumes at another tensor-parallel size directly, optimizer state included
(no conversion step): a tiny Llama trained with AdamW on 2 gloo ranks at one (tp, dp, ZeRO stage),
saved, and loaded with `load_checkpoint` at another; the checkpoint's every tp rank is read into
the full layout, joined along the split dimensions and cut again for the new tp split, then for
the new ZeRO partition ([Note: AutoTP optimizer resharding]). The next steps must equal the saving
run continued: losses, every parameter, its fp32 master and both Adam moments at fp32 tolerance
(relative to each tensor's largest element), and the step count. A lost or misplaced moment shows
at once (a fresh optimizer's first step is lr * sign(grad)).
"""

from __future__ import annotations


import pytest
import torch

from adam_state import adam_state, compare_adam_states
from tests.distributed import run_on_ranks
from tp_models import autotp_engine, full_weights, global_batches, train_dp_slices

GLOBAL_BATCH, SAVE_AT, STEPS = 2, 2, 4
TOL = 1e-6   # fp32: the same arithmetic in another order (tp reductions, partition sums)


def _train(engine, steps) -> list[float]:
    batches = global_batches(GLOBAL_BATCH, STEPS)
    return train_dp_slices(engine, [batches[step] for step in steps])[0]


def _resume(saved: tuple[int, int], loaded: tuple[int, int], root: str, load_optimizer_states: bool) -> dict:
    """(tp, stage) saved -> (tp, stage) loaded directly; dp is 2 // tp on each side."""
    from zerospeed.comm import groups

    try:
        engine = autotp_engine(*saved, GLOBAL_BATCH)
        _train(engine, range(SAVE_AT))
        engine.save_checkpoint(root, tag="t")
        at_save = full_weights(engine)
        continued = _train(engine, range(SAVE_AT, STEPS))
        expected, expected_adam = full_weights(engine), adam_state(engine)
        groups.reset()
        torch.manual_seed(99)   # another init: everything must come from the checkpoint
        resumed = autotp_engine(*loaded, GLOBAL_BATCH)
        resumed.load_checkpoint(root, tag="t", load_optimizer_states=load_optimizer_states)
        steps = resumed.global_steps
        if not load_optimizer_states:   # the weights only: those the saving run had
            got = full_weights(resumed)
            return {"steps": steps, "param": max((got[k] - at_save[k]).abs().max().item() for k in at_save)}
        losses, got = _train(resumed, range(SAVE_AT, STEPS)), full_weights(resumed)
        return {"loss": max(abs(a - b) / b for a, b in zip(losses, continued)), "steps": steps,
                "param": max((got[k] - expected[k]).abs().max().item() for k in expected),
                **compare_adam_states(adam_state(resumed), expected_adam)}
    finally:
        groups.reset()


CASES = {   # name: (saved tp, stage), (loaded tp, stage)
    "tp1_dp2_z3_to_tp2_z3": ((1, 3), (2, 3)),
    "tp2_z3_to_tp1_dp2_z3": ((2, 3), (1, 3)),
    "tp2_z3_to_tp1_dp2_z1": ((2, 3), (1, 1)),
    "tp2_z3_to_tp1_dp2_z0": ((2, 3), (1, 0)),
    "tp2_z1_to_tp1_dp2_z3": ((2, 1), (1, 3)),
    "tp1_dp2_z2_to_tp2_z3": ((1, 2), (2, 3)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_zero3_checkpoint_resumes_at_another_tp_size_directly(case, tmp_path):
    saved, loaded = CASES[case]
    for rank, result in enumerate(run_on_ranks(_resume, 2, saved, loaded, str(tmp_path), True)):
        assert result["steps"] == SAVE_AT, (rank, result)
        assert result["step"] == result["expected_step"] == STEPS, (rank, result)
        for key in ("loss", "param", "fp32", "exp_avg", "exp_avg_sq"):
            assert result[key] < TOL, (rank, key, result)


@pytest.mark.parametrize("case", ["tp2_z3_to_tp1_dp2_z1", "tp1_dp2_z3_to_tp2_z3"])
def test_weights_only_load_across_tp_sizes_takes_the_saved_masters(case, tmp_path):
    saved, loaded = CASES[case]
    for rank, result in enumerate(run_on_ranks(_resume, 2, saved, loaded, str(tmp_path), False)):
        assert result["steps"] == SAVE_AT and result["param"] < TOL, (rank, result)
