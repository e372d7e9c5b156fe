"""A real SIGKILL during a save never breaks the previous checkpoint; damaged files are named."""

import os
import signal
import subprocess
import sys

import pytest
import torch

from distributed import run_on_ranks
from zerospeed.checkpoint.atomic import CRASH_ENV, resolve_tag_dir
from zerospeed.checkpoint.manifest import CheckpointIntegrityError, load_file, verify_files
from zerospeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

SCRIPT = os.path.join(os.path.dirname(__file__), "crash_save.py")
OPTIM = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


def _run(save_dir, first, second, crash_at=None, load=False):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop(CRASH_ENV, None)
    if crash_at:
        env[CRASH_ENV] = crash_at
    args = [sys.executable, SCRIPT, str(save_dir), first, second] + (["load"] if load else [])
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)


def _assert_loadable(save_dir, expected_tag):
    assert (save_dir / "latest").read_text() == expected_tag
    tag_dir = resolve_tag_dir(str(save_dir), expected_tag)
    assert verify_files(tag_dir)
    state = get_fp32_state_dict_from_zero_checkpoint(str(save_dir))
    assert state["fc1.weight"].shape == (16, 8)


# (point, same tag twice?, tag `latest` names afterwards)
POINTS = [("after_mkdir", False, "a"), ("mid_file", False, "a"), ("after_files", False, "a"),
          ("before_rename", False, "a"), ("after_rename", False, "a"), ("before_latest", False, "a"),
          ("after_latest", False, "b"), ("between_renames", True, "a"), ("mid_file", True, "a")]


@pytest.mark.parametrize("point,same_tag,expected", POINTS)
def test_sigkill_keeps_previous_checkpoint(tmp_path, point, same_tag, expected):
    save_dir = tmp_path / "ckpt"
    result = _run(save_dir, "a", "a" if same_tag else "b", crash_at=point)
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    _assert_loadable(save_dir, expected)
    if point == "between_renames":  # the engine itself resumes from the moved-aside copy
        loaded = _run(save_dir, "a", "a", load=True)
        assert loaded.returncode == 0 and "at step 1" in loaded.stdout, loaded.stderr[-2000:]


def test_next_save_after_a_crash_succeeds(tmp_path):
    save_dir = tmp_path / "ckpt"
    assert _run(save_dir, "a", "b", crash_at="after_files").returncode == -signal.SIGKILL
    assert _run(save_dir, "c", "b").returncode == 0
    _assert_loadable(save_dir, "b")
    assert not [n for n in os.listdir(save_dir) if n.endswith(".tmp")]


@pytest.fixture()
def good_checkpoint(tmp_path):
    save_dir = tmp_path / "ckpt"
    result = _run(save_dir, "a", "b")
    assert result.returncode == 0, result.stderr[-2000:]
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
