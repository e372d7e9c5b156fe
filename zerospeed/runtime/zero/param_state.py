"""The stage-3 parameter state machine and the typed per-parameter state.

[Note: parameter states]
A ZeRO-3 parameter is in one of three states (DeepSpeed's names and values):

    NOT_AVAILABLE --gather issued--> INFLIGHT --gather waited--> AVAILABLE --release--> NOT_AVAILABLE

- NOT_AVAILABLE: `param.data` is an empty tensor of shape [0]; only this rank's partition
  (`ds_tensor`, 1-D, `partition_numel()` elements) exists.
- INFLIGHT: an all-gather into a temporary buffer is outstanding; `param.data` is still empty.
- AVAILABLE: `param.data` holds the full tensor of shape `ds_shape`.

With `offload_param: nvme` the partition itself may live on disk (`zs_state.swapped`, see
offload/param_swapper.py): `ds_tensor` is then empty and a gather reads the bytes.

`set_status` is the only way to move between states and checks the transition is legal.
Partition math (per parameter, padded on its own as DeepSpeed's
`deepspeed/runtime/zero/partition_parameters.py::Init._partition_param` does): with
`W` ranks, `partition_numel = ceil(numel / W)`; rank r holds the flattened elements
`[r * partition_numel, (r + 1) * partition_numel)`; the tail past `numel` (on the last ranks only)
is padding, kept at zero here.

[Note: ds_* attributes]
User code, Hugging Face and DeepSpeed's own tools read `ds_id, ds_shape, ds_numel, ds_tensor,
ds_status, ds_persist, ...` directly off the parameter. They are derived from one
`ZeroParamState` object (`param.zs_state`) and written by `_write_ds_attributes` only. Methods
DeepSpeed binds as closures (`partition_numel()`, `all_gather()`, `partition()`, ...) are methods
of the `ZeroParameter` class the parameter is switched to; nothing is bound onto instances.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Any, Protocol, TypeGuard, cast

import torch

__all__ = [
    "ParamCollectives",
    "PartitionedParameter",
    "ZeroParamState",
    "ZeroParamStatus",
    "ZeroParamType",
    "ZeroParameter",
    "attach_state",
    "drop_data",
    "is_zero_param",
    "partition_numel",
    "rank_span",
    "set_partition",
    "set_persist",
    "set_status",
    "set_strict",
    "set_swapped",
    "zero_state",
]


class ZeroParamType(enum.Enum):
    NORMAL = 1
    PARTITIONED = 2
    REMOTE = 3


class ZeroParamStatus(enum.Enum):
    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


_LEGAL_TRANSITIONS: dict[ZeroParamStatus, frozenset[ZeroParamStatus]] = {
    ZeroParamStatus.NOT_AVAILABLE: frozenset({ZeroParamStatus.INFLIGHT}),
    ZeroParamStatus.INFLIGHT: frozenset({ZeroParamStatus.AVAILABLE}),
    ZeroParamStatus.AVAILABLE: frozenset({ZeroParamStatus.NOT_AVAILABLE}),
}


# the table above by member value: an Enum member's hash is a Python call, and every gather and
# release checks one transition per parameter
_LEGAL_NEXT_VALUES: dict[int, frozenset[int]] = {
    old._value_: frozenset(new._value_ for new in news) for old, news in _LEGAL_TRANSITIONS.items()}


class IllegalTransitionError(RuntimeError):
    """A parameter was asked to move between two states that are not adjacent."""


# --- partition arithmetic (pure) -----------------------------------------------------------------

def partition_numel(numel: int, world_size: int) -> int:
    """Elements each rank holds of a parameter of `numel` elements: ceil(numel / W)."""
    return -(-numel // world_size)


def rank_span(numel: int, world_size: int, dp_rank: int) -> tuple[int, int]:
    """(start, real_numel): where rank `dp_rank`'s partition starts in the flattened parameter and
    how many of its `partition_numel` elements are real (the rest is padding)."""
    size = partition_numel(numel, world_size)
    start = dp_rank * size
    return start, max(0, min(numel, start + size) - start)


# --- the typed state -------------------------------------------------------------------------------

class ParamCollectives(Protocol):
    """The gather and release primitives DeepSpeed's per-parameter methods (`param.all_gather()`,
    `param.partition()`) call. They are built on this module's class (param_gather.py), so they are
    handed to each parameter's state at conversion instead of imported here."""

    def gather(self, params: list[torch.nn.Parameter]) -> Any: ...

    def release(self, params: list[torch.nn.Parameter], has_been_updated: bool) -> None: ...


