"""One local rank as an OS process: its own session, a tee of its stderr, a clean kill.

Each rank dies with the launcher, even a SIGKILLed one ([Note: lifeline] in lifeline.py).
Each rank is started in a new session (``start_new_session=True``, as torch elastic's
``SubprocessHandler`` does), so the rank and everything it forks (data loader workers,
compilers) form one process group that ``os.killpg`` stops at once. Its stderr goes through a
pipe: a thread copies every line to the launcher's stderr (or the rank's log file) and keeps the
last lines. A Python traceback on the launcher's stderr is held back instead of copied (released
if the rank goes on running, i.e. it was only logged): the final report prints each distinct
traceback once, with the ranks that raised it (``launch.report``), not every rank's copy and then
a repeat.

A script decorated with torch elastic's ``@record`` also writes a structured error file
(``TORCHELASTIC_ERROR_FILE``); when present its traceback is preferred over the stderr tail.

[Note: gloo teardown abort]
With torch 2.13 and gloo, a rank can abort at interpreter exit after all its work is done
(``terminate called without an active exception`` then SIGABRT). zerospeed's own ranks avoid it
([Note: gloo exit abort] in comm/exit_teardown.py); scripts that use ``torch.distributed``
alone can still hit it.
``looks_like_teardown_abort()`` recognizes exactly that: killed by SIGABRT, and the last line on
stderr is that message (no Python traceback after it). The supervisor treats such a rank as a
*suspect*, not a failure: if every other local rank then exits 0 the node succeeds (with a
warning); if another rank fails, that rank is the failure; if the others are still running
after a grace period, the abort counts as a real failure.
"""

from __future__ import annotations

import collections
import json
import re
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO

from zerospeed.launcher.lifeline import parent_death_preexec

__all__ = ["RankProcess", "RankSpec", "stop_all"]

_TAIL_LINES = 200
_TRACEBACK = "Traceback (most recent call last)"
_RANK_PREFIX = re.compile(r"^\[(default)?rank\d+\]:\s?")  # torch's per-rank prefix on tracebacks
_HELD_RELEASE_S = 3.0
_TEARDOWN_MESSAGE = "terminate called without an active exception"
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing")


@dataclass
class RankSpec:
    """What to start for one local rank: plain data, built by ``launch.build_rank_specs``."""

    rank: int
    local_rank: int
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


class RankProcess:
    """A started rank: ``poll()``, ``stop()``, and its failure text once it has exited."""

    def __init__(self, spec: RankSpec, host: str, error_file: str, log_path: str | None = None):
        self.spec = spec
        self.host = host
        self.error_file = error_file
        self._tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self._log: IO[bytes] | None = open(log_path, "ab") if log_path else None  # noqa: SIM115
        self._held: list[bytes] = []  # a traceback held back from the launcher's stderr
        self._held_at = 0.0
        self._held_lock = threading.Lock()
        env = {**os.environ, **spec.env, "TORCHELASTIC_ERROR_FILE": error_file}
        self.proc = subprocess.Popen(spec.argv, env=env, stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.PIPE,
                                     start_new_session=True, preexec_fn=parent_death_preexec())
        self.pid = self.proc.pid
        self._tee = threading.Thread(target=self._copy_stderr, name=f"tee-rank{spec.rank}", daemon=True)
        self._tee.start()

    def _copy_stderr(self) -> None:
        assert self.proc.stderr is not None
        sink = self._log if self._log is not None else sys.stderr.buffer
        for line in iter(self.proc.stderr.readline, b""):
            text = line.decode(errors="replace").rstrip("\n")
            self._tail.append(text)
            if self._log is None:
                with self._held_lock:
                    if self._held or _TRACEBACK in text:
                        self._held.append(line)
                        self._held_at = time.monotonic()
                        continue
            _write(sink, [line])

    def release_held(self) -> None:
        """A rank still running well after its traceback only logged it: copy it out now."""
        with self._held_lock:
            if not self._held or self.poll() is not None or time.monotonic() - self._held_at < _HELD_RELEASE_S:
                return
            lines, self._held = self._held, []
        _write(sys.stderr.buffer, lines)

    def held_traceback(self) -> str | None:
        """The traceback this rank died with (held back from the live stream), without torch's
        ``[rankN]:`` prefixes so that equal tracebacks of different ranks compare equal."""
        self._tee.join(timeout=1.0)
        with self._held_lock:
            lines = [_RANK_PREFIX.sub("", line.decode(errors="replace").rstrip("\n")) for line in self._held]
        starts = [i for i, line in enumerate(lines) if _TRACEBACK in line]
        return "\n".join(lines[starts[-1]:]).rstrip() if starts else None

    def poll(self) -> int | None:
        return self.proc.poll()

    def signal_group(self, sig: signal.Signals) -> None:
        """Signal the rank's whole process group; also after the rank itself has exited."""
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def finish(self) -> None:
        """After the rank has exited: let the tee drain, close the log."""
        self._tee.join(timeout=2.0)
        if self._log is not None:
            self._log.close()
            self._log = None

    def looks_like_secondary_failure(self) -> bool:
        """True when the rank's stderr says a *peer* went away (it is not the root cause)."""
        return any(marker in line for line in self._tail for marker in _PEER_GONE)

    def looks_like_teardown_abort(self) -> bool:
        """True for gloo's exit-time abort (see [Note: gloo teardown abort])."""
        if self.poll() != -signal.SIGABRT:
            return False
        self._tee.join(timeout=1.0)
        lines = [line for line in self._tail if line.strip()]
        return bool(lines) and _TEARDOWN_MESSAGE in lines[-1]

    def describe_exit(self) -> str:
        code = self.poll()
        if code is not None and code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}"

    def failure_text(self) -> str:
        """The traceback: from the ``@record`` error file if any, else the tail of stderr."""
        from_file = _read_error_file(self.error_file)
        if from_file:
            return from_file
        lines = [_RANK_PREFIX.sub("", line) for line in self._tail]
        starts = [i for i, line in enumerate(lines) if "Traceback (most recent call last)" in line]
        if starts:
            return "\n".join(lines[starts[-1]:])
        return "\n".join(lines[-30:]) if lines else "(the rank wrote nothing to stderr)"


def _write(sink: IO[bytes], lines: list[bytes]) -> None:
    try:
        sink.writelines(lines)
        sink.flush()
    except (OSError, ValueError):  # our own stderr is gone (e.g. ssh closed): the tail is kept
        pass


def _read_error_file(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, dict):
        extra = message.get("extraInfo", {})
        stack = extra.get("py_callstack") if isinstance(extra, dict) else None
        return str(stack or message.get("message") or message)
    return str(message) if message else None


def stop_all(ranks: list[RankProcess], grace_s: float) -> None:
    """SIGTERM every rank's process group, SIGKILL what is left after ``grace_s``."""
    for rank in ranks:
        if rank.poll() is None:
            rank.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(r.poll() is None for r in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    for rank in ranks:
        # Also for ranks that already exited: their forked children share the group.
        rank.signal_group(signal.SIGKILL)
    for rank in ranks:
        try:
            rank.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:  # stuck in the kernel (D state): nothing more to do
            pass
        rank.finish()
