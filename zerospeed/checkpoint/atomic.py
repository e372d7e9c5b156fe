"""Crash-safe checkpoint writes: temporary tag directory, fsync, manifest, rename, `latest` last.

[Note: atomic save]
    1. rank 0 creates `<save_dir>/.<tag>.tmp` (a stale one from a crashed save is removed); barrier.
    2. every rank writes its files there, fsyncs each, and records them in a manifest part; barrier.
    3. rank 0 merges the parts into `zs_manifest.json`, fsyncs, and renames the directory to
       `<save_dir>/<tag>` (an existing tag is first moved to `.<tag>.old`, removed afterwards).
    4. rank 0 replaces `zero_to_fp32.py` and then `latest` with write-to-temp + os.replace; barrier.
A kill at any point leaves `latest` naming a complete, verified directory: before step 3 the new
files are only in the temporary directory; between the two renames of step 3 the previous
version sits in `.<tag>.old`, which `resolve_tag_dir` falls back to.

[Note: the last good copy]
Two invariants make every window of step 3 safe, including a kill during a save that follows a
killed one. (a) `<tag>` only ever appears by renaming a finished temporary directory, so when it
exists it is complete, and any `.<tag>.old` beside it is stale. (b) `.<tag>.old` is deleted only
while `<tag>` exists. So a save whose `<tag>` is missing (the previous save of this tag died
between the renames) keeps `.<tag>.old` untouched until the new `<tag>` is in place; a kill at any
moment leaves `<tag>` or `.<tag>.old` complete.

Tests kill the saving process for real: ZEROSPEED_CHECKPOINT_CRASH_AT=<point>[@<rank>] makes
`crash_point(<point>)` SIGKILL the process (points: after_mkdir, mid_file, after_files,
before_rename, after_clear_old, between_renames, before_move_in, after_rename, before_latest,
after_latest). tests/checkpoint/test_crash_safety.py also kills every rank at random moments.
"""

from __future__ import annotations

import os
import shutil
import signal
from typing import Any

from zerospeed import comm
from zerospeed.checkpoint.deepspeed_compat import save_with_deepspeed_names
from zerospeed.checkpoint.durable import fsync_dir, write_text_durably
from zerospeed.checkpoint.layout import LATEST
from zerospeed.checkpoint.manifest import (
    CheckpointIntegrityError,
    file_entry,
    merge_manifest_parts,
    write_manifest_part,
)

__all__ = ["CheckpointTransaction", "crash_point", "read_latest", "resolve_tag_dir",
           "CRASH_ENV"]

CRASH_ENV = "ZEROSPEED_CHECKPOINT_CRASH_AT"


def crash_point(name: str) -> None:
    """SIGKILL this process when the crash-test hook names this point (and rank)."""
    wanted = os.environ.get(CRASH_ENV)
    if not wanted:
        return
    point, _, rank = wanted.partition("@")
    this_rank = comm.get_rank() if comm.is_initialized() else 0
    if point == name and (not rank or int(rank) == this_rank):
        os.kill(os.getpid(), signal.SIGKILL)


def read_latest(load_dir: str, name: str = LATEST) -> str | None:
    """The tag `<load_dir>/latest` (or another pointer file: `latest_universal`) names, None when
    there is no such file.

    A `latest` that is not a short line of text (binary junk, a truncated write by another tool)
    is a CheckpointIntegrityError naming the file, like every other damaged checkpoint file.
    """
    path = os.path.join(load_dir, name)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as handle:
            tag = handle.read(4097).decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as error:
        raise CheckpointIntegrityError(f"checkpoint file {path} is unreadable: {error}") from error
    if not tag or len(tag) > 4096 or not tag.isprintable():
        shown = tag[:80] + ("..." if len(tag) > 80 else "")
        raise CheckpointIntegrityError(f"checkpoint file {path} is corrupt: it should hold one tag name, "
                                       f"it holds {shown!r}")
    return tag


def resolve_tag_dir(load_dir: str, tag: str) -> str:
    """The directory of `tag`, or its `.old` copy when a crash hit between the two renames."""
    tag_dir = os.path.join(load_dir, tag)
    old = os.path.join(load_dir, f".{tag}.old")
    if not os.path.isdir(tag_dir) and os.path.isdir(old):
        return old
    return tag_dir


class CheckpointTransaction:
    """One save of one tag by every rank of `group`. See [Note: atomic save]."""

    def __init__(self, save_dir: str, tag: str, group: Any = None) -> None:
        self.save_dir, self.tag, self.group = save_dir, tag, group
        self.rank = comm.get_rank(group)
        self.world_size = comm.get_world_size(group)
        self.tmp_dir = os.path.join(save_dir, f".{tag}.tmp")
        self.final_dir = os.path.join(save_dir, tag)
        self._entries: dict[str, dict[str, Any]] = {}

    def begin(self) -> CheckpointTransaction:
        if self.rank == 0:
            os.makedirs(self.save_dir, exist_ok=True)
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
            os.makedirs(self.tmp_dir)
        comm.barrier(self.group)
        crash_point("after_mkdir")
        return self

    def write(self, name: str, obj: Any) -> None:
        path = os.path.join(self.tmp_dir, name)
        with open(path, "wb") as handle:
            save_with_deepspeed_names(obj, handle)
            handle.flush()
            if os.environ.get(CRASH_ENV, "").startswith("mid_file"):
                handle.truncate(handle.tell() // 2)
                crash_point("mid_file")
            os.fsync(handle.fileno())
        self._entries[name] = file_entry(path)

    def commit(self, save_latest: bool, extra_files: dict[str, str] | None = None) -> None:
        write_manifest_part(self.tmp_dir, self.rank, self._entries)
        crash_point("after_files")
        comm.barrier(self.group)
        if self.rank == 0:
            merge_manifest_parts(self.tmp_dir, self.tag, self.world_size)
            fsync_dir(self.tmp_dir)
            self._rename_into_place()
            for name, source in (extra_files or {}).items():
                self._copy_durably(source, os.path.join(self.save_dir, name))
            crash_point("before_latest")
            if save_latest:
                write_text_durably(os.path.join(self.save_dir, LATEST), self.tag)
            crash_point("after_latest")
        comm.barrier(self.group)

    def _rename_into_place(self) -> None:
        """See [Note: the last good copy] for why each step may be killed."""
        crash_point("before_rename")
        old = os.path.join(self.save_dir, f".{self.tag}.old")
        if os.path.isdir(self.final_dir):
            shutil.rmtree(old, ignore_errors=True)  # stale: `<tag>` is complete (invariant a)
            crash_point("after_clear_old")
            os.rename(self.final_dir, old)
            fsync_dir(self.save_dir)
            crash_point("between_renames")
        # else `.<tag>.old`, if any, is the last good copy of this tag: it stays until the next line.
        crash_point("before_move_in")
        os.rename(self.tmp_dir, self.final_dir)
        fsync_dir(self.save_dir)
        shutil.rmtree(old, ignore_errors=True)
        crash_point("after_rename")

    @staticmethod
    def _copy_durably(source: str, target: str) -> None:
        tmp = f"{target}.tmp{os.getpid()}"
        shutil.copyfile(source, tmp)
        os.chmod(tmp, 0o755)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, target)
