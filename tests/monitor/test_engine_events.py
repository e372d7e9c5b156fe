"""Engine level: on 2 ranks, the TensorBoard / CSV events equal what the engine reported, and the
per-rank estimate equals the optimizer's measured `memory_breakdown()` (stages the tree supports)."""

from __future__ import annotations

import csv
import os

import pytest
import torch

from distributed import run_on_ranks

NUM_STEPS, GLOBAL_BATCH = 4, 8


def _train(tmp_dir: str, zero_stage: int, monitors: bool) -> dict:
    import zerospeed
    from parity import ds_optimizer_block, global_batches, make_model, micro_batch

    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    config = {"train_batch_size": GLOBAL_BATCH, "optimizer": ds_optimizer_block("AdamW", 1e-2, 0.0),
              # threshold 0: the tiny model's params would otherwise all stay whole (persistent) at stage 3
              "zero_optimization": {"stage": zero_stage, "stage3_param_persistence_threshold": 0}}
    if monitors:
        for block in ("tensorboard", "csv_monitor"):
            config[block] = {"enabled": True, "output_path": os.path.join(tmp_dir, block), "job_name": "run"}
    engine, _, _, _ = zerospeed.initialize(model=make_model(), config=config)  # every stage exists: no skip
    micro = GLOBAL_BATCH // world_size
    reported, breakdown = [], {}
    for batch in global_batches(NUM_STEPS, GLOBAL_BATCH):
        loss = engine(*micro_batch(batch, 0, rank, micro, world_size))
        engine.backward(loss)
        breakdown = engine.optimizer.memory_breakdown()  # the peak: grads held, optimizer states exist
        engine.step()
        # The expected loss is the one forward returned (one micro-batch per step: the step's mean),
        # not anything the monitoring code under test computed.
        reported.append((engine.global_samples, loss.item(), engine.get_lr()[0]))
    engine.monitoring.close()
    return {"reported": reported, "breakdown": breakdown,
            "num_params": sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())}


def test_monitor_events_equal_engine_reports(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    results = run_on_ranks(_train, 2, str(tmp_path), 0, True)
    reported = results[0]["reported"]  # rank 0 writes, its own numbers
    accumulator = EventAccumulator(os.path.join(tmp_path, "tensorboard", "run"))
    accumulator.Reload()
    for tag, column in (("Train/Samples/train_loss", 1), ("Train/Samples/lr", 2)):
        events = accumulator.Scalars(tag)
        assert [e.step for e in events] == [r[0] for r in reported]
        assert [e.value for e in events] == pytest.approx([r[column] for r in reported], rel=1e-6)
    with open(os.path.join(tmp_path, "csv_monitor", "run", "Train_Samples_train_loss.csv"), newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "train_loss"]
    assert [(int(s), float(v)) for s, v in rows[1:]] == [(r[0], pytest.approx(r[1], rel=1e-6)) for r in reported]
    assert len(os.listdir(os.path.join(tmp_path, "tensorboard", "run"))) == 1  # rank 1 wrote nothing


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_estimate_matches_memory_breakdown(tmp_path, zero_stage):
    from zerospeed.runtime.zero.estimators import estimate_model_states_bytes

    results = run_on_ranks(_train, 2, str(tmp_path), zero_stage, False)
    for result in results:
        estimate = estimate_model_states_bytes(result["num_params"], 2, zero_stage, "fp32").as_dict()
        measured = result["breakdown"]
        assert measured["total"] == pytest.approx(estimate["total"], rel=0.05), (measured, estimate)