@dataclasses.dataclass(eq=False)
class ZeroParamState:
    ds_id: int
    shape: torch.Size
    numel: int
    world_size: int
    dp_rank: int
    group: Any
    partition: torch.Tensor              # this rank's 1-D partition (DeepSpeed's ds_tensor)
    name: str = ""
    persist: bool = False
    status: ZeroParamStatus = ZeroParamStatus.AVAILABLE
    active_sub_modules: set[int] = dataclasses.field(default_factory=set)
    strict: bool = False   # managed by an engine: compute on it while NOT_AVAILABLE raises
    swapped: Any = None    # a SwappedPartition when the partition lives on NVMe (`partition` is then empty)
    collectives: ParamCollectives | None = None   # what all_gather() / partition() call (param_gather.py)

    # computed once: `numel` and `world_size` never change, and gathers and gradient hooks ask often
    @functools.cached_property
    def partition_numel(self) -> int:
        return partition_numel(self.numel, self.world_size)

    @functools.cached_property
    def padded_numel(self) -> int:
        return self.partition_numel * self.world_size

    @property
    def real_partition_numel(self) -> int:
        return rank_span(self.numel, self.world_size, self.dp_rank)[1]

    def describe(self) -> str:
        return f"'{self.name or '?'}' (ds_id={self.ds_id}, shape={tuple(self.shape)})"


class ZeroParameter(torch.nn.Parameter):
    """The class a parameter takes once it is partitioned: DeepSpeed's per-parameter methods."""

    zs_state: ZeroParamState
    # DeepSpeed's attributes, derived from zs_state by `_write_ds_attributes` ([Note: ds_* attributes])
    ds_id: int
    ds_shape: torch.Size
    ds_numel: int
    ds_tensor: torch.Tensor
    ds_status: ZeroParamStatus
    ds_persist: bool
    ds_param_type: ZeroParamType
    ds_numel_aligned: int
    ds_active_sub_modules: set[int]
    ds_process_group: Any
    ds_zero_partition_rank: int
    ds_zero_partition_world_size: int
    ds_secondary_tensor: torch.Tensor | None

    def partition_numel(self) -> int:
        return self.zs_state.partition_numel

    def aligned_size(self) -> int:
        return self.zs_state.padded_numel

    def padding_size(self) -> int:
        return self.zs_state.padded_numel - self.zs_state.numel

    def ds_summary(self) -> dict[str, Any]:
        state = self.zs_state
        return {"id": state.ds_id, "status": state.status.name, "numel": state.numel,
                "ds_numel": state.numel, "shape": tuple(state.shape), "ds_shape": tuple(state.shape),
                "requires_grad": self.requires_grad, "grad_shape": None if self.grad is None else
                tuple(self.grad.shape), "persist": state.persist,
                "active_sub_modules": sorted(state.active_sub_modules)}

    def all_gather(self, param_list: list[torch.nn.Parameter] | None = None, async_op: bool = False) -> Any:
        handle = self._collectives().gather(param_list or [self])
        if not async_op:
            handle.wait()
        return handle

    def partition(self, param_list: list[torch.nn.Parameter] | None = None, has_been_updated: bool = False,
                  free_data: bool = True) -> None:
        self._collectives().release(param_list or [self], has_been_updated)

    def _collectives(self) -> ParamCollectives:
        collectives = self.zs_state.collectives
        if collectives is None:
            raise RuntimeError(f"parameter {self.zs_state.describe()} has no gather primitives: its state was "
                               "not made by convert_to_zero_param")
        return collectives

    def __reduce_ex__(self, protocol: Any) -> Any:  # pickled / deep-copied as a plain Parameter
        return torch.nn.Parameter(self.detach().clone(), self.requires_grad).__reduce_ex__(protocol)


# Tensor functions a partitioned parameter may see: metadata, attribute access, moves, hooks.
_METADATA_FUNCTIONS = frozenset(getattr(torch.Tensor, name) for name in (
    "__hash__", "__repr__", "__format__", "__reduce_ex__", "__deepcopy__", "__len__", "size", "dim",
    "numel", "element_size", "is_floating_point", "is_complex", "data_ptr", "untyped_storage", "detach",
    "requires_grad_", "register_hook", "register_post_accumulate_grad_hook", "to", "cpu", "cuda", "float",
    "half", "bfloat16", "double", "type", "storage_offset", "stride", "is_contiguous", "get_device",
    "_is_view"))


