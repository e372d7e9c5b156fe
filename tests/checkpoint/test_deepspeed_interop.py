"""Interop with DeepSpeed 0.19.8 checkpoints, both ways.

Reading theirs needs no DeepSpeed: the fixtures under fixtures/deepspeed_0_19_8/ were written by
fixtures/make_deepspeed_fixtures.py (2 gloo ranks, stages 1-3) with what DeepSpeed itself reported
as every parameter's fp32 master and Adam moments (`expected.pt`). DeepSpeed reading ours runs
its zero_to_fp32 in a subprocess and is skipped when deepspeed is not installed.
"""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

import zerospeed
from distributed import run_on_ranks
from test_engine_checkpoint import make_engine, train, zero_section
from test_resharding import BATCHES

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


def _train_and_save(stage, save_dir):
    engine = make_engine(stage, "fp32")
    train(engine, BATCHES[:2])
    engine.save_checkpoint(save_dir)


_DEEPSPEED_READER = """
import sys, torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
torch.save({d: dict(get_fp32_state_dict_from_zero_checkpoint(d)) for d in sys.argv[2:]}, sys.argv[1])
"""


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed "
                    "(CI installs only the test extra; the committed fixtures cover the other direction)")
def test_deepspeed_zero_to_fp32_reads_our_checkpoints(tmp_path):
    dirs = [str(tmp_path / f"stage{stage}") for stage in (1, 2, 3)]
    for stage, save_dir in zip((1, 2, 3), dirs):
        run_on_ranks(_train_and_save, 2, stage, save_dir)
    out = str(tmp_path / "deepspeed.pt")
    subprocess.run([sys.executable, "-c", _DEEPSPEED_READER, out, *dirs], check=True, capture_output=True,
                   env={**os.environ, "DS_ACCELERATOR": "cpu"}, timeout=300)
    theirs = torch.load(out, weights_only=True)
    for save_dir in dirs:
        ours = get_fp32_state_dict_from_zero_checkpoint(save_dir)
        assert theirs[save_dir].keys() == ours.keys(), save_dir
        for name in ours:
            assert torch.equal(theirs[save_dir][name], ours[name]), (save_dir, name)
