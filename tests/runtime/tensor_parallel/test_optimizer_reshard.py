"""An AutoTP checkpoint loads at another tp size with its optimizer state: a tiny Llama trained
with AdamW at tp 2 (2 ranks, dp 1), saved, and resumed at tp 1 (dp 2), and the other way round,
continues exactly as the uninterrupted run (losses and full weights, fp32). The ZeRO stage and
dp size change at the same time (saved at 0 / 2, loaded at 1), so the moments go through the full
layout both ways. Adam makes a lost or misplaced moment show at once: a fresh optimizer's first
step is lr * sign(grad).
"""

from __future__ import annotations

import os


from tests.distributed import run_on_ranks
from tp_models import autotp_engine, full_weights, global_batches, train_dp_slices

GLOBAL_BATCH, SAVE_AT, STEPS, TOL = 2, 2, 4, 1e-6


def _train(engine, steps) -> list[float]:
    batches = global_batches(GLOBAL_BATCH, STEPS)
    return train_dp_slices(engine, [batches[step] for step in steps])[0]


def _resume_at_other_tp(saved_tp: int, saved_stage: int, loaded_tp: int, loaded_stage: int, save_dir: str) -> dict:
    from zerospeed.comm import groups

    try:
        engine = autotp_engine(saved_tp, saved_stage, GLOBAL_BATCH)
        _train(engine, range(SAVE_AT))
        engine.save_checkpoint(save_dir, tag="t")
        continued, expected = _train(engine, range(SAVE_AT, STEPS)), full_weights(engine)
        groups.reset()
        resumed = autotp_engine(loaded_tp, loaded_stage, GLOBAL_BATCH)
        resumed.load_checkpoint(save_dir, tag="t")
        steps = resumed.global_steps
        assert engine.train_batch_size() == resumed.train_batch_size() == GLOBAL_BATCH
        losses, got = _train(resumed, range(SAVE_AT, STEPS)), full_weights(resumed)
        return {"loss": max(abs(a - b) / b for a, b in zip(losses, continued)), "steps": steps,
                "param": max((got[k] - expected[k]).abs().max().item() for k in expected),
                "files": sorted(os.listdir(os.path.join(save_dir, "t")))}
    finally:
        groups.reset()


def _runs(root: str) -> dict:
    return {"tp2_to_tp1": _resume_at_other_tp(2, 0, 1, 1, os.path.join(root, "a")),
            "tp1_to_tp2": _resume_at_other_tp(1, 2, 2, 1, os.path.join(root, "b"))}


def test_optimizer_state_reshards_across_tp_sizes(tmp_path):
    results = run_on_ranks(_runs, 2, str(tmp_path))
    for rank, by_case in enumerate(results):
        for case, result in by_case.items():
            assert result["steps"] == SAVE_AT, (rank, case)
            assert result["loss"] < TOL and result["param"] < TOL, (rank, case, result)
    assert {"mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"} <= set(results[0]["tp2_to_tp1"]["files"])
