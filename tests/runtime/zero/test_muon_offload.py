"""Muon with `offload_optimizer: cpu` at ZeRO 1-3 on 2 gloo ranks.

The update equals single-process Muon on full matrices (muon_models.py's reference), the Muon
momentum and the AdamW moments live in the offload holder's host units, each Muon partition is one
unit although `sub_group_size` would cut it ([Note: whole-partition units]), and a checkpoint
resumes bit for bit, with or without offload on either side. NVMe: test_muon_nvme.py.
"""

from __future__ import annotations

import pytest
import torch
from distributed import run_on_ranks
from muon_models import MUON_NAMES, assert_ranks_match_reference, batches, config, make_model, reference_run

import zerospeed
from zerospeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

MICRO, WORLD, STEPS = 2, 2, 3
MUON = {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.1}
ADAM = {"lr": 2e-3, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.1}
BLOCK = {"muon_lr": MUON["lr"], "adam_lr": ADAM["lr"], "momentum": MUON["momentum"],
         "weight_decay": 0.1, "betas": [0.9, 0.95], "eps": 1e-10}
CPU = {"device": "cpu", "pin_memory": False}


def _config(stage: int, offload: dict | None, clip: float = 0.0) -> dict:
    cfg = config(stage, MICRO, BLOCK, gradient_clipping=clip)
    if offload is not None:
        cfg["zero_optimization"]["offload_optimizer"] = offload
    return cfg


def _full_params(engine: zerospeed.DeepSpeedEngine) -> dict[str, torch.Tensor]:
    params = dict(engine.module.named_parameters())
    with zerospeed.zero.GatheredParameters(list(params.values())):
        return {name: p.detach().clone() for name, p in params.items()}


def _train(engine: zerospeed.DeepSpeedEngine, data: list) -> list[float]:
    rank = torch.distributed.get_rank()
    losses = []
    for tokens, labels in data:
        rows = slice(rank * MICRO, (rank + 1) * MICRO)
        loss = engine(tokens[rows], labels[rows])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _where_the_state_lives(engine: zerospeed.DeepSpeedEngine) -> dict[str, int]:
    """Muon momentum / Adam moment elements held by the offload holder's units, and Muon units."""
    holder, basic = engine.optimizer.offload, engine.basic_optimizer
    assert holder is not None and isinstance(basic, MuonWithAuxAdam)
    held = {"momentum_buffer": 0, "exp_avg": 0, "exp_avg_sq": 0, "muon_units": 0}
    unit_masters = {id(unit.master) for unit in holder.units}
    for param, state in basic.state.items():
        assert id(param) in unit_masters   # nothing stepped outside the holder's units
        for key in ("momentum_buffer", "exp_avg", "exp_avg_sq"):
            if key in state:
                assert state[key].device.type == "cpu" and state[key].numel() == param.numel()
                held[key] += state[key].numel()
    held["muon_units"] = sum(1 for unit in holder.units if unit.group["use_muon"])
    held["muon_partitions"] = sum(1 for group in basic.param_groups if group["use_muon"] for _ in group["params"])
    return held


def _offloaded_run(stage: int, clip: float) -> tuple[list[float], dict, int, dict]:
    engine, _, _, _ = zerospeed.initialize(model=make_model(), config=_config(stage, CPU, clip))
    losses = _train(engine, batches(STEPS, MICRO * WORLD))
    return losses, _full_params(engine), engine.basic_optimizer.newton_schulz_calls, _where_the_state_lives(engine)


@pytest.mark.parametrize("stage,clip", [(1, 0.0), (2, 0.5), (3, 0.0)])
def test_offloaded_muon_equals_single_process_reference(stage: int, clip: float) -> None:
    results = run_on_ranks(_offloaded_run, WORLD, stage, clip)
    ref_losses, ref_params = reference_run(make_model(), batches(STEPS, MICRO * WORLD), MUON, ADAM, clip)
    assert_ranks_match_reference(results, ref_losses, ref_params, STEPS)
    muon_numel = sum(make_model().get_parameter(name).numel() for name in MUON_NAMES)
    held = [r[3] for r in results]
    # Every Muon element has its momentum on the host (padding at stage 1/2 included), AdamW's too.
    assert sum(h["momentum_buffer"] for h in held) >= muon_numel
    assert all(h["exp_avg"] == h["exp_avg_sq"] > 0 for h in held)
    # sub_group_size 700 would cut a Muon partition; each is one unit instead.
    assert all(h["muon_units"] == h["muon_partitions"] for h in held)


def _save_then_continue(stage: int, offload: dict | None, save_dir: str) -> dict:
    engine, _, _, _ = zerospeed.initialize(model=make_model(), config=_config(stage, offload))
    data = batches(4, MICRO * WORLD)
    _train(engine, data[:2])
    engine.save_checkpoint(save_dir)
    _train(engine, data[2:])
    return _full_params(engine)


def _resume(stage: int, offload: dict | None, save_dir: str) -> dict:
    engine, _, _, _ = zerospeed.initialize(model=make_model(seed=9), config=_config(stage, offload))
    engine.load_checkpoint(save_dir)
    _train(engine, batches(4, MICRO * WORLD)[2:])
    return _full_params(engine)


@pytest.mark.parametrize("stage,saved_with,resumed_with", [(1, CPU, CPU), (2, CPU, None), (3, CPU, CPU),
                                                          (3, None, CPU)], ids=["s1", "s2-to-device", "s3",
                                                                                "s3-from-device"])
def test_offloaded_muon_resumes_bit_for_bit(stage: int, saved_with: dict | None, resumed_with: dict | None,
                                             tmp_path) -> None:
    expected = run_on_ranks(_save_then_continue, WORLD, stage, saved_with, str(tmp_path))
    resumed = run_on_ranks(_resume, WORLD, stage, resumed_with, str(tmp_path))
    for theirs, ours in zip(expected, resumed):
        for name, value in theirs.items():
            assert torch.equal(ours[name], value), name

