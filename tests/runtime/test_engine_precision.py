"""Stage-0 mixed precision: bf16 tracks fp32; fp16 overflows skip the step and the scheduler."""

import math
import re

import pytest
import torch

import zerospeed
from distributed import run_on_ranks
from parity import global_batches, make_model, micro_batch

NUM_STEPS, GLOBAL_BATCH = 20, 16


def _config(**extra):
    return {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": GLOBAL_BATCH // 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "gradient_clipping": 0.0, **extra}


def _train(config, inject_overflow_at=(), stage=0):
    config = {**config, "zero_optimization": {"stage": stage}}
    rank = torch.distributed.get_rank()
    engine, optimizer, _, scheduler = zerospeed.initialize(model=make_model(), config=config)
    losses, scales, lrs, applied = [], [], [], []
    for step, batch in enumerate(global_batches(NUM_STEPS, GLOBAL_BATCH)):
        x, y = micro_batch(batch, 0, rank, GLOBAL_BATCH // 2, 2)
        dtype = next(engine.module.parameters()).dtype
        loss = engine(x.to(dtype), y.to(dtype))
        if step in inject_overflow_at and rank == 1:
            loss = loss * math.inf  # one rank's gradients overflow: every rank must skip
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())
        scales.append(optimizer.cur_scale)
        lrs.append(engine.get_lr()[0])
        applied.append(engine.was_step_applied())
    params = [p.detach().float().clone() for p in engine.module.parameters()]
    return losses, scales, lrs, applied, engine.skipped_steps, engine.global_steps, params


def test_bf16_stays_within_1e_2_of_fp32():
    fp32 = run_on_ranks(_train, 2, _config())[0]
    bf16 = run_on_ranks(_train, 2, _config(bf16={"enabled": True}))[0]
    assert next(iter(bf16[6])).dtype == torch.float32
    for loss32, loss16 in zip(fp32[0], bf16[0]):
        assert abs(loss32 - loss16) <= 1e-2 * max(1.0, abs(loss32))
    for p32, p16 in zip(fp32[6], bf16[6]):
        assert (p32 - p16).abs().max() <= 1e-2


def _accumulation_dtypes():
    """bf16 params, `data_types.grad_accum_dtype` fp32, 2 micro-batches a step: where each gradient
    stands after the first micro-batch, and the step's loss."""
    config = {**_config(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"}),
              "train_batch_size": 2 * GLOBAL_BATCH, "zero_optimization": {"stage": 0}}
    engine, optimizer, _, _ = zerospeed.initialize(model=make_model(), config=config)
    rank = torch.distributed.get_rank()
    batch = global_batches(1, 2 * GLOBAL_BATCH)[0]
    for micro_step in range(2):
        x, y = micro_batch(batch, micro_step, rank, GLOBAL_BATCH // 2, 2)
        engine.backward(engine(x.bfloat16(), y.bfloat16()))
        if micro_step == 0:
            in_param = [p.grad is not None for p in engine.module.parameters()]
            accumulators = [a.dtype for a in optimizer.gradient_views()]
        engine.step()
    return in_param, accumulators, engine.global_steps


def test_bf16_gradients_accumulate_in_an_fp32_buffer_when_asked():
    in_param, accumulators, global_steps = run_on_ranks(_accumulation_dtypes, 2)[0]
    assert not any(in_param) and accumulators == [torch.float32] * len(accumulators) and global_steps == 1


def test_fp16_overflow_skips_step_and_scheduler_and_halves_scale():
    fp16 = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1, "loss_scale_window": 1000}
    scheduler = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                "warmup_num_steps": 10, "warmup_type": "linear"}}
    results = run_on_ranks(_train, 2, _config(fp16=fp16, scheduler=scheduler), (3, 4))
    losses, scales, lrs, applied, skipped, global_steps, _ = results[0]
    assert skipped == 2 and global_steps == NUM_STEPS
    assert applied[:3] == [True] * 3 and applied[3:5] == [False, False] and all(applied[5:])
    assert scales[:3] == [256.0] * 3 and scales[3] == 128.0 and scales[4] == 64.0 and scales[-1] == 64.0
    # WarmupLR (linear): after n scheduler steps lr = max_lr * (n - 1) / 10 (DeepSpeed's iteration
    # count starts at 0); the scheduler did not advance on the two skipped steps.
    applied_count = [1, 2, 3, 3, 3] + list(range(4, NUM_STEPS - 1))
    expected_lr = [1e-2 * min(1.0, (n - 1) / 10) for n in applied_count]
    assert lrs == pytest.approx(expected_lr)
    assert results[1][4] == 2  # the rank without the inf skipped too


def test_fp16_matches_fp32_without_overflow():
    fp32 = run_on_ranks(_train, 2, _config())[0]
    fp16 = run_on_ranks(_train, 2, _config(fp16={"enabled": True, "initial_scale_power": 10}))[0]
    assert fp16[4] == 0
    for loss32, loss16 in zip(fp32[0], fp16[0]):
        assert abs(loss32 - loss16) <= 1e-2 * max(1.0, abs(loss32))


def _profile_one_step(tmp_path):
    output = f"{tmp_path}/flops.txt"
    config = {**_config(), "flops_profiler": {"enabled": True, "profile_step": 2, "output_file": output},
              "wall_clock_breakdown": True, "steps_per_print": 1}
    engine, _, _, _ = zerospeed.initialize(model=make_model(), config=config)
    rank = torch.distributed.get_rank()
    for batch in global_batches(3, GLOBAL_BATCH):
        x, y = micro_batch(batch, 0, rank, GLOBAL_BATCH // 2, 2)
        engine.backward(engine(x, y))
        engine.step()
    return open(output).read() if rank == 0 else None


def test_flops_profiler_block_reports_the_profiled_step(tmp_path):
    report = run_on_ranks(_profile_one_step, 2, str(tmp_path))[0]
    # fc1 8x16, fc2 16x16, head 16x4 (+ biases) on a micro-batch of 8 rows:
    # params 144 + 272 + 68 = 484; MACs 8 * (128 + 256 + 64) = 3584, of which fc1 8 * 128 = 1024.
    assert re.search(r"params per device:\s+484\.00\n", report)
    assert re.search(r"fwd MACs per device:\s+3\.58 KMACs\n", report)
    assert "(fc1): Linear(144.00 = 29.75% Params, 1.02 KMACs = 28.57% MACs" in report
    assert "Profile summary at step 2:" in report
