"""Muon checkpoints: momentum and Adam moments resume exactly, and reshard with the dp size and stage."""

from __future__ import annotations

import pytest
import torch
from distributed import run_on_ranks
from muon_models import batches, config, make_model

import zerospeed
from zerospeed.checkpoint.layout import find_model_files
from zerospeed.checkpoint.manifest import load_file
from zerospeed.checkpoint.zero_checkpoint import discover, export_full_state

GLOBAL, BEFORE, AFTER = 4, 2, 2
BATCHES = batches(BEFORE + AFTER, GLOBAL)
BLOCK = {"muon_lr": 0.05, "adam_lr": 2e-3, "momentum": 0.9, "weight_decay": 0.1}


def _engine(stage: int, seed: int = 0) -> zerospeed.DeepSpeedEngine:
    world = torch.distributed.get_world_size()
    engine, _, _, _ = zerospeed.initialize(model=make_model(seed), config=config(stage, GLOBAL // world, BLOCK))
    return engine


def _train(engine: zerospeed.DeepSpeedEngine, data: list) -> list[float]:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    micro = GLOBAL // world
    losses = []
    for tokens, labels in data:
        rows = slice(rank * micro, (rank + 1) * micro)
        loss = engine(tokens[rows], labels[rows])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item() * micro / GLOBAL)   # summed over ranks: the global-batch mean
    return losses


def _save_then_continue(stage: int, save_dir: str) -> list[float]:
    engine = _engine(stage)
    _train(engine, BATCHES[:BEFORE])
    engine.save_checkpoint(save_dir)
    return _train(engine, BATCHES[BEFORE:])


def _load_resave_continue(stage: int, save_dir: str, resave_dir: str) -> list[float]:
    engine = _engine(stage, seed=9)
    engine.load_checkpoint(save_dir)
    engine.save_checkpoint(resave_dir)
    return _train(engine, BATCHES[BEFORE:])


def _full_state(save_dir: str):  # noqa: ANN202 - FullOptimizerState
    tag_dir = f"{save_dir}/global_step{BEFORE}"
    return export_full_state(discover(tag_dir, bf16_first=True), load_file(find_model_files(tag_dir)[0]))


CASES = [((2, 1), (2, 1)), ((2, 2), (2, 2)), ((2, 3), (2, 3)), ((2, 0), (2, 0)),
         ((2, 2), (1, 2)), ((1, 1), (2, 1)), ((2, 3), (1, 3)), ((1, 3), (2, 3)), ((2, 1), (2, 3))]


@pytest.mark.parametrize("before,after", CASES, ids=lambda c: f"w{c[0]}s{c[1]}")
def test_muon_checkpoint_resumes_and_reshards(before: tuple[int, int], after: tuple[int, int], tmp_path) -> None:
    (w_before, s_before), (w_after, s_after) = before, after
    expected = run_on_ranks(_save_then_continue, w_before, s_before, str(tmp_path / "a"))
    resumed = run_on_ranks(_load_resave_continue, w_after, s_after, str(tmp_path / "a"), str(tmp_path / "b"))
    saved, resaved = _full_state(str(tmp_path / "a")), _full_state(str(tmp_path / "b"))
    momentum = [name for name, keys in saved.moments.items() if "momentum_buffer" in keys]
    assert sorted(momentum) == ["down.weight", "odd.weight", "q_proj.weight", "up.weight"]
    for name in saved.fp32:
        assert torch.equal(saved.fp32[name], resaved.fp32[name]), name
        for key, value in saved.moments[name].items():
            assert torch.equal(value, resaved.moments[name][key]), (name, key)
    torch.testing.assert_close(torch.tensor(resumed).sum(0), torch.tensor(expected).sum(0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stage", [1, 3])
def test_universal_conversion_writes_each_parameter_its_own_states(stage: int, tmp_path) -> None:
    """[Note: streaming conversion] reads one state at a time; Muon's matrices hold a momentum
    buffer and the other parameters Adam's two moments, so a state absent from a parameter's group
    must not be written for it. Against the whole-model export of the same checkpoint."""
    from zerospeed.checkpoint.universal.convert import convert_to_universal

    run_on_ranks(_save_then_continue, 2, stage, str(tmp_path / "a"))
    out = tmp_path / "universal"
    convert_to_universal(f"{tmp_path / 'a'}/global_step{BEFORE}", str(out), inject_missing_state=True, chunk_bytes=1)
    full = _full_state(str(tmp_path / "a"))
    for name, master in full.fp32.items():
        files = sorted((out / "zero" / name).iterdir())
        expected = {"fp32", *full.moments[name], *({"step"} & set(full.scalars.get(name, {})))}
        assert {file.stem for file in files} == expected, name
        assert torch.equal(torch.load(out / "zero" / name / "fp32.pt", weights_only=True)["param"], master), name
        for key, value in full.moments[name].items():
            written = torch.load(out / "zero" / name / f"{key}.pt", weights_only=True)["param"]
            assert torch.equal(written, value), (name, key)
