"""Loading at another data-parallel size or ZeRO stage restores the same fp32 masters and moments."""

import pytest
import torch

from distributed import run_on_ranks
from test_engine_checkpoint import GLOBAL_BATCH, STEPS_AFTER, STEPS_BEFORE, make_engine, train
from parity import global_batches

from zerospeed.checkpoint.zero_checkpoint import discover, export_full_state
from zerospeed.checkpoint.manifest import load_file
from zerospeed.checkpoint.layout import find_model_files

BATCHES = global_batches(STEPS_BEFORE + STEPS_AFTER, GLOBAL_BATCH)


def _save_then_continue(stage, dtype, save_dir):
    engine = make_engine(stage, dtype)
    train(engine, BATCHES[:STEPS_BEFORE])
    engine.save_checkpoint(save_dir)
    return train(engine, BATCHES[STEPS_BEFORE:])


def _load_resave_continue(stage, dtype, save_dir, resave_dir, load_optimizer_states=True):
    engine = make_engine(stage, dtype, seed=9)
    engine.load_checkpoint(save_dir, load_optimizer_states=load_optimizer_states)
    engine.save_checkpoint(resave_dir)
    return train(engine, BATCHES[STEPS_BEFORE:])


def full_state(save_dir):
    tag_dir = f"{save_dir}/global_step{STEPS_BEFORE}"
    return export_full_state(discover(tag_dir, bf16_first=True), load_file(find_model_files(tag_dir)[0]))


def assert_same_full_state(a, b):
    assert a.fp32.keys() == b.fp32.keys()
    for name in a.fp32:
        assert torch.equal(a.fp32[name], b.fp32[name]), name
        assert a.moments[name].keys() == b.moments[name].keys()
        for key in a.moments[name]:
            assert torch.equal(a.moments[name][key], b.moments[name][key]), (name, key)
        assert {k: float(v) for k, v in a.scalars[name].items()} == {k: float(v) for k, v in b.scalars[name].items()}
    assert a.param_groups == b.param_groups


CASES = [((2, 2), (1, 2)), ((1, 1), (2, 1)), ((2, 2), (4, 2)), ((4, 1), (2, 2)), ((3, 2), (2, 1)),
         ((2, 0), (2, 2)), ((2, 2), (2, 0)), ((1, 2), (3, 0)),
         ((2, 3), (2, 2)), ((1, 1), (3, 3)), ((2, 3), (1, 3)), ((2, 3), (4, 3))]


@pytest.mark.parametrize("before,after", CASES, ids=lambda c: f"w{c[0]}s{c[1]}")
@pytest.mark.parametrize("dtype", ["fp32"])
def test_reshard_restores_masters_and_moments(before, after, dtype, tmp_path):
    (w_before, s_before), (w_after, s_after) = before, after
    expected = run_on_ranks(_save_then_continue, w_before, s_before, dtype, str(tmp_path / "a"))
    resumed = run_on_ranks(_load_resave_continue, w_after, s_after, dtype, str(tmp_path / "a"), str(tmp_path / "b"))
    assert_same_full_state(full_state(tmp_path / "a"), full_state(tmp_path / "b"))
    # each rank's loss is over its own rows: compare the global-batch mean
    torch.testing.assert_close(torch.tensor(resumed).mean(0), torch.tensor(expected).mean(0), rtol=1e-5, atol=1e-6)


def test_reshard_bf16_stage_and_size_change(tmp_path):
    run_on_ranks(_save_then_continue, 2, 2, "bf16", str(tmp_path / "a"))
    run_on_ranks(_load_resave_continue, 1, 1, "bf16", str(tmp_path / "a"), str(tmp_path / "b"))
    assert_same_full_state(full_state(tmp_path / "a"), full_state(tmp_path / "b"))


def test_stage3_without_optimizer_states_rebuilds_weights_from_optim_files(tmp_path):
    """Stage-3 model files hold empty tensors: the weights come from the saved fp32 masters."""
    run_on_ranks(_save_then_continue, 2, 3, "fp32", str(tmp_path / "a"))
    run_on_ranks(_load_resave_continue, 1, 3, "fp32", str(tmp_path / "a"), str(tmp_path / "b"), False)
    saved, resaved = full_state(tmp_path / "a"), full_state(tmp_path / "b")
    assert saved.fp32.keys() == resaved.fp32.keys()
    for name in saved.fp32:
        assert torch.equal(saved.fp32[name], resaved.fp32[name]), name
    assert not resaved.moments   # fresh optimizer: no moments were loaded
