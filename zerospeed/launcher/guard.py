"""The guard of one launcher (see [Note: lifeline] in lifeline.py); run as ``python -S guard.py``.

Reads process-group ids, one a line, on stdin. ``done`` means the launcher exits normally and
stops its ranks itself. End of input without ``done`` means the launcher died: SIGTERM every
group, then SIGKILL what is left after ``ZS_KILL_GRACE_S`` (default 5) seconds.
Imports only the standard library, so it starts in milliseconds.
"""

import os
import signal
import sys
import time

__all__ = ["main"]


def _signal_groups(pgids: list[int], sig: int) -> list[int]:
    alive = []
    for pgid in pgids:
        try:
            os.killpg(pgid, sig)
            alive.append(pgid)
        except (ProcessLookupError, PermissionError):
            pass
    return alive


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the launcher, which handles it
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    pgids: list[int] = []
    for line in sys.stdin:
        word = line.strip()
        if word == "done":
            return
        if word.isdigit():
            pgids.append(int(word))
    alive = _signal_groups(pgids, signal.SIGTERM)
    deadline = time.monotonic() + float(os.environ.get("ZS_KILL_GRACE_S", "5"))
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = _signal_groups(alive, 0)
    _signal_groups(alive, signal.SIGKILL)


if __name__ == "__main__":
    main()
