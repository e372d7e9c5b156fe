"""MoE checkpoints through DeepSpeed's universal format: saved on 2 gloo ranks at one (expert-parallel
size, ZeRO stage), converted by `ds_to_universal` (each expert under its global id, from the saving
ranks' expert layout) and resumed with `"load_universal": true` at another. Every fp32 master and
Adam moment comes back bit for bit, per dense parameter and per global expert, and the next losses
equal the saving run continued (the global batch is the same at every size; fp32 tolerance, the
micro-batches land on other ranks)."""

from __future__ import annotations

import os

import pytest
import torch
from distributed import run_on_ranks
from test_moe_checkpoint import _stage3_state
from test_moe_engine import MICRO, MoEModel, _batches
from test_moe_zero12_reshard import GLOBAL_MICRO_BATCHES, _check, _train

import zerospeed


def _engine(ep_size: int, stage: int, universal: bool) -> tuple:
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = MoEModel(ep_size, k=2, drop_tokens=True)
    model.set_expert_weights(rank % ep_size)
    zero = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GLOBAL_MICRO_BATCHES // world_size,
              "zero_optimization": zero, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              **({"checkpoint": {"load_universal": True}} if universal else {})}
    engine, _, _, _ = zerospeed.initialize(model=model, config=config)
    return engine, model


def _save_convert_load(root: str, saved: tuple[int, int], layouts: list[tuple[int, int]]) -> dict:
    """One step at `saved` (ep size, stage), save, convert, the remaining step; then each of `layouts`
    loads the universal folder and trains the remaining step."""
    from zerospeed.checkpoint.universal.convert import convert_to_universal

    batches = _batches(GLOBAL_MICRO_BATCHES, 1)
    engine, model = _engine(*saved, universal=False)
    _train(engine, batches[:1], 0)
    engine.save_checkpoint(root, tag="t")
    state, continued = _stage3_state(model), _train(engine, batches[1:], 1)
    if torch.distributed.get_rank() == 0:
        convert_to_universal(os.path.join(root, "t"), os.path.join(root, "t_universal"), inject_missing_state=True)
    torch.distributed.barrier()
    loaded = []
    for ep_size, stage in layouts:
        engine, model = _engine(ep_size, stage, universal=True)
        engine.load_checkpoint(root)
        steps = engine.global_steps
        loaded.append({"state": _stage3_state(model), "losses": _train(engine, batches[1:], 1), "steps": steps})
    return {"saved": state, "continued": continued, "loaded": loaded}


@pytest.mark.parametrize("saved,layouts", [((2, 2), [(1, 1), (2, 3), (1, 3)]), ((1, 3), [(2, 2), (2, 1)])])
def test_moe_checkpoint_resumes_at_another_ep_size_and_stage_through_universal(saved, layouts, tmp_path):
    results = run_on_ranks(_save_convert_load, 2, str(tmp_path), saved, layouts)
    _check(results, [result["loaded"] for result in results], f"ep {saved[0]} stage {saved[1]} -> {layouts}")
    assert all(loaded["steps"] == 1 for result in results for loaded in result["loaded"])
