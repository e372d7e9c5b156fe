"""`Stage3GradientReducer`: how a stage-3 wrapper turns full gradients into this rank's partitions.

`DeepSpeedZeroOptimizer_Stage3` (stage3.py) holds one, as stages 1/2 hold their
`GradientBuckets`: the wrapper owns the tensors (`grad_flat`, the sub-group slots) and passes
them to the constructor with its placement, which lands each reduced slice in its sub-group's
buffer (offload/placement.py); the reducer owns the hooks, the open slab and the collectives in flight.

[Note: gradient path]
A post-accumulate-grad hook on each trainable parameter copies its full gradient into the open
slab and drops it (`param.grad` and the hook's reference: it is freed at once). A slab is one
`reduce_scatter_tensor`: its input is `W` rows, row r the concatenation of each parameter's r-th
chunk (zero-padded), so rank r receives exactly its partitions; slabs are at most
`reduce_bucket_size` elements (capped), live in two buffers reused every step, and a parameter
may span two of them ([Note: gradient slabs] in stage3_slabs.py). With gloo the reduce-scatter is
one all-reduce of the rows in place, after which rank r reads row r ([Note: gloo temporaries] in
comm/comm.py). With `overlap_comm` it is asynchronous and one stays in flight while the next slab
fills (`MAX_OUTSTANDING`, [Note: in-flight collectives] in comm/in_flight.py). Results are added
into `grad_flat` once waited.
Gradients of z3-leaf modules wait for the end of backward ([Note: leaf-module gradients]).

[Note: offloaded gradients at stage 3]
The `grad_flat[k]` of an offloaded sub-group is a host buffer (pinned when applicable) and each
reduce-scattered slab reaches it through a `HostGradientSink` (host_grads.py) as the slab
completes, overlapped with the rest of backward, as at stages 1 and 2 ([Note: offloaded
gradients] in stage_1_and_2.py); the sink holds the slab's output (a copy of it, on an
accelerator, when it is a view of a slab buffer) until its copy has landed.
A slice whose widening to `grad_accum_dtype` is exact (bf16 into fp32) crosses as it is, half the
bytes, and the host add widens it; a narrowing is done on the device first, as without offload,
so both runs round the same way (`OffloadPlacement.add_reduced` in offload/placement.py).
`finish` synchronizes the sink (`gradients_complete`), so the overflow
check, the norm (their per-rank scalar reduced on the accelerator) and `OffloadStates.step`
(which takes views, no copy at the step) read final host gradients.

[Note: MoE at stage 3]
An expert parameter lives only on the ranks of its expert-data-parallel group (the ranks holding
the same experts), so it is partitioned over that group (`partition_group` in
parameter_offload.py), gathered over it, and its gradient reduce-scattered over it. Its gradient
already sums, through the all-to-all's backward, the tokens of every rank of its expert-parallel
group, so summing over the expert-data-parallel group covers all W ranks and the usual division
by the data-parallel W gives the mean ([Note: expert gradient reduction], DeepSpeed's scaling).
Which experts receive tokens, and so when their hooks fire, depends on each rank's data: like the
z3-leaf gradients their reduction waits for the end of backward, in ds_id order, and a slab
never mixes process groups. Each slice of each expert sits on exactly one rank of the world, so
the norm and overflow reductions over the data-parallel group count every expert once.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch

from zerospeed import comm
from zerospeed.comm.in_flight import InFlightQueue
from zerospeed.runtime.precision import PrecisionSettings, averaging_factors
from zerospeed.runtime.zero.grad_buckets import MAX_BUCKET_NUMEL
from zerospeed.runtime.zero.param_state import ZeroParameter
from zerospeed.runtime.zero.partition_parameters import compute_device
from zerospeed.runtime.zero.stage3_slabs import GradientSlabs, Slab, SlabPiece, slab_capacity

__all__ = ["GradientSlot", "MAX_OUTSTANDING", "Stage3GradientReducer"]

# Reduce-scatters still in flight while the next slab fills ([Note: gradient path]).
MAX_OUTSTANDING = 1


class GradientSlot(NamedTuple):
    """Where a trainable parameter's gradient partition lives: sub-group and offset in `grad_flat`."""

    sub_group: int
    offset: int


class GradientDestinations(Protocol):
    """How reduced slices reach `grad_flat` (the wrapper's placement, offload/placement.py)."""

    def add_reduced(self, sub_group: int, dest: torch.Tensor, reduced: torch.Tensor) -> None:
        """`dest += reduced`, `dest` a slice of `grad_flat[sub_group]` (on the host: later)."""

    def gradients_complete(self) -> None:
        """Every `add_reduced` so far has landed."""


