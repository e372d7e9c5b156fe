"""The PartitionedParameterCoordinator: which parameters are gathered when (DeepSpeed's
`deepspeed/runtime/zero/partitioned_param_coordinator.py::PartitionedParameterCoordinator`).

[Note: trace]
Trace mode starts INVALID. The first `reset_step` (start of a forward) switches to RECORD: every
`fetch_sub_module` call of that micro-step — forward and backward — is appended to the trace. The
next `reset_step` turns the recording into the trace and switches to COMPLETE. With a COMPLETE
trace each fetch checks the module against the trace; a different module (the model's order
changed under data-dependent control flow) invalidates the trace — one warning, in-flight gathers
are completed, fetching is on demand — and the next step records again.

Invariants
- `n_available_numel` counts the elements of non-persistent parameters that are INFLIGHT or
  AVAILABLE. Prefetch never takes it past `max_live_parameters`, and a released parameter is kept
  for reuse only while it stays within that bound, so at any moment it is at most
  `max_live_parameters` plus the module being fetched.
- A parameter is released only when no module that is running (forward or backward) uses it, and
  only by the coordinator that gathered it: one gathered by `GatheredParameters` stays until that
  context exits, even if a module's forward runs inside it.
- Persistent parameters (`ds_persist`) are never released here; they are gathered once and
  refreshed after each optimizer step.
- With `offload_param: nvme`, partitions the trace needs next are read from disk ahead of their
  gather (`_read_ahead`), bounded by the swapper's budget, not by `max_live_parameters`.
- Every gather it issues is logged for the cross-rank check of gather_order_check.py ([Note:
  gather-order check]), under the module being fetched.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
from typing import Any

import torch

from zerospeed.runtime.zero.gather_order_check import GatherOrderCheck
from zerospeed.runtime.zero.param_state import ZeroParameter, ZeroParamState, ZeroParamStatus
from zerospeed.runtime.zero.partition_parameters import GatherHandle, gather_params, release_params
from zerospeed.utils.logging import logger

__all__ = ["PartitionedParameterCoordinator", "ZeRoTraceMode"]


class ZeRoTraceMode(enum.Enum):
    RECORD = 1
    COMPLETE = 2
    INVALID = 3


@dataclasses.dataclass(frozen=True)
class TraceEntry:
    module_id: int
    forward: bool
    params: tuple[ZeroParameter, ...]


class ReuseWindow:
    """Which parameters a trace uses again soon: ds_id `d` is reused soon at step `s` when it occurs
    in the trace entries from `s` on that start before `max_reuse_distance` elements have been
    traversed (each entry counting its parameters' numel). Prefix sums and each ds_id's sorted
    occurrences answer that by bisection, where walking the trace made every release O(trace)."""

    def __init__(self, trace: list[TraceEntry], max_reuse_distance: int) -> None:
        self.trace = trace
        self.max_reuse_distance = max_reuse_distance
        self.prefix_numel = [0]
        self.occurrences: dict[int, list[int]] = {}
        for index, entry in enumerate(trace):
            for param in entry.params:
                self.occurrences.setdefault(param.zs_state.ds_id, []).append(index)
            self.prefix_numel.append(self.prefix_numel[-1] + sum(p.zs_state.numel for p in entry.params))

    def reused_soon(self, ds_id: int, step_id: int) -> bool:
        if step_id >= len(self.trace):
            return False
        limit = self.prefix_numel[step_id] + self.max_reuse_distance
        end = min(bisect.bisect_left(self.prefix_numel, limit, lo=step_id), len(self.trace))
        found = self.occurrences.get(ds_id, [])
        next_use = bisect.bisect_left(found, step_id)
        return next_use < len(found) and found[next_use] < end


class TraceWalk:
    """The trace's parameters end to end, each with its state, and where each entry's begin: what
    `_prefetch` walks at every fetch, built once per trace instead of a loop over entries and
    parameters that looked up every parameter's state each time."""

    def __init__(self, trace: list[TraceEntry]) -> None:
        self.trace = trace
        self.pairs: list[tuple[ZeroParamState, ZeroParameter]] = []
        self.entry_start: list[int] = []
        for entry in trace:
            self.entry_start.append(len(self.pairs))
            self.pairs.extend((param.zs_state, param) for param in entry.params)
        self.entry_start.append(len(self.pairs))

    def after(self, step_id: int) -> list[tuple[ZeroParamState, ZeroParameter]]:
        """The parameters of the entries after `step_id`, in trace order (repeats included)."""
        return self.pairs[self.entry_start[min(step_id + 1, len(self.trace))]:]


class PartitionedParameterCoordinator:
    def __init__(self, prefetch_bucket_size: int, max_live_parameters: int, max_reuse_distance: int,
                 all_params: list[ZeroParameter]) -> None:
        self.prefetch_bucket_size = int(prefetch_bucket_size)
        self.max_live_parameters = int(max_live_parameters)
        self.max_reuse_distance = int(max_reuse_distance)
        self.all_params = all_params
        self.trace_mode = ZeRoTraceMode.INVALID
        self.trace: list[TraceEntry] = []
        self._recording: list[TraceEntry] = []
        self.step_id = 0
        self._inflight: dict[int, GatherHandle] = {}
        self._owned: set[int] = set()   # ds_ids this coordinator gathered (and so may release)
        self.n_available_numel = 0
        self.peak_available_numel = 0
        self.num_invalidations = 0
        self._warned = False
        self._swapping = False
        self.order_check: GatherOrderCheck | None = None   # set by DeepSpeedZeRoOffload
        self._fetching = (-1, True)     # (module id, forward) of the fetch in progress, for the log
        self._window: ReuseWindow | None = None
        self._walk: TraceWalk | None = None

    # --- trace --------------------------------------------------------------------------------
    def is_complete_trace(self) -> bool:
        return self.trace_mode is ZeRoTraceMode.COMPLETE

    def reset_step(self) -> None:
        """Start of a micro-step (root forward): finish a recording, or start one."""
        self._wait_all()
        if self.trace_mode is ZeRoTraceMode.RECORD:
            self.trace, self._recording = self._recording, []
            self.trace_mode = ZeRoTraceMode.COMPLETE
        elif self.trace_mode is ZeRoTraceMode.INVALID:
            self._recording = []
            self.trace_mode = ZeRoTraceMode.RECORD
        self.step_id = 0
        self._swapping = any(p.zs_state.swapped is not None for p in self.all_params)
        if self.order_check is not None:
            self.order_check.reset()

    def _check_trace(self, module_id: int, forward: bool, params: tuple[ZeroParameter, ...]) -> None:
        if self.trace_mode is ZeRoTraceMode.RECORD:
            self._recording.append(TraceEntry(module_id, forward, params))
        elif self.trace_mode is ZeRoTraceMode.COMPLETE:
            expected = self.trace[self.step_id] if self.step_id < len(self.trace) else None
            if expected is None or expected.module_id != module_id or expected.forward != forward:
                self.invalidate_trace()

    def is_invalid_trace(self) -> bool:
        return self.trace_mode is ZeRoTraceMode.INVALID

    def _invalidate_trace(self) -> None:
        """DeepSpeed's name, called by clients (TRL) after running the model outside training."""
        self._wait_all()
        self.trace_mode = ZeRoTraceMode.INVALID
        self.trace = []

    def invalidate_trace(self) -> None:
        self._wait_all()
        self.trace_mode = ZeRoTraceMode.INVALID
        self.trace = []
        self.num_invalidations += 1
        if not self._warned:
            self._warned = True
            logger.warning("ZeRO-3: the order of module calls changed since the recorded trace; "
                           "prefetching is off until a new trace is recorded (this warning is shown once)")

    # --- fetch --------------------------------------------------------------------------------
    def fetch_sub_module(self, module_id: int, params: tuple[ZeroParameter, ...], forward: bool) -> None:
        self._check_trace(module_id, forward, params)
        self._fetching = (module_id, forward)
        self._start_gather([p for p in params if p.zs_state.status is ZeroParamStatus.NOT_AVAILABLE])
        inflight = self._inflight
        for param in params:   # waiting for one parameter's gather touches no parameter's active set
            state = param.zs_state
            if inflight:
                handle = inflight.get(state.ds_id)
                if handle is not None:
                    self._complete(handle)
            state.active_sub_modules.add(module_id)
        if self.trace_mode is ZeRoTraceMode.COMPLETE:
            self._prefetch()
            if self._swapping:
                self._read_ahead()
        self.step_id += 1

    def fetch_now(self, param: ZeroParameter, module_id: int = -1) -> None:
        """A synchronous fetch of one parameter (one read during forward outside its module
        `module_id`, the one running)."""
        if param.zs_state.status is ZeroParamStatus.NOT_AVAILABLE:
            self._fetching = (module_id, True)
            self._start_gather([param])
        handle = self._inflight.get(param.zs_state.ds_id)
        if handle is not None:
            self._complete(handle)

    def _start_gather(self, params: list[ZeroParameter], async_op: bool = False) -> None:
        if not params:
            return
        if self.order_check is not None:   # [Note: gather-order check]; prefetches are the async gathers
            ds_ids = sorted({p.zs_state.ds_id for p in params if p.zs_state.status is ZeroParamStatus.NOT_AVAILABLE})
            self.order_check.record(*self._fetching, async_op, ds_ids)
        for handle in gather_params(params, async_op=async_op).handles:
            for param in handle.params:   # a fetch waits for its parameters' handles only
                self._inflight[param.zs_state.ds_id] = handle
                if not param.zs_state.persist:
                    self._owned.add(param.zs_state.ds_id)
                    self.n_available_numel += param.zs_state.numel
        self.peak_available_numel = max(self.peak_available_numel, self.n_available_numel)

    def _complete(self, handle: GatherHandle) -> None:
        handle.wait()
        for param in handle.params:
            self._inflight.pop(param.zs_state.ds_id, None)

    def _wait_all(self) -> None:
        for handle in list({id(h): h for h in self._inflight.values()}.values()):
            self._complete(handle)

    def _prefetch(self) -> None:
        """Gather ahead along the trace: up to `prefetch_bucket_size` elements (the last parameter
        may overshoot it, as DeepSpeed's), never past `max_live_parameters` (strict)."""
        room = self.max_live_parameters - self.n_available_numel
        chosen: dict[int, ZeroParameter] = {}
        chosen_numel = 0
        not_available = ZeroParamStatus.NOT_AVAILABLE
        for state, param in self._trace_walk().after(self.step_id):
            if state.status is not not_available or state.ds_id in chosen:
                continue
            if chosen_numel >= self.prefetch_bucket_size or chosen_numel + state.numel > room:
                self._start_gather(list(chosen.values()), async_op=True)
                return
            chosen[state.ds_id] = param
            chosen_numel += state.numel
        self._start_gather(list(chosen.values()), async_op=True)

    def _read_ahead(self) -> None:
        """offload_param nvme: start reading from disk the partitions that the gathers after the
        prefetched ones will need, along the trace, as far as the swapper's budget allows."""
        for entry in self.trace[self.step_id + 1:]:
            for param in entry.params:
                swapped = param.zs_state.swapped
                if swapped is None or param.zs_state.status is not ZeroParamStatus.NOT_AVAILABLE:
                    continue
                if not swapped.swapper.prefetch(swapped):
                    return

    # --- release ------------------------------------------------------------------------------
    def release_sub_module(self, module_id: int, params: tuple[ZeroParameter, ...]) -> None:
        for param in params:
            param.zs_state.active_sub_modules.discard(module_id)
        candidates = [p for p in params if p.zs_state.ds_id in self._owned and not p.zs_state.active_sub_modules
                      and p.zs_state.status is ZeroParamStatus.AVAILABLE]
        if self.is_complete_trace() and self.n_available_numel <= self.max_live_parameters:
            window = self._reuse_window()
            candidates = [p for p in candidates if not window.reused_soon(p.zs_state.ds_id, self.step_id)]
        self._release(candidates)

    def _trace_walk(self) -> TraceWalk:
        if self._walk is None or self._walk.trace is not self.trace:
            self._walk = TraceWalk(self.trace)
        return self._walk

    def _reuse_window(self) -> ReuseWindow:
        if self._window is None or self._window.trace is not self.trace:
            self._window = ReuseWindow(self.trace, self.max_reuse_distance)
        return self._window

    def _release(self, params: list[ZeroParameter]) -> None:
        release_params(params)
        for param in params:
            self._owned.discard(param.zs_state.ds_id)
            self.n_available_numel -= param.zs_state.numel

    def release_all(self) -> None:
        """End of backward / start of step: every non-persistent parameter back to NOT_AVAILABLE."""
        self._wait_all()
        for param in self.all_params:
            param.zs_state.active_sub_modules.clear()
        self._release([p for p in self.all_params if p.zs_state.ds_id in self._owned])
        assert self.n_available_numel == 0, f"coordinator lost count: {self.n_available_numel} left"

    def params_summary(self) -> dict[str, Any]:
        return {"trace_mode": self.trace_mode.name, "trace_length": len(self.trace),
                "n_available_numel": self.n_available_numel, "peak_available_numel": self.peak_available_numel,
                "num_invalidations": self.num_invalidations, "inflight": len(self._inflight)}


def module_params(module: torch.nn.Module, leaf: bool) -> list[torch.nn.Parameter]:
    return list(module.parameters(recurse=leaf))
