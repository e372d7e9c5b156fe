"""ZeRO stages 1 and 2: `DeepSpeedZeroOptimizer`, a wrapper around a normal torch optimizer.

Per param group (partition.py, [Note: flat layout]) the trainable low-precision parameters live in
one flat buffer (`bit16_groups_flat`), padded to a multiple of 2W and split into W equal
partitions; each parameter's `.data` is a view into it, frozen parameters stay outside. The base
optimizer's group holds one tensor: this rank's fp32 master partition, so Adam's state exists
only for 1/W of the model.

- Stage 1: gradients accumulate, across micro-batches, into a full flat gradient buffer in
  `grad_accum_dtype`: each `param.grad` is a view of its slot, into which autograd accumulates
  ([Note: stage-1 gradients as views] in grad_views.py; with an accumulation dtype other than the
  model's, a post-accumulate hook adds each `param.grad` and frees it); at the
  boundary the buffer is reduced in slabs (grad_buckets.py) so this rank's partition of it
  holds the averaged gradients. With `overlap_comm` the boundary micro-batch's hooks instead
  send each accumulated gradient to its owners while backward runs (the engine announces that
  micro-batch through `prepare_backward`).
- Stage 2: the hook hands each gradient to `GradientBuckets` as backward produces it; each full
  bucket is reduced to the slices' owners (overlapped with backward under `overlap_comm`) and
  accumulated into a gradient buffer of partition size only.

`step()` checks overflow across ranks, takes the global norm of the partitioned gradients,
unscales and clips, runs the base optimizer on the partitions, copies masters into the flat lp
buffer and all-gathers it in `allgather_bucket_size` chunks.

[Note: fp32 master sharing]
With fp32 parameters the master partition *is* this rank's partition of the flat parameter
buffer (a view, not a copy): the ZeRO paper's accounting (fp32 Adam: 4 Psi params + 8 Psi/N
states, with 4 Psi or 4 Psi/N grads) and no copy-back after the step. With fp16/bf16
parameters the master is a separate fp32 clone. With `offload_optimizer` the masters and the
optimizer state belong to `OffloadStates` (offload_states.py, host memory or NVMe): the wrapper
hands it the partitioned gradients at the step, and `_FlatGroup.master` is just the lp partition.
Which of the two a run has is decided once, by `self.placement` (offload/group_placement.py).

[Note: offloaded gradients]
With `offload_optimizer` the partition the step reads (`_FlatGroup.partition_grad`) is a host
buffer (pinned when applicable): at stage 2 it is `grads` itself, at stage 1 a buffer beside the
device-side full flat `grads`, which keeps accumulating on the device. The reductions write into
it through a `HostGradientSink` (host_grads.py) as each bucket or slab completes, overlapped with
backward; `backward_epilogue` synchronizes the sink, so the step finds the gradients on the host
and `OffloadStates.step` takes views of them. Stage 2 still accumulates over micro-batches (the
sink adds), stage 1 still reduces at the boundary (the sink copies). The overflow check and the
norm reduce their per-rank scalar on the accelerator (`comm_device`), never the host buffer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from zerospeed import comm
from zerospeed.comm.run_groups import RunGroups
from zerospeed.runtime.base_optimizer import DeepSpeedOptimizer, StepGradients, tensor_bytes
from zerospeed.runtime.config_utils import warn_config
from zerospeed.runtime.expert_gradients import DENSE, expert_group_name
from zerospeed.runtime.fp16.loss_scaler import LossScaler
from zerospeed.runtime.grad_space import GradSpace, Piece
from zerospeed.runtime.precision import PrecisionSettings
from zerospeed.runtime.zero.grad_buckets import GradientBuckets, GradReducer, reduce_flat_gradients
from zerospeed.runtime.zero.grad_views import FlatGradViews
from zerospeed.runtime.zero.muon.attach import attach_zero12
from zerospeed.runtime.zero.offload.group_placement import build_group_placement
from zerospeed.runtime.zero.offload.offload_states import OffloadStates
from zerospeed.runtime.zero.offload.config import OffloadStateTypeEnum
from zerospeed.runtime.zero.stage_1_and_2_checkpoint import Zero12Checkpointing
from zerospeed.runtime.zero.partition import (
    GroupLayout,
    Slab,
    allgather_chunks,
    build_layout,
    plan_slabs,
    round_robin_order,
)
from zerospeed.runtime.zero.state_offload import StateTensors

__all__ = ["DeepSpeedZeroOptimizer"]


@dataclasses.dataclass
class _FlatGroup:
    """One optimizer param group, flattened (DeepSpeed's per-group lists, as one object)."""

    params: list[torch.nn.Parameter]    # trainable, in flat order
    names: list[str]
    layout: GroupLayout
    slabs: list[Slab]
    lp_flat: torch.Tensor               # bit16_groups_flat[i] (or fp32), padded
    lp_partition: torch.Tensor          # this rank's view of lp_flat
    master: torch.Tensor                # single_partition_of_fp32_groups[i]
    grads: torch.Tensor                 # stage 1: full flat; stage 2: this rank's partition
    partition_grad: torch.Tensor        # what the step reads ([Note: offloaded gradients])
    padding: int                        # padded elements inside this rank's partition
    process_group: Any                  # partitioned and reduced over ([Note: MoE param groups])
    dp_rank: int                        # this rank's index in process_group
    world_size: int                     # partitions: process_group's size
    grad_views: FlatGradViews | None = None   # stage 1: the `.grad`s as views of `grads`


@dataclasses.dataclass(frozen=True)
class _ZeroSettings:
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    round_robin_gradients: bool = False
    load_from_fp32_weights: bool = True

    @classmethod
    def from_config(cls, zero_config: Any) -> _ZeroSettings:
        values: dict[str, Any] = {field.name: getattr(zero_config, field.name, field.default)
                                  for field in dataclasses.fields(cls)}
        values["overlap_comm"] = bool(values["overlap_comm"])   # None (unset) means off below stage 3
        return cls(**values)


# Keys DeepSpeed's stage 1/2 honours that this implementation does not (value that is a no-op here).
_NOT_IMPLEMENTED = {"elastic_checkpoint": False, "parameter_alignment": False,
                    "zero_quantized_gradients": False, "zero_quantized_weights": False,
                    "zero_hpz_partition_size": 1}


def _warn_ignored(zero_config: Any) -> None:
    for key, inert in _NOT_IMPLEMENTED.items():
        value = getattr(zero_config, key, inert)
        if value != inert:
            warn_config(f"zero_optimization.{key}={value!r} is not implemented for ZeRO stages 1 and 2 "
                        "and is ignored")


def _separate(tensor: torch.Tensor, other: torch.Tensor) -> bool:
    return tensor.untyped_storage().data_ptr() != other.untyped_storage().data_ptr()


class DeepSpeedZeroOptimizer(Zero12Checkpointing, DeepSpeedOptimizer):
    def __init__(self, init_optimizer: torch.optim.Optimizer, zero_config: Any, precision: PrecisionSettings,
                 loss_scaler: LossScaler, dp_group: Any, partition_grads: bool,
                 param_names: dict[torch.nn.Parameter, str], offload: OffloadStates | None = None,
                 grad_space: GradSpace | None = None, run_groups: RunGroups | None = None) -> None:
        self._init_base(init_optimizer, loss_scaler, precision, grad_space or GradSpace.data_parallel(dp_group, True))
        self.run_groups = run_groups   # expert-data-parallel groups of MoE param groups ([Note: run groups])
        self.offload = offload
        # where the masters, optimizer state and step gradients live, decided once (offload/group_placement.py)
        self.placement = build_group_placement(init_optimizer, zero_config, offload)
        self.sink = self.placement.sink
        # [Note: offloaded gradients] host gradients: the step's scalar collectives run there.
        self._comm_device = self.placement.comm_device
        self.settings = _ZeroSettings.from_config(zero_config)
        _warn_ignored(zero_config)
        self.dp_process_group = dp_group
        self.dp_rank = comm.get_rank(dp_group)
        self.dp_world_size = comm.get_world_size(dp_group)
        self.partition_gradients = partition_grads
        self.supports_no_sync = not partition_grads
        self.zero_stage = 2 if partition_grads else 1
        self.groups = [self._init_group(index, group, param_names)
                       for index, group in enumerate(init_optimizer.param_groups)]
        attach_zero12(init_optimizer, self.groups, run_groups)   # Muon's matrix owners; nothing for other optimizers
        self._init_reduction()
        self._unreduced = False

    # --- setup ------------------------------------------------------------------------------
    def _init_group(self, group_index: int, group: dict[str, Any],
                    param_names: dict[torch.nn.Parameter, str]) -> _FlatGroup:
        params = [p for p in group["params"] if p.requires_grad]
        process_group = self._partition_group(group_index, group, params)
        world_size, dp_rank = comm.get_world_size(process_group), comm.get_rank(process_group)
        if self.settings.round_robin_gradients:
            params = [params[i] for i in round_robin_order(len(params), world_size)]
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise TypeError(f"ZeRO param group {group_index} mixes dtypes {sorted(map(str, dtypes))}; "
                            "cast the model to one dtype first")
        dtype = dtypes.pop() if dtypes else self.precision.param_dtype
        device = params[0].device if params else torch.device("cpu")
        layout = build_layout([p.numel() for p in params], world_size)
        lp_flat = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
        for param, offset in zip(params, layout.param_offsets):
            view = lp_flat.narrow(0, offset, param.numel())
            view.copy_(param.data.reshape(-1))
            param.data = view.view_as(param)
        start, part_numel = layout.partition_start(dp_rank), layout.partition_numel
        lp_partition = lp_flat.narrow(0, start, part_numel)
        master = self.placement.master(group, lp_partition)   # [Note: fp32 master sharing]
        grads, partition_grad = self._init_grad_buffers(layout, device, dp_rank)
        names = [param_names.get(p, f"group{group_index}.param{i}") for i, p in enumerate(params)]
        slabs = plan_slabs(part_numel, world_size, self.settings.reduce_bucket_size)
        views = None   # [Note: stage-1 gradients as views]: only where the dtype allows them
        if not self.partition_gradients and FlatGradViews.possible(params, grads):
            views = FlatGradViews(params, grads, layout.param_offsets)
        return _FlatGroup(params, names, layout, slabs, lp_flat, lp_partition, master, grads, partition_grad,
                          layout.padding_in_partition(dp_rank), process_group, dp_rank, world_size, views)

    def _partition_group(self, group_index: int, group: dict[str, Any], params: list[torch.nn.Parameter]) -> Any:
        """[Note: MoE param groups] DeepSpeed's MoE param groups (`moe: True`, named after their expert
        group) are partitioned and reduced over that expert-data-parallel group, every other group over
        the data-parallel group. Expert gradients are still averaged over the data-parallel world, and
        the norm needs no change: the partitions of all ranks together hold every expert once."""
        experts = [expert_group_name(p) != DENSE for p in params]
        if not group.get("moe", False):
            if any(experts):
                raise ValueError(f"The model has moe layers, but param group {group_index} holds expert parameters "
                                 "and is not marked as MoE: build the optimizer's groups with "
                                 "zerospeed.moe.utils.split_params_into_different_moe_groups_for_optimizer, "
                                 "or use an optimizer from the config")
            return self.dp_process_group
        if not all(experts):
            raise ValueError(f"param group {group_index} is marked moe but holds non-expert parameters")
        from zerospeed.comm import groups

        return groups.expert_groups(group["name"], self.run_groups).expert_data_parallel.group

    def _init_grad_buffers(self, layout: GroupLayout, device: torch.device,
                           dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the buffer gradients accumulate in, the partition of them the step reads)."""
        dtype, part_numel = self.precision.grad_accum_dtype, layout.partition_numel
        if self.partition_gradients:
            grads = self.placement.grad_buffer(part_numel, dtype, device)
            return grads, grads
        grads = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
        # [Note: offloaded gradients]: with offload, a host buffer beside the device-side flat one
        return grads, self.placement.partition_grad(grads.narrow(0, layout.partition_start(dp_rank), part_numel))

    def _init_reduction(self) -> None:
        # One reducer and bucket set per process group the param groups are partitioned over: the
        # data-parallel group, plus one per expert group ([Note: MoE param groups]).
        self._bucket_sets: list[GradientBuckets] = []
        self._bucket_slot = [(0, 0)] * len(self.groups)   # param group -> (bucket set, index in it)
        members: dict[int, list[int]] = {}
        for index, group in enumerate(self.groups):
            members.setdefault(id(group.process_group), []).append(index)
        for set_index, indices in enumerate(members.values()):
            reducer = GradReducer(self.groups[indices[0]].process_group, self.precision, self.settings.reduce_scatter,
                                  self.settings.overlap_comm, self.sink, average_world_size=self.dp_world_size)
            # Stage 2 reduces from every backward's hooks; stage 1 with overlap_comm from the boundary
            # micro-batch's hooks (the reduced slices then replace its partition of the flat buffer).
            self._bucket_sets.append(GradientBuckets(
                [self.groups[i].layout for i in indices], [self.groups[i].partition_grad for i in indices], reducer,
                self.precision.communication_dtype, self.settings.reduce_bucket_size,
                self.settings.contiguous_gradients, accumulate=self.partition_gradients))
            for local, index in enumerate(indices):
                self._bucket_slot[index] = (set_index, local)
        self.buckets = self._bucket_sets[0] if self._bucket_sets else None
        self.reducer = self.buckets.reducer if self.buckets is not None else None
        self._reduce_in_backward = False
        self._param_slot = {param: (gi, pi) for gi, g in enumerate(self.groups)
                            for pi, param in enumerate(g.params)}
        self._hook_handles = [param.register_post_accumulate_grad_hook(self._on_grad_ready)
                              for param in self._param_slot]

    def remove_hooks(self) -> None:
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []

    # --- gradients --------------------------------------------------------------------------
    def _on_grad_ready(self, param: torch.Tensor) -> None:
        group_index, param_index = self._param_slot[param]
        views = self.groups[group_index].grad_views
        if views is None:
            self._move_grad(group_index, param_index, param)
            return
        # [Note: stage-1 gradients as views]: autograd has accumulated into the flat buffer.
        accumulated = views.adopt(param_index)
        if self._reduce_in_backward:
            self._add_to_bucket(group_index, param_index, accumulated)
        self._unreduced = True

    def _move_grad(self, group_index: int, param_index: int, param: torch.Tensor) -> None:
        """Stage 2, and stage 1 accumulating in another dtype: the gradient leaves `.grad`."""
        grad = param.grad
        if grad is None:
            return
        if self.partition_gradients:
            self._add_to_bucket(group_index, param_index, grad)
        else:
            accumulated = self._accumulated(self.groups[group_index], param_index)
            accumulated.add_(grad.reshape(-1))
            if self._reduce_in_backward:
                self._add_to_bucket(group_index, param_index, accumulated)
        param.grad = None
        self._unreduced = True

    def _add_to_bucket(self, group_index: int, param_index: int, grad: torch.Tensor) -> None:
        bucket_set, local = self._bucket_slot[group_index]
        self._bucket_sets[bucket_set].add_grad(local, param_index, grad)

    def _flush_buckets(self) -> None:
        for buckets in self._bucket_sets:
            buckets.flush()

    def prepare_backward(self, will_reduce: bool) -> None:
        for group in self.groups:
            if group.grad_views is not None:
                group.grad_views.attach()   # once per window
        self._reduce_in_backward = will_reduce and self.settings.overlap_comm and not self.partition_gradients

    def backward_epilogue(self, is_boundary: bool) -> None:
        if self.partition_gradients:
            self._flush_buckets()         # stage 2 reduces every micro-batch
            self._unreduced = False
        elif is_boundary and self._reduce_in_backward:
            self._finish_reduce_in_backward()
        elif is_boundary:
            self._reduce_full_gradients()
        self.placement.gradients_complete()   # [Note: offloaded gradients] the step reads them next

    def _finish_reduce_in_backward(self) -> None:
        """Stage 1 + overlap_comm: parameters whose gradient came only in earlier micro-batches
        did not fire a hook in this backward; reduce them now, in flat order, then wait."""
        for group_index, group in enumerate(self.groups):
            bucket_set, local = self._bucket_slot[group_index]
            for param_index in range(len(group.params)):
                if not self._bucket_sets[bucket_set].has_arrived(local, param_index):
                    self._add_to_bucket(group_index, param_index, self._accumulated(group, param_index))
        self._flush_buckets()
        self._release_views()
        self._reduce_in_backward = False
        self._unreduced = False

    @staticmethod
    def _accumulated(group: _FlatGroup, param_index: int) -> torch.Tensor:
        """Parameter `param_index`'s slot of the flat buffer, holding its gradient."""
        if group.grad_views is not None:
            return group.grad_views.adopt(param_index)
        return group.grads.narrow(0, group.layout.param_offsets[param_index], group.params[param_index].numel())

    def _reduce_full_gradients(self) -> None:
        for index, group in enumerate(self.groups):
            if group.grad_views is not None:
                group.grad_views.adopt_all()   # a `.grad` replaced or cleared mid-window
            reducer = self._bucket_sets[self._bucket_slot[index][0]].reducer
            reduce_flat_gradients(group.grads, group.layout, group.slabs, reducer,
                                  self.precision.communication_dtype, group.partition_grad)
        self._release_views()
        self._unreduced = False

    def _release_views(self) -> None:
        """The buffers now hold reduced partitions: no `.grad` shows them ([Note: stage-1 gradients as views])."""
        for group in self.groups:
            if group.grad_views is not None:
                group.grad_views.release()

    # --- step ([Note: one step] in base_optimizer.py) -------------------------------------------
    def _step_gradients(self) -> StepGradients:
        if self._unreduced:
            self.backward_epilogue(is_boundary=True)
        return StepGradients([g.partition_grad for g in self.groups], self._comm_device)

    def _tensor_parallel_norm_pieces(self, grads: StepGradients) -> list[Piece]:
        # The partition's parameter fragments, padding left out ([Note: gradient space] in grad_space.py).
        return [(grad.narrow(0, frag.partition_start, frag.numel),
                 self.grad_space.part_of(group.params[frag.param_index]))
                for group, grad in zip(self.groups, grads.tensors) for frag in group.layout.fragments(group.dp_rank)]

    def _apply_update(self, grads: list[torch.Tensor], multiplier: float) -> None:
        self.placement.step([g.master for g in self.groups], grads, multiplier)
        self._publish_params()

    def _publish_params(self) -> None:
        """Masters -> this rank's lp partition -> all-gathered into every rank's flat buffer."""
        for group in self.groups:
            if group.master.data_ptr() != group.lp_partition.data_ptr():
                group.lp_partition.copy_(group.master)
            self._all_gather_group(group)

    def _all_gather_group(self, group: _FlatGroup) -> None:
        world_size, part_numel = group.world_size, group.layout.partition_numel
        if world_size == 1:   # the partition is the whole buffer ([Note: a group of one] in grad_buckets.py)
            return
        rows = group.lp_flat.view(world_size, part_numel)
        # In place: this rank's row is its shard, no copy of it and no gather buffer beside the flat
        # one ([Note: gloo temporaries] in comm/comm.py: on gloo the staging holds one chunk).
        for offset, numel in allgather_chunks(part_numel, world_size, self.settings.allgather_bucket_size):
            comm.all_gather_rows_in_place(rows.narrow(1, offset, numel), group=group.process_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.groups:
            group.grads.zero_()
            if _separate(group.partition_grad, group.grads):
                group.partition_grad.zero_()   # stage 1 offload: the host buffer beside the flat one
            group.master.grad = None
            for param in group.params:
                param.grad = None
        self._release_views()   # the next window's first backward points the `.grad`s at the views again
        self._unreduced = False

    # --- introspection ----------------------------------------------------------------------
    @property
    def bit16_groups(self) -> list[list[torch.nn.Parameter]]:
        return [g.params for g in self.groups]

    def trainable_param_groups(self) -> list[list[torch.nn.Parameter]]:
        return self.bit16_groups

    def refresh_fp32_params(self) -> None:
        """The fp32 masters from the (just loaded) lp partitions, then every rank's flat buffer."""
        for index, group in enumerate(self.groups):
            self.placement.refresh_master(index, group.master, group.lp_partition)
        self._publish_params()

    @property
    def bit16_groups_flat(self) -> list[torch.Tensor]:
        return [g.lp_flat for g in self.groups]

    @property
    def single_partition_of_fp32_groups(self) -> list[torch.Tensor]:
        return [g.master for g in self.groups]

    @property
    def groups_padding(self) -> list[int]:
        return [g.padding for g in self.groups]

    def offloadable_state_tensors(self) -> StateTensors:
        """Every tensor object holding each state, views included ([Note: storage relocation] in
        state_offload.py); the stage-2 buckets' reused scratch ([Note: stage-2 scratch reuse] in
        grad_buckets.py) as the contiguous gradient buffer."""
        masters, optim_states = self.placement.held_state([g.master for g in self.groups])
        views = [v for g in self.groups if g.grad_views is not None for v in g.grad_views.views]   # the `.grad`s
        return {OffloadStateTypeEnum.lp_params: [t for g in self.groups for t in (g.lp_flat, g.lp_partition, *g.params)],
                OffloadStateTypeEnum.hp_params: masters,
                OffloadStateTypeEnum.lp_grads: [t for g in self.groups for t in (g.grads, g.partition_grad)] + views,
                OffloadStateTypeEnum.optim_states: optim_states,
                OffloadStateTypeEnum.contiguous_grad_buffer: [b for s in self._bucket_sets for b in s.scratch_buffers()]}

    def memory_breakdown(self) -> dict[str, int]:
        lp_storages = {g.lp_flat.untyped_storage().data_ptr() for g in self.groups}
        masters = [g.master for g in self.groups if g.master.untyped_storage().data_ptr() not in lp_storages]
        breakdown = {
            "lp_params": tensor_bytes(g.lp_flat for g in self.groups),
            "grads": tensor_bytes([t for g in self.groups for t in (g.grads, g.partition_grad)]),
            **self.placement.state_bytes(masters),
        }
        breakdown["total"] = sum(breakdown.values())
        return breakdown

    def destroy(self) -> None:
        self.remove_hooks()