class Stage3GradientReducer:
    """Hooks, slabs, reduce-scatter and the host sink; `end_backward` ends a backward."""

    def __init__(self, params: list[ZeroParameter], grad_flat: list[torch.Tensor],
                 slots: dict[int, GradientSlot], destinations: GradientDestinations, *,
                 precision: PrecisionSettings, dp_group: Any, reduce_bucket_numel: int, overlap_comm: bool,
                 leaf_param_ids: set[int]) -> None:
        """`params`: the trainable parameters; `grad_flat[k]`: sub-group k's gradient partitions,
        `slots[id(param)]` a parameter's place in them; `destinations`: adds a reduced slice into
        them (through the host sink for an offloaded sub-group); `leaf_param_ids`: ds_ids of the
        parameters of z3-leaf modules ([Note: leaf-module gradients])."""
        self.grad_flat = grad_flat
        self.slots = slots
        self.destinations = destinations
        self.precision = precision
        self.dp_group = dp_group
        self.world_size = comm.get_world_size(dp_group)
        self.reduce_bucket_numel = reduce_bucket_numel
        self.overlap_comm = overlap_comm
        self.leaf_param_ids = leaf_param_ids
        self.before, self.after = averaging_factors(precision, self.world_size)
        # [Note: gradient slabs]: bounded, and no larger than the model
        padded_numel = sum(p.zs_state.padded_numel for p in params)
        self._slabs = GradientSlabs(slab_capacity(reduce_bucket_numel, MAX_BUCKET_NUMEL, padded_numel),
                                    precision.communication_dtype, compute_device(), self.world_size)
        self._slab: Slab | None = None
        self._in_flight = InFlightQueue(MAX_OUTSTANDING if overlap_comm else 0)
        self._deferred: dict[int, torch.Tensor] = {}
        self._leaf_params = sorted((p for p in params if p.zs_state.ds_id in leaf_param_ids
                                    or p.zs_state.group is not dp_group), key=lambda p: p.zs_state.ds_id)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # --- gradients ----------------------------------------------------------------------------
    def _on_grad_ready(self, param: torch.Tensor) -> None:
        grad = param.grad
        param.grad = None
        state = param.zs_state  # type: ignore[attr-defined]
        if grad is None:
            return
        if grad.numel() != state.numel:
            raise RuntimeError(f"ZeRO-3: gradient of parameter {state.describe()} has shape {tuple(grad.shape)}: "
                               "the parameter was used while partitioned (outside the forward of a module "
                               "that owns it). Register it with zero.register_external_parameter(module, "
                               "param) or use it inside zero.GatheredParameters.")
        if state.ds_id in self.leaf_param_ids or state.group is not self.dp_group:
            self._deferred[state.ds_id] = grad  # see [Note: leaf-module gradients], [Note: MoE at stage 3]
            return
        self._add_to_slab(param, grad)  # type: ignore[arg-type]

    def _add_to_slab(self, param: ZeroParameter, grad: torch.Tensor) -> None:
        """Copy `grad` into slabs ([Note: gradient slabs]), reducing each one that fills up; the
        caller's reference is the last, so the full gradient is freed on return."""
        group = param.zs_state.group
        if self._slab is not None and self._slab.group is not group:
            self._flush_slab()   # a slab is one reduce-scatter, over one group
        flat = grad.reshape(-1)
        column, size = 0, param.partition_numel()
        while column < size:
            if self._slab is None:
                self._slab = self._slabs.open(param.zs_state.world_size, group, flat.device)
            column += self._slab.write(param, flat, column)
            if self._slab.free_columns == 0:
                self._flush_slab()

    def _reduce_deferred(self) -> None:
        """[Note: leaf-module gradients] Inside a z3-leaf module (an MoE layer) which parameters
        get a gradient depends on each rank's data, so their hooks fire in different orders and
        numbers on different ranks. Their gradients wait here and are reduced at the end of
        backward in ds_id order, zeros standing in for a missing one: the same collectives on
        every rank."""
        for param in self._leaf_params:
            grad = self._deferred.pop(param.zs_state.ds_id, None)
            if grad is None:
                grad = torch.zeros(param.zs_state.shape, dtype=param.dtype, device=param.ds_tensor.device)
            self._add_to_slab(param, grad)

    def _flush_slab(self) -> None:
        slab, self._slab = self._slab, None
        if slab is None or not slab.pieces:
            return
        if slab.free_columns:
            self._in_flight.drain()   # its rows are compacted into the other buffer: let it finish
        rows = self._slabs.rows_to_reduce(slab)
        if self.before != 1.0:
            rows.mul_(self.before)
        # a reduce-scatter; with gloo an in-place all-reduce of `rows` ([Note: gloo temporaries] in comm.py)
        work, output = comm.reduce_scatter_rows_(rows, group=slab.group, async_op=self.overlap_comm)
        self._in_flight.submit(work, lambda: self._store(output, slab.pieces), keepalive=(rows,))

    def _store(self, output: torch.Tensor, pieces: list[SlabPiece]) -> None:
        """A finished reduce-scatter: average, then add each piece into its parameter's partition.
        `output` is this rank's row of the slab buffer (`reduce_scatter_rows_`), refilled once this
        returns."""
        if self.after != 1.0:
            output.mul_(self.after)
        offset = 0
        for param, column, numel in pieces:
            slot = self.slots[id(param)]
            dest = self.grad_flat[slot.sub_group].narrow(0, slot.offset + column, numel)
            self.destinations.add_reduced(slot.sub_group, dest, output.narrow(0, offset, numel))
            offset += numel

    def end_backward(self) -> None:
        """After each backward: the deferred leaf-module gradients join, then `finish`."""
        self._reduce_deferred()
        self.finish()

    def finish(self) -> None:
        """Reduce the open slab, wait for every reduction, land the host copies."""
        self._flush_slab()
        self._in_flight.drain()
        self.destinations.gradients_complete()   # [Note: offloaded gradients at stage 3] what reads grad_flat comes next

    def slab_buffers(self) -> list[torch.Tensor]:
        """The reused slab buffers allocated so far (scratch between backwards: `offload_states`)."""
        return self._slabs.allocated()
