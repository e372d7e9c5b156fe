"""Muon with `offload_optimizer: nvme` at ZeRO 1-3 on 2 gloo ranks, swap files under tmp_path.

The update equals single-process Muon on full matrices (muon_models.py's reference, fp32, 1e-5),
with clipping or gradient accumulation too. Each Muon partition is one swap unit of its own
swapper, whose staging buffers fit it, while the AdamW units stay cut at the swap unit size in
buffers of that size ([Note: unit files] in zerospeed/runtime/zero/offload/unit_files.py). With
one staging buffer per swapper and two units of each kind, every step writes units back and reads
them again: the files, read back raw, hold each evicted unit's master and its Muon momentum or
AdamW moments, changed from the zeros they were created with. A checkpoint resumes bit for bit,
nvme to nvme and across nvme, cpu and no offload.
"""

from __future__ import annotations

import os

import pytest
import torch
from distributed import run_on_ranks
from muon_models import assert_ranks_match_reference, batches, config, make_model, reference_run

import zerospeed
from zerospeed.runtime.zero.offload.aio_engine import aligned_bytes
from zerospeed.runtime.zero.offload.optimizer_swapper import aligned_numel

MICRO, WORLD, STEPS = 2, 2, 3
MUON = {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.1}
ADAM = {"lr": 2e-3, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.1}
BLOCK = {"muon_lr": MUON["lr"], "adam_lr": ADAM["lr"], "momentum": MUON["momentum"],
         "weight_decay": 0.1, "betas": [0.9, 0.95], "eps": 1e-10}
SUB_GROUP_SIZE = 300      # cuts the AdamW partitions into 2-3 units, and would cut Muon's


def _offload(kind: str | None, nvme_path: str) -> dict | None:
    if kind == "nvme":
        return {"device": "nvme", "nvme_path": nvme_path, "pin_memory": False, "buffer_count": 1}
    return {"device": "cpu", "pin_memory": False} if kind == "cpu" else None


def _config(stage: int, offload: dict | None, clip: float = 0.0, accumulation: int = 1,
            momentum_in_memory: bool = False) -> dict:
    cfg = config(stage, MICRO, BLOCK, gradient_clipping=clip)
    cfg["gradient_accumulation_steps"] = accumulation
    cfg["zero_optimization"]["sub_group_size"] = SUB_GROUP_SIZE
    if offload is not None:
        cfg["zero_optimization"]["offload_optimizer"] = offload
    if momentum_in_memory:
        cfg["zero_optimization"]["save_muon_momentum_buffer_in_memory"] = True
    return cfg


def _two_groups(model: torch.nn.Module) -> list[dict]:
    """Two incoming param groups, so each ZeRO 1/2 rank holds two Muon partitions (and two AdamW)."""
    named = list(model.named_parameters())
    first = {"q_proj.weight", "up.weight", "embed_tokens.weight", "up.bias"}
    return [{"params": [p for n, p in named if n in first]}, {"params": [p for n, p in named if n not in first]}]


def _engine(stage: int, offload: dict | None, seed: int = 0, groups: bool = False,
            **options) -> zerospeed.DeepSpeedEngine:
    model = make_model(seed)
    params = _two_groups(model) if groups else None
    cfg = _config(stage, offload, **options)
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=params, config=cfg)
    return engine


def _full_params(engine: zerospeed.DeepSpeedEngine) -> dict[str, torch.Tensor]:
    params = dict(engine.module.named_parameters())
    with zerospeed.zero.GatheredParameters(list(params.values())):
        return {name: p.detach().clone() for name, p in params.items()}


def _train(engine: zerospeed.DeepSpeedEngine, data: list, accumulation: int = 1) -> list[float]:
    """Rank r's k-th micro-batch of a step is rows [(k * W + r) * MICRO, ...) of its global batch."""
    rank, losses = torch.distributed.get_rank(), []
    for tokens, labels in data:
        step_losses = []
        for k in range(accumulation):
            rows = slice((k * WORLD + rank) * MICRO, (k * WORLD + rank + 1) * MICRO)
            loss = engine(tokens[rows], labels[rows])
            engine.backward(loss)
            engine.step()
            step_losses.append(loss.item())
        losses.append(sum(step_losses) / accumulation)
    return losses


def _read_unit_file(swapper, uid: int) -> list[torch.Tensor]:
    """A unit's file as written: `num_tensors` fp32 tensors at 4 KiB-aligned offsets."""
    numel = swapper.unit_numel(uid)
    with open(swapper.path(uid), "rb") as handle:
        data = torch.frombuffer(bytearray(handle.read()), dtype=torch.float32)
    stride = aligned_numel(numel)
    return [data[t * stride:t * stride + numel].clone() for t in range(swapper.num_tensors)]


