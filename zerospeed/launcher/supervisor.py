"""Fail-fast supervision of one node's ranks, and the cross-node abort channel.

``supervise()`` polls the local ranks until one of:

- every rank exited 0, or a rank hit gloo's teardown abort (see [Note: gloo teardown abort] in
  ``rank_process.py``) -> exit 0; what the ranks forked and left running is killed with their
  process groups;
- a rank failed -> the abort is raised for the other nodes, every local rank is stopped
  (SIGTERM, then SIGKILL after ``ZS_KILL_GRACE_S``, default 5 s) -> that rank's exit code;
- another node raised the abort, or this node lost its connection to the job's store ->
  every local rank is stopped -> exit 1;
- SIGINT / SIGTERM / SIGHUP reached the launcher -> every local rank is stopped -> 128 + signal;
- a rank has waited in one collective for longer than ``ZS_HANG_TIMEOUT_S`` (or another node
  reported such a hang) -> every local rank's stack is printed, the ranks not in a collective
  named, every rank stopped -> 124 ([Note: hang report] in heartbeat.py).

The abort channel exists only for multi-node jobs: the node-0 launcher hosts a ``TCPStore`` on
``MASTER_PORT`` and the ranks reuse it (``TORCHELASTIC_USE_AGENT_STORE=True``, the way torch
elastic's agent shares its store), so a job needs one port. A failing node writes
``zerospeed/abort``; every launcher checks it about once a second. When node 0 goes away the
store goes with it, which the others also read as an abort. Node 0 keeps the store up until
every node has reported done (or an abort), so a slower node is not cut off.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import sys

from zerospeed.launcher.hang import ABORT_PREFIX, HANG_EXIT_CODE, HangWatch
from zerospeed.launcher.rank_process import RankProcess, stop_all

__all__ = ["AbortChannel", "Outcome", "supervise"]

_ABORT_KEY = "zerospeed/abort"
_DONE_KEY = "zerospeed/nodes_done"


def _env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


class AbortChannel:
    """The job-wide abort flag in a TCPStore (multi-node only; imports torch lazily)."""

    def __init__(self, master_addr: str, master_port: int, node_rank: int, num_nodes: int):
        from torch.distributed import TCPStore

        self.node_rank, self.num_nodes = node_rank, num_nodes
        self.where = f"{master_addr}:{master_port}"
        self._store: Any = TCPStore(master_addr, master_port, None, node_rank == 0,
                                    timedelta(seconds=_env_float("ZS_STORE_TIMEOUT_S", 300)),
                                    wait_for_workers=False)
        self._last_check = 0.0

    def raise_abort(self, message: str) -> None:
        with contextlib.suppress(Exception):  # the store is gone: the others notice that too
            if not self._store.check([_ABORT_KEY]):
                self._store.set(_ABORT_KEY, message)

    def poll(self) -> str | None:
        """The abort message, if any node raised one (checked at most once a second)."""
        now = time.monotonic()
        if now - self._last_check < 1.0:
            return None
        self._last_check = now
        try:
            if self._store.check([_ABORT_KEY]):
                return self._store.get(_ABORT_KEY).decode()
        except Exception as exc:  # noqa: BLE001
            return f"lost contact with the job's store at {self.where} (node 0 gone?): {exc}"
        return None

    def mark_done_and_wait(self, stop: threading.Event) -> None:
        """Report this node done; node 0 then keeps the store up until all nodes are done."""
        with contextlib.suppress(Exception):  # a lost store: nobody is left to wait for
            self._store.add(_DONE_KEY, 1)
            if self.node_rank != 0:
                return
            deadline = time.monotonic() + _env_float("ZS_NODE_EXIT_WAIT_S", 600)
            while time.monotonic() < deadline and not stop.is_set():
                if self._store.add(_DONE_KEY, 0) >= self.num_nodes or self._store.check([_ABORT_KEY]):
                    return
                time.sleep(0.5)


@dataclass
class Outcome:
    exit_code: int
    failed: RankProcess | None = None
    reason: str = ""
    reported: bool = False  # the supervisor already printed the details (a hang report)


def _first_failure(ranks: list[RankProcess], suspects: dict[int, float]) -> RankProcess | None:
    now = time.monotonic()
    failed = []
    for rank in ranks:
        code = rank.poll()
        if code is None or code == 0:
            continue
        if rank.spec.rank not in suspects and rank.looks_like_teardown_abort():
            suspects[rank.spec.rank] = now
        if rank.spec.rank not in suspects:
            failed.append(rank)
    if failed:
        # Ranks seen dead in the same poll: the root cause is the one whose peers did not vanish.
        return next((r for r in failed if not r.looks_like_secondary_failure()), failed[0])
    grace_s = _env_float("ZS_TEARDOWN_GRACE_S", 15)
    still_running = any(r.poll() is None for r in ranks)
    for rank in ranks:
        if rank.spec.rank in suspects and still_running and now - suspects[rank.spec.rank] > grace_s:
            return rank
    return None


def supervise(ranks: list[RankProcess], stop: threading.Event, stop_signal: list[int],
              channel: AbortChannel | None = None, watch: HangWatch | None = None) -> Outcome:
    """Wait for the ranks; stop all of them on the first failure, abort, signal or hang."""
    kill_grace_s = _env_float("ZS_KILL_GRACE_S", 5)
    suspects: dict[int, float] = {}
    while True:
        failed = _first_failure(ranks, suspects)
        if failed is not None:
            reason = f"rank {failed.spec.rank} on host {failed.host} failed ({failed.describe_exit()})"
            if channel is not None:
                channel.raise_abort(reason)
            stop_all(ranks, kill_grace_s)
            code = failed.poll() or 1
            return Outcome(code if code > 0 else 128 - code, failed, reason)
        if all(r.poll() is not None for r in ranks):
            stop_all(ranks, 0)  # what the ranks forked and left behind goes with them
            if channel is not None:
                channel.mark_done_and_wait(stop)
            return Outcome(0, reason=_teardown_warning(ranks, suspects))
        if stop.is_set():
            signum = stop_signal[0] if stop_signal else signal.SIGTERM
            reason = f"launcher received {signal.Signals(signum).name}"
            if channel is not None:
                channel.raise_abort(reason)
            stop_all(ranks, kill_grace_s)
            return Outcome(128 + signum, reason=reason)
        message = channel.poll() if channel is not None else None
        if message is not None and message.startswith(ABORT_PREFIX) and watch is not None:
            return _end_hung_job(ranks, watch, f"{message} (reported by another node)", None, kill_grace_s)
        if message is not None:
            stop_all(ranks, kill_grace_s)
            return Outcome(1, reason=f"stopped: {message}")
        for rank in ranks:
            rank.release_held()
        summary = watch.check(ranks) if watch is not None else None
        if summary is not None and watch is not None:   # a summary comes only from a watch
            return _end_hung_job(ranks, watch, summary, channel, kill_grace_s)
        stop.wait(0.1)


def _end_hung_job(ranks: list[RankProcess], watch: HangWatch, summary: str,
                  channel: AbortChannel | None, kill_grace_s: float) -> Outcome:
    print(watch.report(ranks, summary), file=sys.stderr, flush=True)
    if channel is not None:
        channel.raise_abort(summary)
    stop_all(ranks, kill_grace_s)
    return Outcome(HANG_EXIT_CODE, reason=summary, reported=True)


def _teardown_warning(ranks: list[RankProcess], suspects: dict[int, float]) -> str:
    if not suspects:
        return ""
    names = ", ".join(str(r) for r in sorted(suspects))
    return (f"rank(s) {names} aborted at exit with gloo's 'terminate called without an active "
            "exception' after the other ranks finished cleanly; counted as success")
