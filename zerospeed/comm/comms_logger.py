"""The comms logger: op, group size, bytes and latency of every collective (ds_config `comms_logger`).

Message sizes follow DeepSpeed's convention: the full tensor for all_reduce / broadcast / send,
the *input* for reduce_scatter, the *output* (gathered) tensor for all_gather. Latency is the time
the call took on this rank; for `async_op=True` calls that is only the launch, so overlap code shows
up as cheap — which is what it costs the caller.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

from zerospeed.utils import heartbeat


def _group_size(group: Any) -> int:
    """The number of ranks in `group` (the world when None); 1 before init, as comm.get_world_size."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


@dataclasses.dataclass(frozen=True)
class CommRecord:
    op: str
    group_size: int
    msg_bytes: int
    latency_s: float
    async_op: bool


@dataclasses.dataclass
class CommsLogger:
    enabled: bool = False
    verbose: bool = False
    prof_all: bool = True
    prof_ops: list[str] = dataclasses.field(default_factory=list)
    debug: bool = False
    records: list[CommRecord] = dataclasses.field(default_factory=list)

    def configure(self, enabled: bool | None = None, verbose: bool | None = None,
                  prof_all: bool | None = None, prof_ops: list[str] | None = None,
                  debug: bool | None = None) -> None:
        for key, value in (("enabled", enabled), ("verbose", verbose), ("prof_all", prof_all),
                           ("prof_ops", prof_ops), ("debug", debug)):
            if value is not None:
                setattr(self, key, list(value) if isinstance(value, list) else value)

    def reset(self) -> None:
        self.records.clear()

    def wants(self, op: str) -> bool:
        return self.enabled and (self.prof_all or op in self.prof_ops)

    @contextmanager
    def timed(self, op: str, group_size: int, msg_bytes: int, async_op: bool, force: bool = False) -> Iterator[None]:
        if not (force or self.wants(op)):
            yield
            return
        start_s = time.perf_counter()
        yield
        record = CommRecord(op, group_size, msg_bytes, time.perf_counter() - start_s, async_op)
        self.records.append(record)
        if self.verbose:
            print(f"[zerospeed comm] op={op} group={group_size} bytes={msg_bytes} "
                  f"latency_ms={record.latency_s * 1e3:.3f}", flush=True)

    # --- summaries ------------------------------------------------------------------------
    def bytes_by_op(self) -> dict[str, int]:
        totals: dict[str, int] = defaultdict(int)
        for record in self.records:
            totals[record.op] += record.msg_bytes
        return dict(totals)

    def count_by_op(self) -> dict[str, int]:
        counts: dict[str, int] = defaultdict(int)
        for record in self.records:
            counts[record.op] += 1
        return dict(counts)

    def summary(self) -> str:
        """One line per (op, message size), like DeepSpeed's `log_summary` table."""
        groups: dict[tuple[str, int], list[CommRecord]] = defaultdict(list)
        for record in self.records:
            groups[(record.op, record.msg_bytes)].append(record)
        lines = [f"{'Comm. Op':<24}{'Message Size':>16}{'Count':>8}{'Total Latency(ms)':>20}"
                 f"{'Avg Latency(ms)':>18}{'algbw (Gbps)':>14}"]
        for (op, msg_bytes), records in sorted(groups.items()):
            total_s = sum(r.latency_s for r in records)
            avg_s = total_s / len(records)
            algbw_gbps = (msg_bytes * 8 / avg_s / 1e9) if avg_s > 0 else 0.0
            lines.append(f"{op:<24}{_human_bytes(msg_bytes):>16}{len(records):>8}"
                         f"{total_s * 1e3:>20.2f}{avg_s * 1e3:>18.3f}{algbw_gbps:>14.2f}")
        return "\n".join(lines)


def _human_bytes(num_bytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if num_bytes < 1024 or unit == "GB":
            return f"{num_bytes:.2f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes:.2f} GB"


comms_logger = CommsLogger()


def logged(op: str, msg_tensor_arg: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: time `fn` through the comms logger; `msg_tensor_arg(*args, **kw)` picks the tensor."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, log_name: str | None = None, prof: bool = False, **kwargs: Any) -> Any:
            # `log_name` (DeepSpeed's keyword): the record's name instead of the op's, e.g. which MoE
            # layer an all-to-all belongs to; `prof` is accepted for DeepSpeed's signature.
            with heartbeat.collective(op):  # for the launcher's hang report; a no-op without it
                result = call(log_name or op, *args, **kwargs)
            return heartbeat.track_work(result, op)

        def call(name: str, *args: Any, **kwargs: Any) -> Any:
            if not (comms_logger.wants(op) or comms_logger.wants(name)):
                return fn(*args, **kwargs)
            tensor = msg_tensor_arg(*args, **kwargs)
            msg_bytes = tensor.numel() * tensor.element_size()
            group_size = _group_size(kwargs.get("group"))
            with comms_logger.timed(name, group_size, msg_bytes, bool(kwargs.get("async_op", False)), force=True):
                return fn(*args, **kwargs)

        wrapper.__name__ = fn.__name__
        wrapper.__doc__ = fn.__doc__
        wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapper

    return decorate
