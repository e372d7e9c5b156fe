"""Ranks die with their launcher, even when the launcher is SIGKILLed.

[Note: lifeline]
A rank runs in its own session (so ``os.killpg`` stops it and what it forks), which also means
nothing stops it when the launcher dies without running its cleanup (SIGKILL, OOM killer, a
crashed ssh session). Two mechanisms close that gap:

1. *Parent-death signal* (Linux): each rank process asks the kernel, between fork and exec, for
   SIGKILL when the launcher thread that started it dies (``prctl(PR_SET_PDEATHSIG)``; the
   setting survives exec). If the launcher is already gone by then, the child exits at once.
2. *Guard*: a tiny process (``python guard.py``, no imports beyond the standard library) in its
   own session reads the ranks' process-group ids on a pipe from the launcher. When the pipe
   closes without the word ``done`` -- the launcher died -- it kills those groups, which also
   takes the data-loader workers and other children the rank forked (the parent-death signal
   reaches only the rank itself). On a normal exit the launcher writes ``done`` first.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
from collections.abc import Callable

__all__ = ["Guard", "parent_death_preexec"]

_PR_SET_PDEATHSIG = 1
_GUARD_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "guard.py")


def _load_libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


_LIBC = _load_libc()  # loaded here, not in the forked child: the child only calls into it


def parent_death_preexec() -> Callable[[], None] | None:
    """A Popen ``preexec_fn`` that arms the parent-death SIGKILL (None where prctl is missing)."""
    if _LIBC is None:
        return None
    libc, parent = _LIBC, os.getpid()

    def arm() -> None:
        # Runs in the child between fork and exec: only a syscall and a check, no allocation.
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before the prctl took effect
            os._exit(1)

    return arm


class Guard:
    """The guard process of one launcher: ``watch(pgid)`` per rank, ``close()`` on a normal exit."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-S", _GUARD_SCRIPT], stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, start_new_session=True)

    def watch(self, pgid: int) -> None:
        self._send(f"{pgid}\n")

    def close(self) -> None:
        """The launcher stops its ranks itself: tell the guard to leave them alone and exit."""
        self._send("done\n")
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def _send(self, line: str) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(line.encode())
            self.proc.stdin.flush()
        except (OSError, ValueError):  # the guard is gone: the parent-death signal still holds
            pass
