"""Launcher side of the hang report ([Note: hang report] in heartbeat.py).

``HangWatch.prepare(specs)`` gives each rank its heartbeat file; ``check()`` (called from the
supervisor's poll loop, at most twice a second) returns a report once a rank has waited in one
collective for longer than the timeout; ``report()`` collects every rank's Python stack. Other
nodes of a multi-node job learn of the hang through the abort channel and report their own
ranks' stacks (``report(triggered_elsewhere=...)``).
"""

from __future__ import annotations

import os
import time

from zerospeed.utils.heartbeat import HEARTBEAT_ENV, LAYOUT, STACK_SIGNAL, read_state
from zerospeed.launcher.rank_process import RankProcess, RankSpec

__all__ = ["HANG_EXIT_CODE", "HANG_TIMEOUT_ENV", "HangWatch", "hang_timeout_s"]

HANG_TIMEOUT_ENV = "ZS_HANG_TIMEOUT_S"
DEFAULT_HANG_TIMEOUT_S = 300.0
HANG_EXIT_CODE = 124  # `timeout`'s code: the job was ended for not making progress
ABORT_PREFIX = "hang:"


def hang_timeout_s() -> float:
    """``ZS_HANG_TIMEOUT_S`` (seconds; 0 turns the hang report off), default 300."""
    raw = os.environ.get(HANG_TIMEOUT_ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_HANG_TIMEOUT_S
    except ValueError:
        raise ValueError(f"{HANG_TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if value < 0:
        raise ValueError(f"{HANG_TIMEOUT_ENV}={raw!r} must be >= 0 (0 turns the hang report off)")
    return value


class HangWatch:
    def __init__(self, run_dir: str, timeout_s: float, host: str) -> None:
        self.run_dir, self.timeout_s, self.host = run_dir, timeout_s, host
        self._last_check = 0.0

    def prepare(self, specs: list[RankSpec]) -> None:
        for spec in specs:
            path = self._path(spec.rank)
            with open(path, "wb") as handle:
                handle.write(b"\0" * LAYOUT.size)
            spec.env[HEARTBEAT_ENV] = path

    def _path(self, rank: int) -> str:
        return os.path.join(self.run_dir, f"heartbeat_rank{rank}")

    def check(self, ranks: list[RankProcess]) -> str | None:
        """The hang's one-line summary once a live rank has waited too long in one collective."""
        now = time.monotonic()
        if self.timeout_s <= 0 or now - self._last_check < 0.5:
            return None
        self._last_check = now
        wall = time.time()
        for rank in ranks:
            state = read_state(self._path(rank.spec.rank))
            if rank.poll() is None and state and state["inside"] and wall - state["entered_at"] > self.timeout_s:
                return (f"{ABORT_PREFIX} rank {rank.spec.rank} on host {self.host} has waited in "
                        f"{state['op']} for {wall - state['entered_at']:.0f} s (ZS_HANG_TIMEOUT_S="
                        f"{self.timeout_s:g}) and no rank it waits for arrived")
        return None

    def report(self, ranks: list[RankProcess], summary: str) -> str:
        """Every local rank's state and Python stack, and the ranks that are not in a collective."""
        states = {r.spec.rank: read_state(self._path(r.spec.rank)) for r in ranks}
        stacks = self._collect_stacks(ranks, states)
        wall = time.time()
        lines = [f"zerospeed: {summary}"]
        outside = [r for r in ranks if r.poll() is None and not (states[r.spec.rank] or {}).get("inside")]
        for rank in ranks:
            state = states[rank.spec.rank]
            if rank.poll() is not None:
                where = f"exited ({rank.describe_exit()})"
            elif state is None:
                where = "has not imported zerospeed (no heartbeat; no stack)"
            elif state["inside"]:
                where = f"waits in {state['op']} for {wall - state['entered_at']:.0f} s"
            else:
                where = f"is not in a collective (it completed {state['completed']}): the others wait for it"
            lines.append(f"  rank {rank.spec.rank} on host {self.host} {where}")
        if outside:
            names = ", ".join(str(r.spec.rank) for r in outside)
            lines.append(f"zerospeed: hang: the rank(s) not in a collective on host {self.host}: {names}")
        elif ranks:
            lines.append(f"zerospeed: hang: every rank on host {self.host} waits in a collective "
                         "(a rank on another node, or ranks calling different collectives)")
        for rank in ranks:
            text = stacks.get(rank.spec.rank)
            if text:
                lines.append(f"---- Python stack of rank {rank.spec.rank} on host {self.host} ----\n{text}")
        return "\n".join(lines)

    def _collect_stacks(self, ranks: list[RankProcess], states: dict) -> dict[int, str]:
        paths = {}
        for rank in ranks:
            if rank.poll() is None and states[rank.spec.rank] is not None:
                paths[rank.spec.rank] = f"{self._path(rank.spec.rank)}.stack"
                try:  # the process that imported zerospeed (the rank, or what a --no_python wrapper ran)
                    os.kill(states[rank.spec.rank]["pid"], STACK_SIGNAL)
                except ProcessLookupError:
                    pass
        # faulthandler writes from the signal handler at once; wait until the files stop growing.
        sizes: dict[int, int] = {}
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            time.sleep(0.2)
            now = {rank: _size(path) for rank, path in paths.items()}
            if now == sizes and all(now.values()):
                break
            sizes = now
        return {rank: _read(path) for rank, path in paths.items()}


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as handle:
            return handle.read().rstrip()
    except OSError:
        return ""
