"""Which of torch's op build locks are stale: left behind by a process that died holding them.

torch.utils.cpp_extension guards each op's build directory with a `FileBaton`: the lock file
`<op>/lock` is created with O_CREAT | O_EXCL, its descriptor stays open while the holder builds or
loads the op, then the holder closes it and deletes the file. Waiters poll until the file is gone,
without a timeout. The file holds nothing (no pid), so the holder is found by that open descriptor:
a lock no live process has open was left by a killed one and would block every later load; a lock
some process has open belongs to a live build (another pytest session's DeepSpeed rank, say) and
deleting it would let a second build run into the same directory at once.

Where /proc lists open descriptors (Linux) that is the test. Elsewhere a lock counts as stale only
once it is older than `max_age_s`, longer than any build takes.

A holder that has just closed its descriptor deletes the file an instant later; deleting it first
would make the holder's own delete fail. So a lock found unheld is looked at again after
`CONFIRM_S` and removed only if the same file is still there and still unheld.
"""

from __future__ import annotations

import os
import time

CONFIRM_S = 0.2
DEFAULT_MAX_AGE_S = 3600.0

__all__ = ["CONFIRM_S", "DEFAULT_MAX_AGE_S", "open_files", "remove_stale_locks"]

_FileId = tuple[int, int]  # (st_dev, st_ino)


def open_files(proc: str = "/proc") -> set[_FileId] | None:
    """The files some process has open, by device and inode; None where /proc cannot tell.

    Processes whose descriptors this user may not read are passed over: a build lock lives in this
    user's cache, so only this user's processes hold it."""
    if not os.path.isdir(os.path.join(proc, "self", "fd")):
        return None
    found: set[_FileId] = set()
    for pid in os.listdir(proc):
        if not pid.isdigit():
            continue
        fd_dir = os.path.join(proc, pid, "fd")
        try:
            fds = os.listdir(fd_dir)
        except OSError:  # exited meanwhile, or not ours
            continue
        for fd in fds:
            try:
                st = os.stat(os.path.join(fd_dir, fd))
            except OSError:
                continue
            found.add((st.st_dev, st.st_ino))
    return found


def _file_id(path: str) -> tuple[_FileId, float] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino), st.st_mtime


def _unheld(paths: list[str], max_age_s: float) -> dict[str, _FileId]:
    """The locks among `paths` that look stale now, with the identity of the file judged."""
    held = open_files()
    now = time.time()
    stale = {}
    for path in paths:
        found = _file_id(path)
        if found is None:
            continue
        file_id, mtime = found
        if (file_id not in held) if held is not None else (now - mtime > max_age_s):
            stale[path] = file_id
    return stale


def remove_stale_locks(paths: list[str], max_age_s: float = DEFAULT_MAX_AGE_S) -> list[str]:
    """Delete the locks among `paths` whose holder is gone (module docstring); the ones deleted."""
    first = _unheld(paths, max_age_s)
    if not first:
        return []
    time.sleep(CONFIRM_S)
    second = _unheld(list(first), max_age_s)
    removed = []
    for path, file_id in second.items():
        if first[path] != file_id:  # a new lock took the old one's place meanwhile
            continue
        try:
            os.remove(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed
