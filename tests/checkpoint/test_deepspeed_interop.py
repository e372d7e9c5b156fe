"""Interop with DeepSpeed 0.19.8 checkpoints, both ways.

Reading theirs needs no DeepSpeed: the fixtures under fixtures/deepspeed_0_19_8/ were written by
fixtures/make_deepspeed_fixtures.py (2 gloo ranks, stages 1-3) with what DeepSpeed itself reported
as every parameter's fp32 master and Adam moments (`expected.pt`); they also cover loading them at
another world size. Both directions with live DeepSpeed, at stages 0-3 and in bf16, are in
tests/compat/ (test_checkpoint_interop.py, test_zero_to_fp32.py).
"""

import os

import pytest
import torch

import zerospeed
from distributed import run_on_ranks
from test_engine_checkpoint import zero_section

from zerospeed.checkpoint.layout import find_model_files
from zerospeed.checkpoint.manifest import load_file
from zerospeed.checkpoint.zero_checkpoint import discover, export_full_state
from zerospeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "deepspeed_0_19_8")
STEPS = 2   # make_deepspeed_fixtures.STEPS


def _fixture_model():
    torch.manual_seed(3)   # any init: the checkpoint overwrites it
    return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))


def _load_and_resave(stage, fixture_dir, resave_dir):
    world_size = torch.distributed.get_world_size()
    config = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4 // world_size,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
              "zero_optimization": zero_section(stage)}
    engine, _, _, _ = zerospeed.initialize(model=_fixture_model(), config=config)
    engine.load_checkpoint(fixture_dir)
    assert engine.global_steps == STEPS
    engine.save_checkpoint(resave_dir)


@pytest.mark.parametrize("stage,world_size", [(1, 2), (2, 2), (3, 2), (3, 1)])
def test_engine_loads_deepspeed_checkpoint(stage, world_size, tmp_path):
    fixture_dir = os.path.join(FIXTURES, f"stage{stage}")
    expected = torch.load(os.path.join(fixture_dir, "expected.pt"), weights_only=True)
    run_on_ranks(_load_and_resave, world_size, stage, fixture_dir, str(tmp_path))
    tag_dir = str(tmp_path / f"global_step{STEPS}")
    full = export_full_state(discover(tag_dir, bf16_first=False), load_file(find_model_files(tag_dir)[0]))
    assert full.fp32.keys() == expected.keys()
    for name, want in expected.items():
        assert torch.equal(full.fp32[name], want["fp32"]), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(full.moments[name][key], want[key]), (name, key)
        assert int(full.scalars[name]["step"]) == STEPS


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_our_zero_to_fp32_reads_deepspeed_checkpoint(stage):
    fixture_dir = os.path.join(FIXTURES, f"stage{stage}")
    expected = torch.load(os.path.join(fixture_dir, "expected.pt"), weights_only=True)
    state = get_fp32_state_dict_from_zero_checkpoint(fixture_dir)
    assert state.keys() == expected.keys()
    for name, want in expected.items():
        assert torch.equal(state[name], want["fp32"]), name
