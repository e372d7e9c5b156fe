"""A real SIGKILL during a save never loses the last good checkpoint; damaged files are named.

The named hook points of [Note: atomic save] are each killed once (one rank); then every rank is
killed at random moments over whole saves (two ranks, stages 1 and 3: crash_trials.py), and every
kill is followed by a load checked against an untouched run's values. benchmarks/reliability.py
runs the random trials N >= 50 times.
"""

import os
import random
import signal

import pytest
import torch

from crash_trials import check_recovered, golden_run, random_kill_trial, run_job
from distributed import run_on_ranks
from zerospeed.checkpoint.atomic import read_latest
from zerospeed.checkpoint.manifest import CheckpointIntegrityError, load_file, verify_files
from zerospeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

OPTIM = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
KILLED = [-signal.SIGKILL]


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    """The untouched runs, by (stage, world size): fp32 weights after every step."""
    cache = {}

    def get(stage, world_size, steps):
        key = (stage, world_size, steps)
        if key not in cache:
            cache[key] = golden_run(str(tmp_path_factory.mktemp("golden") / "ckpt"), stage, world_size, steps)
        return cache[key]
    return get


def _crash(save_dir, tags, point, step=2, steps=2):
    return run_job(str(save_dir), 1, 1, steps, tags, ZS_TEST_CRASH_AT=point, ZS_TEST_CRASH_STEP=str(step))


# (point, tags of steps 1 and 2, tag `latest` names afterwards)
POINTS = [("after_mkdir", "a,b", "a"), ("mid_file", "a,b", "a"), ("after_files", "a,b", "a"),
          ("before_rename", "a,b", "a"), ("after_rename", "a,b", "a"), ("before_latest", "a,b", "a"),
          ("after_latest", "a,b", "b"), ("after_clear_old", "a,a", "a"), ("between_renames", "a,a", "a"),
          ("before_move_in", "a,a", "a"), ("mid_file", "a,a", "a")]


@pytest.mark.parametrize("point,tags,expected", POINTS)
def test_sigkill_keeps_previous_checkpoint(tmp_path, golden, point, tags, expected):
    save_dir = tmp_path / "ckpt"
    assert _crash(save_dir, tags, point) == KILLED
    assert read_latest(str(save_dir)) == expected
    check_recovered(str(save_dir), golden(1, 1, 2).states)


def test_a_save_after_a_killed_save_keeps_the_last_good_copy(tmp_path, golden):
    """The window of issue 17: killed between the renames, then the next save of the same tag
    killed before its new directory is in place. `.a.old` is the only copy; it must survive."""
    save_dir = tmp_path / "ckpt"
    assert _crash(save_dir, "a", "between_renames") == KILLED
    assert not (save_dir / "a").exists() and (save_dir / ".a.old").is_dir()
    assert _crash(save_dir, "a", "before_move_in", step=2, steps=3) == KILLED  # resumes at step 1
    assert check_recovered(str(save_dir), golden(1, 1, 3).states) == 1
    assert run_job(str(save_dir), 1, 1, 3, "a") == [0]  # resumes from `.a.old`, then saves cleanly
    assert check_recovered(str(save_dir), golden(1, 1, 3).states) == 3
    assert not (save_dir / ".a.old").exists()


@pytest.mark.parametrize("stage", [1, 3])
def test_random_sigkills_of_every_rank_lose_nothing(tmp_path, golden, stage):
    """Two trials per stage here; benchmarks/reliability.py runs the same trials N >= 50 times."""
    reference = golden(stage, 2, 4)
    rng = random.Random(17 + stage)
    for _ in range(2):
        result = random_kill_trial(str(tmp_path / "ckpt"), reference, "a,a,b", rng)
        assert not result.error, result.error


@pytest.mark.parametrize("junk", [b"\xff\xfe\x00\x81binary", b"", b"global_step1\x00\x07"])
def test_unreadable_latest_is_named(tmp_path, junk):
    save_dir = tmp_path / "ckpt"
    assert run_job(str(save_dir), 1, 1, 1, "a") == [0]
    (save_dir / "latest").write_bytes(junk)
    latest = str(save_dir / "latest")
    with pytest.raises(CheckpointIntegrityError, match=latest):
        read_latest(str(save_dir))
    with pytest.raises(ValueError, match=latest):
        get_fp32_state_dict_from_zero_checkpoint(str(save_dir))
    with pytest.raises(Exception, match=latest):
        run_on_ranks(_load_engine, 1, str(save_dir))


def test_next_save_after_a_crash_succeeds(tmp_path, golden):
    save_dir = tmp_path / "ckpt"
    assert _crash(save_dir, "a,b", "after_files") == KILLED
    assert run_job(str(save_dir), 1, 1, 2, "c,b") == [0]
    assert read_latest(str(save_dir)) == "b"
    check_recovered(str(save_dir), golden(1, 1, 2).states)
    assert not [n for n in os.listdir(save_dir) if n.endswith(".tmp")]


@pytest.fixture()
def good_checkpoint(tmp_path):
    save_dir = tmp_path / "ckpt"
    assert run_job(str(save_dir), 1, 1, 2, "a,b") == [0]
    return save_dir, save_dir / "b" / OPTIM


def _damage(path, how):
    if how == "missing":
        path.unlink()
    elif how == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    else:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))


def _load_engine(save_dir):
    from test_engine_checkpoint import make_engine

    import zerospeed  # noqa: F401
    engine = make_engine(1, "fp32")
    engine.load_checkpoint(save_dir)


@pytest.mark.parametrize("how", ["missing", "truncated", "corrupt"])
def test_damaged_file_is_named(good_checkpoint, how):
    save_dir, optim = good_checkpoint
    _damage(optim, how)
    with pytest.raises(CheckpointIntegrityError, match=f"{OPTIM}.*{how}"):
        verify_files(str(save_dir / "b"))
    with pytest.raises((ValueError, FileNotFoundError), match=OPTIM):
        get_fp32_state_dict_from_zero_checkpoint(str(save_dir))
    with pytest.raises(Exception, match=OPTIM):
        run_on_ranks(_load_engine, 1, str(save_dir))


def test_pickled_file_is_refused_unless_opted_in(tmp_path):
    path = tmp_path / "x.pt"
    torch.save({"obj": Custom(), "t": torch.ones(1)}, path)
    with pytest.raises(ValueError, match="unpickling"):
        load_file(str(path))
    assert isinstance(load_file(str(path), allow_unpickling=True)["obj"], Custom)


class Custom:
    """Stands for a pickled Python class (DeepSpeed's loss scaler, enums)."""


def test_a_missing_model_file_is_named_from_the_manifest(good_checkpoint):
    """The manifest is checked before any file is looked for: a deleted model-states file is
    refused by its name, not reported as a directory without model files."""
    save_dir, _ = good_checkpoint
    (save_dir / "b" / "mp_rank_00_model_states.pt").unlink()
    with pytest.raises(Exception, match="mp_rank_00_model_states.pt is missing"):
        run_on_ranks(_load_engine, 1, str(save_dir))
