"""ZeRO-3: a cross-rank check that every rank gathered the same parameters in the same order.

[Note: gather-order check]
ZeRO-3 gathers a module's partitioned parameters in its pre-forward (and pre-backward) hook, one
collective over their partition group, so every rank must call the modules that own partitioned
parameters in the same order. When ranks do not — a Mixture-of-Experts block that runs only the
experts its tokens reached, not marked as a z3 leaf module — their gathers pair up wrongly: a rank
computes with another module's weights (a wrong loss, silently) or waits for a gather the others
never issue. So each rank keeps a running hash of the ds_ids it gathered during the micro-step
(forward and backward, prefetches included; `GatheredParameters` and persistent parameters are the
same on every rank by construction and are not counted) and:

* at the end of every backward, before any gradient of the step is reduced, the ranks exchange
  (number of gathers, hash): one all-gather of two int64 over the data-parallel group per
  micro-step, none per module;
* with DeepSpeed's `zero_optimization.enable_sanity_checks`, before every gather as well: a
  collective per gather, for debugging, as DeepSpeed's sanity checks are.
  It fires before the mismatched gather, so it also catches runs that would hang.

Only the count and the hash are compared; the log of records is for the error message alone, so it
keeps the first `LOGGED_GATHERS` gathers of a micro-step (memory bounded whatever the model's size;
a first difference past them is reported as such). On a mismatch every rank receives every rank's
log (all_gather_object: the error path only) and raises the same error, naming for each rank the first gather where they differ and the module that
triggered it. A rank whose collectives stop pairing before the end of backward (say rank 1 gathers
an expert rank 0 never calls, and the sizes of the gathers that then meet differ) can still wait
forever inside a gather; the per-gather check is for that case.
Python's `hash` of a tuple of ints is the same in every process (only str and bytes hashes are
salted), so the hashes compare across ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from zerospeed import comm

__all__ = ["CHECK_LOG_NAME", "GatherOrderCheck", "GatherRecord", "ModuleOrderError"]

CHECK_LOG_NAME = "zero3.module_order_check"   # the comms logger's name for the exchange
LOGGED_GATHERS = 1 << 14   # records kept per micro-step for the error message (hash and count: all)


class ModuleOrderError(RuntimeError):
    """Ranks gathered different ZeRO-3 parameters: they called different submodules."""


@dataclasses.dataclass(frozen=True)
class GatherRecord:
    module_id: int          # the module whose fetch issued the gather (for prefetches: the one being fetched)
    forward: bool
    prefetch: bool
    ds_ids: tuple[int, ...]


class GatherOrderCheck:
    """The log of one micro-step's gathers and its cross-rank comparison ([Note: gather-order check])."""

    def __init__(self, group: Any, module_name: Callable[[int], str], device: torch.device,
                 every_gather: bool = False) -> None:
        self.group = group
        self.module_name = module_name
        self.device = device
        self.every_gather = every_gather
        self.num_checks = 0                 # exchanges done (tests count them)
        self._records: list[GatherRecord] = []   # the first LOGGED_GATHERS of the micro-step
        self._count = 0
        self._hash = 0

    def reset(self) -> None:
        """Start of a micro-step (the root module's forward)."""
        self._records = []
        self._count = 0
        self._hash = 0

    def record(self, module_id: int, forward: bool, prefetch: bool, ds_ids: Sequence[int]) -> None:
        """A gather of `ds_ids` is about to be issued. With `every_gather` it is compared first, over
        the data-parallel group: the gather's own group may be an expert-data-parallel one, but in a
        consistent run every rank of the data-parallel group is at the same gather (of its own experts:
        the same ds_ids)."""
        ids = tuple(ds_ids)
        if self._count < LOGGED_GATHERS:
            self._records.append(GatherRecord(module_id, forward, prefetch, ids))
        self._count += 1
        self._hash = hash((self._hash, ids))
        if self.every_gather:
            self.verify(self.group, f"before gather #{self._count - 1}")

    def end_backward(self) -> None:
        """End of a backward: compare over the data-parallel group, then start a new log."""
        self.verify(self.group, "at the end of backward")
        self.reset()

    def verify(self, group: Any, when: str) -> None:
        world_size = comm.get_world_size(group)
        if world_size == 1:
            return
        mine = torch.tensor([self._count, self._hash], dtype=torch.int64, device=self.device)
        every = torch.empty(world_size * 2, dtype=torch.int64, device=self.device)
        comm.all_gather_into_tensor(every, mine, group=group, log_name=CHECK_LOG_NAME)
        self.num_checks += 1
        rows = every.view(world_size, 2).tolist()
        if all(row == rows[0] for row in rows):
            return
        logs: list[Any] = [None] * world_size
        torch.distributed.all_gather_object(logs, (self._count, self._records), group=group)
        ranks = [comm.get_global_rank(group, r) for r in range(world_size)]
        raise ModuleOrderError(self._describe(logs, ranks, when))

    def _describe(self, logs: list[tuple[int, list[GatherRecord]]], ranks: list[int], when: str) -> str:
        """`logs`: each rank's (number of gathers, its first LOGGED_GATHERS records)."""
        first = _first_difference([records for _, records in logs])
        lines = [f"ZeRO-3: the ranks gathered different parameters ({when}): they called different submodules "
                 f"that own partitioned parameters. First difference, gather #{first} of this micro-step:"]
        for rank, (count, records) in zip(ranks, logs):
            lines.append(f"  rank {rank}: " + self._entry_at(first, count, records))
        lines.append("ZeRO-3 needs every rank to call the modules with partitioned parameters in the same order. "
                     "An MoE block that runs only the experts its tokens reached must be a z3 leaf module, "
                     "gathered whole: zerospeed.utils.set_z3_leaf_modules(model, [BlockClass]) or "
                     "zero_optimization.leaf_module.classes (docs/moe.md).")
        return "\n".join(lines)

    def _entry_at(self, index: int, count: int, records: list[GatherRecord]) -> str:
        if index < len(records):
            return self._entry(records[index])
        if index >= count:
            return f"no such gather (it gathered {count} times)"
        return f"not logged (only the first {LOGGED_GATHERS} gathers of a micro-step are; it gathered {count} times)"

    def _entry(self, record: GatherRecord) -> str:
        kind = ("forward" if record.forward else "backward") + (", prefetch" if record.prefetch else "")
        ids = list(record.ds_ids)
        shown = ids if len(ids) <= 6 else ids[:6] + ["..."]
        return f"{self.module_name(record.module_id)} ({kind}), parameters ds_id {shown}"


def _first_difference(logs: list[list[GatherRecord]]) -> int:
    """Index of the first gather whose ds_ids differ between ranks (or that some rank lacks or did not
    log)."""
    index = 0
    while all(index < len(log) for log in logs) and len({log[index].ds_ids for log in logs}) == 1:
        index += 1
    return index
