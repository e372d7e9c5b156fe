"""Durable small writes: a file replaced through a temporary file and `os.replace`, fsynced with its
directory, so a crash leaves the old content or the new one, never a torn file. Used by the
checkpoint transaction (atomic.py) and the manifest (manifest.py) alike."""

from __future__ import annotations

import os

__all__ = ["fsync_dir", "write_text_durably"]


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_durably(path: str, text: str) -> None:
    """Write `path` through a temporary file and os.replace, fsyncing file and directory."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