class PartitionedParameter(ZeroParameter):
    """The class of an engine-managed parameter while NOT_AVAILABLE or INFLIGHT: computing with it
    raises an error naming it, instead of silently using a [0]-shaped tensor (see [Note: ds_*
    attributes]). Metadata, attribute access and moves stay allowed."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _METADATA_FUNCTIONS or getattr(func, "__name__", "") in ("__get__", "__set__"):
            return torch._C._disabled_torch_function_impl(func, types, args, kwargs or {})
        state = next(a.zs_state for a in _flat_args(args, kwargs) if isinstance(a, PartitionedParameter))
        raise RuntimeError(
            f"ZeRO-3: parameter {state.describe()} is partitioned ({state.status.name}) and was used in "
            f"{getattr(func, '__name__', func)} outside the forward of a module that fetches it. Gather it "
            "with zero.GatheredParameters(...), or zero.register_external_parameter(module, param) when "
            "a module's forward uses it.")


def _flat_args(args: Any, kwargs: Any) -> list[Any]:
    flat: list[Any] = []
    for value in list(args) + list((kwargs or {}).values()):
        flat.extend(value if isinstance(value, (list, tuple)) else [value])
    return flat


def is_zero_param(value: Any) -> TypeGuard[ZeroParameter]:
    """Whether `value` is a ZeRO-3 parameter; a `TypeGuard`, so `value.zs_state` type-checks after it."""
    return isinstance(value, ZeroParameter)


def zero_state(param: torch.nn.Parameter) -> ZeroParamState:
    if not isinstance(param, ZeroParameter):
        raise TypeError("not a ZeRO-3 parameter (it has no ds_id): it was never partitioned")
    return param.zs_state


def attach_state(param: torch.nn.Parameter, state: ZeroParamState) -> ZeroParameter:
    """Make `param` a ZeRO-3 parameter carrying `state` (its class and ds_* attributes)."""
    param.__class__ = ZeroParameter
    zparam = cast(ZeroParameter, param)
    zparam.zs_state = state
    _write_ds_attributes(zparam)
    return zparam


def set_status(param: ZeroParameter, status: ZeroParamStatus) -> None:
    """The one place a parameter's state changes; illegal transitions raise."""
    state = param.zs_state
    if status._value_ not in _LEGAL_NEXT_VALUES[state.status._value_]:
        raise IllegalTransitionError(f"parameter {state.describe()}: illegal transition "
                                     f"{state.status.name} -> {status.name}")
    state.status = status
    _write_ds_attributes(param, status_only=True)


def drop_data(param: ZeroParameter) -> None:
    """-> NOT_AVAILABLE: the full data dropped, an empty tensor of the partition's dtype and device left."""
    partition = param.zs_state.partition
    param.data = torch.empty(0, dtype=partition.dtype, device=partition.device)
    set_status(param, ZeroParamStatus.NOT_AVAILABLE)


def set_persist(param: ZeroParameter, persist: bool) -> None:
    param.zs_state.persist = persist
    _write_ds_attributes(param)


def set_partition(param: ZeroParameter, partition: torch.Tensor) -> None:
    """Point the parameter at a new partition tensor (a view into a flat buffer, another dtype)."""
    state = param.zs_state
    if partition.shape != (state.partition_numel,):
        raise ValueError(f"partition of {state.describe()} must have {state.partition_numel} elements, "
                         f"got {tuple(partition.shape)}")
    state.partition = partition
    _write_ds_attributes(param)


def set_swapped(param: ZeroParameter, swapped: Any) -> None:
    """The partition now lives on NVMe (`swapped`, a SwappedPartition): the resident one is dropped
    and `ds_tensor` becomes an empty stand-in of the same dtype and device."""
    state = param.zs_state
    state.swapped = swapped
    state.partition = torch.empty(0, dtype=state.partition.dtype, device=state.partition.device)
    _write_ds_attributes(param)


def set_strict(param: ZeroParameter) -> None:
    param.zs_state.strict = True
    _write_ds_attributes(param)


def _write_ds_attributes(param: ZeroParameter, status_only: bool = False) -> None:
    """[Note: ds_* attributes] — the only writer of the DeepSpeed-visible attributes (and class).
    `status_only`: after a state transition, which changes the class and `ds_status` alone."""
    state = param.zs_state
    guarded = state.strict and state.status is not ZeroParamStatus.AVAILABLE
    param.__class__ = PartitionedParameter if guarded else ZeroParameter
    param.ds_status = state.status
    if status_only:
        return
    param.ds_id = state.ds_id
    param.ds_shape = state.shape
    param.ds_numel = state.numel
    param.ds_tensor = state.partition
    param.ds_persist = state.persist
    param.ds_param_type = ZeroParamType.PARTITIONED
    param.ds_numel_aligned = state.padded_numel
    param.ds_active_sub_modules = state.active_sub_modules
    param.ds_process_group = state.group
    param.ds_zero_partition_rank = state.dp_rank
    param.ds_zero_partition_world_size = state.world_size
    param.ds_secondary_tensor = None
    state.partition.ds_numel = state.partition_numel  # type: ignore[attr-defined]
    state.partition.status = None  # type: ignore[attr-defined]
    state.partition.final_location = "nvme" if state.swapped is not None else None  # type: ignore[attr-defined]
