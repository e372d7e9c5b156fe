"""save_checkpoint / load_checkpoint: a resumed run continues bitwise like the uninterrupted one."""

import os

import pytest
import torch

import zerospeed
from distributed import run_on_ranks
from parity import global_batches, make_model, micro_batch

from zerospeed.checkpoint.deepspeed_compat import DEEPSPEED_GLOBALS

GLOBAL_BATCH, STEPS_BEFORE, STEPS_AFTER = 12, 3, 5
PRECISION = {"fp32": {}, "bf16": {"bf16": {"enabled": True}},
             "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8}}}


def config_for(stage, dtype, world_size):
    return {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world_size,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 4}},
            "gradient_clipping": 1.0, "zero_optimization": zero_section(stage), **PRECISION[dtype]}


def zero_section(stage):
    # threshold 0: even the tiny test model's params are partitioned at stage 3
    return {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}


def make_engine(stage, dtype, seed=0):
    world_size = torch.distributed.get_world_size()
    engine, _, _, _ = zerospeed.initialize(model=make_model(seed), config=config_for(stage, dtype, world_size))
    return engine


def train(engine, batches):
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    dtype = next(engine.module.parameters()).dtype
    losses = []
    for batch in batches:
        x, y = micro_batch(batch, 0, rank, GLOBAL_BATCH // world_size, world_size)
        loss = engine(x.to(dtype), y.to(dtype))
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())
    return losses


def _resume(stage, dtype, save_dir):
    batches = global_batches(STEPS_BEFORE + STEPS_AFTER, GLOBAL_BATCH)
    engine = make_engine(stage, dtype)
    train(engine, batches[:STEPS_BEFORE])
    engine.save_checkpoint(save_dir, client_state={"epoch": 7, "note": "hi"})
    expected = train(engine, batches[STEPS_BEFORE:])
    fresh = make_engine(stage, dtype, seed=5)
    path, client = fresh.load_checkpoint(save_dir)
    assert fresh.global_steps == STEPS_BEFORE and fresh.global_samples == STEPS_BEFORE * GLOBAL_BATCH
    resumed = train(fresh, batches[STEPS_BEFORE:])
    lr = fresh.get_lr()[0] == engine.get_lr()[0]
    return expected, resumed, path, client["epoch"], client["note"], lr


CASES = [(0, "fp32"), (0, "bf16"), (0, "fp16"), (1, "fp32"), (2, "fp32"), (2, "bf16"), (1, "fp16"), (3, "fp32"),
         (3, "bf16")]


@pytest.mark.parametrize("stage,dtype", CASES)
def test_resume_continues_bitwise(stage, dtype, tmp_path):
    for expected, resumed, path, epoch, note, same_lr in run_on_ranks(_resume, 2, stage, dtype, str(tmp_path)):
        assert resumed == expected
        assert (epoch, note, same_lr) == (7, "hi", True)
        model_file = "zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"
        assert path.startswith(os.path.join(str(tmp_path), f"global_step{STEPS_BEFORE}", ""))
        assert stage == 3 or path.endswith(model_file)
    assert (tmp_path / "latest").read_text() == f"global_step{STEPS_BEFORE}"
    assert (tmp_path / "zero_to_fp32.py").exists()
    for name in os.listdir(tmp_path / f"global_step{STEPS_BEFORE}"):
        # Model files hold only torch and plain types. Optim files also hold DeepSpeed's loss
        # scaler / stage / fragment classes (so DeepSpeed can resume from them), which load
        # weights-only through exactly that allowlist of four inert stand-ins.
        if name.endswith("_model_states.pt"):
            torch.load(tmp_path / f"global_step{STEPS_BEFORE}" / name, weights_only=True)
        elif name.endswith(".pt"):
            with torch.serialization.safe_globals(DEEPSPEED_GLOBALS):
                torch.load(tmp_path / f"global_step{STEPS_BEFORE}" / name, weights_only=True)
