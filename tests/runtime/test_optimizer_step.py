"""[Note: one step] (base_optimizer.py) holds at every stage: on an overflow the reported global
grad norm is the last applied step's (DeepSpeed's behaviour) and the monitor does not log it as the
skipped step's; gradients are unscaled by the scale they carry, also on a step that grows it."""

import csv
import math
import os

import pytest
import torch

import zerospeed
from distributed import run_on_ranks
from parity import global_batches, make_model, micro_batch

NUM_STEPS, GLOBAL_BATCH = 4, 8
STAGES = (0, 1, 2, 3)


def _train(stage, precision, overflow_at=(), csv_dir=None):
    rank = torch.distributed.get_rank()
    config = {"train_batch_size": GLOBAL_BATCH, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "gradient_clipping": 0.0,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}, **precision}
    if csv_dir is not None:
        config["csv_monitor"] = {"enabled": True, "output_path": csv_dir, "job_name": "run"}
    engine, _, _, _ = zerospeed.initialize(model=make_model(), config=config)
    norms, applied, samples = [], [], []
    for step, batch in enumerate(global_batches(NUM_STEPS, GLOBAL_BATCH)):
        x, y = micro_batch(batch, 0, rank, GLOBAL_BATCH // 2, 2)
        dtype = next(engine.module.parameters()).dtype
        loss = engine(x.to(dtype), y.to(dtype))
        if step in overflow_at and rank == 1:
            loss = loss * math.inf
        engine.backward(loss)
        engine.step()
        norms.append(engine.get_global_grad_norm())
        applied.append(engine.was_step_applied())
        samples.append(engine.global_samples)
    engine.monitoring.close()
    return norms, applied, samples


@pytest.mark.parametrize("stage", STAGES)
def test_overflow_keeps_the_last_applied_norm_and_the_monitor_skips_it(stage, tmp_path):
    fp16 = {"fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}}
    norms, applied, samples = run_on_ranks(_train, 2, stage, fp16, (2,), str(tmp_path))[0]
    assert applied == [True, True, False, True]
    assert all(n > 0 and math.isfinite(n) for n in norms)
    assert norms[2] == norms[1] and norms[3] != norms[2]
    with open(os.path.join(tmp_path, "run", "Train_Samples_grad_norm.csv"), newline="") as handle:
        rows = list(csv.reader(handle))[1:]
    logged = [(int(step), float(value)) for step, value in rows]
    expected = [(s, n) for s, n, a in zip(samples, norms, applied) if a]
    assert [step for step, _ in logged] == [step for step, _ in expected]
    assert [value for _, value in logged] == pytest.approx([value for _, value in expected], rel=1e-6)


@pytest.mark.parametrize("stage", STAGES)
def test_fp16_norm_is_unscaled_by_the_scale_the_gradients_carry(stage):
    """A window of one clean step doubles the scale inside every later step: the reported norm and
    the update must still match fp32 (dividing by the new scale would halve both)."""
    fp16 = {"fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1}}
    fp32_norms = run_on_ranks(_train, 2, 0, {})[0][0]
    fp16_norms = run_on_ranks(_train, 2, stage, fp16)[0][0]
    assert fp16_norms == pytest.approx(fp32_norms, rel=2e-2)