def _files_hold_the_state(engine: zerospeed.DeepSpeedEngine) -> dict:
    """What the swap files say about the units not cached in a staging buffer right now; read
    before anything else swaps units in."""
    holder = engine.optimizer.offload
    figures = {"muon_units": [], "adam_units": [], "evicted": {}}
    for unit in holder.units:
        swapper = holder.files.of(unit.uid)
        assert os.path.getsize(swapper.path(unit.uid)) == swapper.num_tensors * aligned_bytes(4 * unit.numel)
        kind = "muon_units" if unit.group["use_muon"] else "adam_units"
        figures[kind].append((unit.numel, unit.layout.whole, swapper.num_tensors))
        if not swapper.in_buffer(unit.uid):
            figures["evicted"][unit.uid] = (kind, unit.partition, unit.offset, _read_unit_file(swapper, unit.uid))
    state = holder.optimizer_state_dict()["state"]
    for uid, (kind, partition, offset, tensors) in figures["evicted"].items():
        unit, entry = holder.units[uid], state[partition]
        master = holder.master_partition(partition).narrow(0, offset, unit.numel)
        names = ("momentum_buffer",) if kind == "muon_units" else ("exp_avg", "exp_avg_sq")
        expected = [master] + [entry[n].narrow(0, offset, unit.numel) for n in names[:len(tensors) - 1]]
        assert all(torch.equal(a, b) for a, b in zip(tensors, expected)), (kind, uid)
        assert all(t.abs().sum() > 0 for t in tensors[1:]), (kind, uid)     # not the zeros of creation
    whole = holder.files.whole
    return {**figures, "evicted": sorted(k for k, *_ in figures["evicted"].values()),
            "elementwise_slot": holder.swapper.slot_numel, "unit_numel": holder.unit_numel,
            "whole_slot": whole.slot_numel, "whole_buffers": len(whole.pool.buffers),
            "in_memory": sum(1 for s in engine.basic_optimizer.state.values() if s.get("momentum_buffer", None)
                             is not None and s["momentum_buffer"].numel() > 0)}


def _nvme_run(stage: int, nvme_path: str, clip: float, accumulation: int, groups: bool, in_memory: bool) -> tuple:
    engine = _engine(stage, _offload("nvme", nvme_path), clip=clip, accumulation=accumulation, groups=groups,
                     momentum_in_memory=in_memory)
    losses = _train(engine, batches(STEPS, MICRO * WORLD * accumulation), accumulation)
    files = _files_hold_the_state(engine)
    return losses, _full_params(engine), engine.basic_optimizer.newton_schulz_calls, files


CASES = [(1, 0.0, 1, False, False), (2, 0.5, 1, True, False), (3, 0.0, 2, False, False), (3, 0.0, 1, False, True)]


@pytest.mark.parametrize("stage,clip,accumulation,groups,in_memory", CASES,
                         ids=["s1", "s2-clip-two-groups", "s3-accumulation", "s3-momentum-in-memory"])
def test_nvme_muon_equals_single_process_reference(stage, clip, accumulation, groups, in_memory, tmp_path) -> None:
    results = run_on_ranks(_nvme_run, WORLD, stage, str(tmp_path), clip, accumulation, groups, in_memory)
    data = batches(STEPS, MICRO * WORLD * accumulation)
    ref_losses, ref_params = reference_run(make_model(), data, MUON, ADAM, clip)
    assert_ranks_match_reference(results, ref_losses, ref_params, STEPS)
    for files in (r[3] for r in results):
        muon, adam = files["muon_units"], files["adam_units"]
        assert muon and all(whole for _, whole, _ in muon) and not any(whole for _, whole, _ in adam)
        # the Muon units are whole partitions beyond sub_group_size, in slots that fit the largest ...
        assert max(n for n, _, _ in muon) > max(SUB_GROUP_SIZE, files["unit_numel"])
        assert files["whole_slot"] == aligned_numel(max(n for n, _, _ in muon)) and files["whole_buffers"] == 1
        # ... while the AdamW units keep slots of the swap unit size
        assert files["elementwise_slot"] == aligned_numel(files["unit_numel"])
        assert all(n <= files["unit_numel"] and t == 3 for n, _, t in adam)
        assert all(t == (1 if in_memory else 2) for _, _, t in muon)
        assert files["in_memory"] == (len(muon) if in_memory else 0)
        assert "adam_units" in files["evicted"]
        assert (len(muon) > 1 and not in_memory) <= ("muon_units" in files["evicted"])


def _save_then_continue(stage: int, kind: str | None, nvme_path: str, save_dir: str) -> dict:
    engine = _engine(stage, _offload(kind, nvme_path))
    data = batches(4, MICRO * WORLD)
    _train(engine, data[:2])
    engine.save_checkpoint(save_dir)
    _train(engine, data[2:])
    return _full_params(engine)


def _resume(stage: int, kind: str | None, nvme_path: str, save_dir: str) -> dict:
    engine = _engine(stage, _offload(kind, nvme_path), seed=9)
    engine.load_checkpoint(save_dir)
    _train(engine, batches(4, MICRO * WORLD)[2:])
    return _full_params(engine)


@pytest.mark.parametrize("stage,saved_with,resumed_with", [(2, "nvme", "nvme"), (3, "nvme", "nvme"),
                                                          (3, "nvme", "cpu"), (1, None, "nvme")],
                         ids=["s2", "s3", "s3-to-cpu", "s1-from-device"])
def test_nvme_muon_resumes_bit_for_bit(stage: int, saved_with: str | None, resumed_with: str | None,
                                       tmp_path) -> None:
    save_dir = str(tmp_path / "ckpt")
    expected = run_on_ranks(_save_then_continue, WORLD, stage, saved_with, str(tmp_path / "a"), save_dir)
    resumed = run_on_ranks(_resume, WORLD, stage, resumed_with, str(tmp_path / "b"), save_dir)
    for theirs, ours in zip(expected, resumed):
        for name, value in theirs.items():
            assert torch.equal(ours[name], value), name
