"""build_locks / deepspeed_extensions.clear_stale_locks: only a lock whose holder is dead goes.

The holders are real processes holding the lock the way torch's FileBaton does (the file created
with O_CREAT | O_EXCL, its descriptor kept open), one of them torch's FileBaton itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import build_locks
import deepspeed_extensions
from build_locks import remove_stale_locks

_HOLD = ("import os, sys, time\n"
         "fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL)\n"
         "print('held', flush=True)\n"
         "time.sleep(120)\n")


def _holder(lock: str) -> subprocess.Popen:
    """Another process (say, another pytest session's DeepSpeed rank) holding `lock`."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, lock], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def _orphan(lock: str) -> None:
    """A lock whose holder was killed: the file is there, nobody has it open."""
    os.makedirs(os.path.dirname(lock), exist_ok=True)
    os.close(os.open(lock, os.O_CREAT | os.O_EXCL))


@pytest.mark.skipif(build_locks.open_files() is None, reason="needs /proc (Linux)")
def test_a_live_holders_lock_stays_and_goes_once_the_holder_is_killed(tmp_path):
    lock = str(tmp_path / "op" / "lock")
    os.makedirs(os.path.dirname(lock))
    holder = _holder(lock)
    try:
        assert remove_stale_locks([lock], max_age_s=0.0) == []   # even when old: it is held
        assert os.path.exists(lock)
    finally:
        holder.kill()
        holder.wait()
    assert remove_stale_locks([lock]) == [lock]
    assert not os.path.exists(lock)


@pytest.mark.skipif(build_locks.open_files() is None, reason="needs /proc (Linux)")
def test_torch_file_baton_held_in_this_process_stays_and_releases_cleanly(tmp_path):
    from torch.utils.file_baton import FileBaton

    baton = FileBaton(str(tmp_path / "lock"))
    assert baton.try_acquire()
    assert remove_stale_locks([baton.lock_file_path]) == []
    baton.release()   # would raise FileNotFoundError had the lock been taken from under it
    assert not os.path.exists(baton.lock_file_path)


def test_without_proc_only_old_locks_count_as_stale(tmp_path, monkeypatch):
    monkeypatch.setattr(build_locks, "open_files", lambda proc="/proc": None)
    young, old = str(tmp_path / "young" / "lock"), str(tmp_path / "old" / "lock")
    _orphan(young)
    _orphan(old)
    hour_ago = time.time() - 3600
    os.utime(old, (hour_ago, hour_ago))
    assert remove_stale_locks([young, old], max_age_s=600) == [old]
    assert os.path.exists(young)


@pytest.mark.skipif(build_locks.open_files() is None, reason="needs /proc (Linux)")
def test_clear_stale_locks_keeps_another_sessions_live_build(tmp_path, monkeypatch):
    monkeypatch.setattr(deepspeed_extensions, "EXTENSIONS_DIR", str(tmp_path))
    building, killed = str(tmp_path / "shm_comm" / "lock"), str(tmp_path / "cpu_adam" / "lock")
    os.makedirs(os.path.dirname(building))
    _orphan(killed)
    holder = _holder(building)
    try:
        assert deepspeed_extensions.clear_stale_locks() == [killed]
        assert os.path.exists(building) and not os.path.exists(killed)
    finally:
        holder.kill()
        holder.wait()
