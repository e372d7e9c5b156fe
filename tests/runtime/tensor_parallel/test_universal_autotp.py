"""AutoTP checkpoints through DeepSpeed's universal format: a tiny Llama trained with AdamW on 2
gloo ranks at one (tp, dp, ZeRO stage), saved, converted by `ds_to_universal` (the split
parameters joined from every tp rank), and resumed with `"load_universal": true` at another
(the pieces cut again for the new tp size, then partitioned for the new stage and dp size). The
next steps must equal the saving run continued: losses and full weights at fp32 tolerance, and
the step count. A lost or misplaced Adam moment shows at once (a fresh optimizer's first step is
lr * sign(grad)). The same ZeRO-3 tp changes load directly too (test_zero3_tp_reshard.py).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.distributed import run_on_ranks
from tp_models import autotp_engine, full_weights, global_batches, train_dp_slices

GLOBAL_BATCH, SAVE_AT, STEPS = 2, 2, 4
TOL = 1e-6   # fp32: the same arithmetic in another order (tp reductions, partition sums)


def _train(engine, steps) -> list[float]:
    batches = global_batches(GLOBAL_BATCH, STEPS)
    return train_dp_slices(engine, [batches[step] for step in steps])[0]


def _through_universal(saved: tuple[int, int], loaded: tuple[int, int], root: str) -> dict:
    """(tp, stage) saved -> converted -> (tp, stage) loaded; dp is 2 // tp on each side."""
    from zerospeed.checkpoint.universal.convert import convert_to_universal
    from zerospeed.comm import groups

    try:
        engine = autotp_engine(*saved, GLOBAL_BATCH)
        _train(engine, range(SAVE_AT))
        engine.save_checkpoint(root, tag="t")
        continued, expected = _train(engine, range(SAVE_AT, STEPS)), full_weights(engine)
        if torch.distributed.get_rank() == 0:
            convert_to_universal(os.path.join(root, "t"), os.path.join(root, "t_universal"),
                                 inject_missing_state=True)
        torch.distributed.barrier()
        groups.reset()
        resumed = autotp_engine(*loaded, GLOBAL_BATCH, checkpoint={"load_universal": True})
        resumed.load_checkpoint(root)   # the tag from latest_universal
        steps = resumed.global_steps
        losses, got = _train(resumed, range(SAVE_AT, STEPS)), full_weights(resumed)
        return {"loss": max(abs(a - b) / b for a, b in zip(losses, continued)), "steps": steps,
                "param": max((got[k] - expected[k]).abs().max().item() for k in expected)}
    finally:
        groups.reset()


CASES = {   # name: (saved tp, stage), (loaded tp, stage)
    "tp2_z1_to_tp1_dp2_z3": ((2, 1), (1, 3)),
    "tp1_dp2_z2_to_tp2_z3": ((1, 2), (2, 3)),
    "tp2_z3_to_tp1_dp2_z1": ((2, 3), (1, 1)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_autotp_checkpoint_resumes_at_another_tp_size_through_universal(case, tmp_path):
    saved, loaded = CASES[case]
    for rank, result in enumerate(run_on_ranks(_through_universal, 2, saved, loaded, str(tmp_path))):
        assert result["steps"] == SAVE_AT, (rank, result)
        assert result["loss"] < TOL and result["param"] < TOL, (rank, result)
