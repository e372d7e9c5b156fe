"""`engine.offload_states()` / `engine.reload_states()`: a ZeRO engine's training state off the device and back.

ZeRO stages 0 to 3. RL loops (OpenRLHF, ROLL, SkyRL: DeepSpeed PR#6011, PR#7421) free the accelerator for a generation
engine between training steps: `offload_states` moves the chosen states (`OffloadStateTypeEnum`)
to host memory, `reload_states` brings them back, and training continues as if nothing happened.

[Note: storage relocation]
A state is many tensor objects over a few storages: a flat buffer, the parameters' `.data` views
into it, this rank's partition view, the fp32 master (at fp32 a view of the same buffer), the
gradient buckets' views, the base optimizer's state keyed by the master. Rebuilding each view
after a move (DeepSpeed's way) must know every one of them. Here the unit moved is the storage:
- The ZeRO wrapper lists, per state type, the tensor objects it and the model hold
  (`offloadable_state_tensors()`; views and aliases included).
- Offload groups the listed tensors of the included types by storage. Each such storage is copied
  once into a new host storage (pinned when an accelerator is present), every listed tensor on it
  (whatever its type) is re-pointed at the host copy with its own offset, size and stride
  (`tensor.data = ...`, so object identity, optimizer state keys and `requires_grad` survive),
  and the device storage is resized to zero bytes: its memory is freed at once even if some view
  nobody listed still refers to it.
- Reload resizes that same device storage back, copies the bytes in, and re-points the listed
  tensors at it. Any unlisted view of it is therefore valid again too, and sees the same bytes:
  the next step is the step that would have run without the round trip, bit for bit.
Two types that share a storage move together: at fp32 the master *is* the lp partition, so
offloading `hp_params` also moves the parameters (the same bytes). `contiguous_grad_buffer` is
reduction scratch rebuilt every backward: it is freed without a copy and reallocated on reload.
On a CPU-only host the "device" is host memory too: the states still move to fresh storages and
the old ones are freed (useful for tests; no memory is saved).

While `lp_params` are offloaded a forward pass is refused (a pre-forward hook on the module), as
is a forward with gradients enabled while `lp_grads` / `contiguous_grad_buffer` are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, Protocol

import torch

from zerospeed.accelerator import get_accelerator
from zerospeed.runtime.zero.offload.config import OffloadDeviceEnum, OffloadStateTypeEnum
from zerospeed.utils.logging import logger

__all__ = ["OffloadStateTypeEnum", "OffloadDeviceEnum", "StateTensors", "StatesOffloader", "refine_include"]

StateTensors = dict[OffloadStateTypeEnum, list[torch.Tensor]]

NO_OPTIMIZER = "Moving states across devices is not supported without an optimizer."
PARAM_OFFLOAD = ("Moving states across devices is not supported for offloaded parameters "
                 "(zero_optimization.offload_param is set).")
NVME = "NVMe offload is not supported for offloading states."
# Contents need not survive a round trip (rebuilt every backward).
_SCRATCH = frozenset({OffloadStateTypeEnum.contiguous_grad_buffer})
_NEEDED_BY_FORWARD = frozenset({OffloadStateTypeEnum.lp_params})
_NEEDED_BY_BACKWARD = frozenset({OffloadStateTypeEnum.lp_grads, OffloadStateTypeEnum.contiguous_grad_buffer})


class ListsStateTensors(Protocol):
    def offloadable_state_tensors(self) -> StateTensors: ...


@dataclasses.dataclass
class _MovedStorage:
    """One device storage while its bytes live in `host` ([Note: storage relocation])."""

    device_storage: torch.UntypedStorage
    nbytes: int
    host: torch.UntypedStorage | None      # None: scratch, not copied
    views: list[tuple[torch.Tensor, int, torch.Size, tuple[int, ...]]]   # tensor, offset, size, stride


def _state_type(value: Any) -> OffloadStateTypeEnum:
    try:
        return OffloadStateTypeEnum(value)
    except ValueError:
        names = ", ".join(t.value for t in OffloadStateTypeEnum)
        raise ValueError(f"offload_states(include=...): unknown state {value!r}; expected some of {names}") from None


def refine_include(include: Iterable[Any] | None, cpu_optimizer: bool,
                   partitioned_params: bool) -> set[OffloadStateTypeEnum]:
    """The states to move: all by default; those ZeRO-Offload already keeps on the host left out
    (DeepSpeed's rule: masters and optimizer state, and at stage 3 the gradients too)."""
    states = set(OffloadStateTypeEnum) if include is None else {_state_type(x) for x in include}
    if cpu_optimizer:
        states -= {OffloadStateTypeEnum.hp_params, OffloadStateTypeEnum.optim_states}
        if partitioned_params:
            states.discard(OffloadStateTypeEnum.lp_grads)
    return states


def _device_of(device: Any) -> OffloadDeviceEnum:
    try:
        return OffloadDeviceEnum(device)
    except ValueError:
        raise ValueError(f"offload_states(device={device!r}): only OffloadDeviceEnum.cpu is supported") from None


def _view_on(storage: torch.UntypedStorage, tensor: torch.Tensor, offset: int, size: torch.Size,
             stride: tuple[int, ...]) -> torch.Tensor:
    return torch.empty(0, dtype=tensor.dtype, device=storage.device).set_(storage, offset, size, stride)


class StatesOffloader:
    """Which states of one engine are offloaded, and where their bytes are meanwhile."""

    def __init__(self) -> None:
        self.offloaded_states: set[OffloadStateTypeEnum] = set()   # DeepSpeed's attribute name
        self._moved: list[_MovedStorage] = []
        self._guard: Any = None

    def offload(self, wrapper: ListsStateTensors, module: torch.nn.Module, include: set[OffloadStateTypeEnum],
                device: Any, pin_memory: bool, non_blocking: bool) -> None:
        target = _device_of(device)
        if target is OffloadDeviceEnum.none:
            logger.warning("No device specified for offloading states.")
            return
        if target is OffloadDeviceEnum.nvme:
            raise ValueError(NVME)
        todo = include - self.offloaded_states
        if not todo:
            return
        listed = wrapper.offloadable_state_tensors()
        accelerator = get_accelerator()
        pin = pin_memory and accelerator.is_available() and accelerator.device_name() != "cpu"
        skip = {_storage_key(m.host) for m in self._moved if m.host is not None}
        for views in _group_by_storage(listed, todo, skip, torch.device(accelerator.current_device_name()).type):
            self._moved.append(_move_out(views, _is_scratch(views, listed), pin, non_blocking))
        self.offloaded_states |= todo
        if not non_blocking:
            accelerator.synchronize()
        self._install_guard(module)
        accelerator.empty_cache()   # the freed blocks back to the device (a generation engine needs them)

    def reload(self, non_blocking: bool) -> None:
        for moved in self._moved:
            _move_in(moved, non_blocking)
        if non_blocking:   # the host copies are dropped below: the transfers must have landed
            get_accelerator().synchronize()
        self._moved = []
        self.offloaded_states = set()
        if self._guard is not None:
            self._guard.remove()
            self._guard = None

    def _install_guard(self, module: torch.nn.Module) -> None:
        if self._guard is None:
            self._guard = module.register_forward_pre_hook(self._refuse_forward, prepend=True)

    def _refuse_forward(self, module: torch.nn.Module, args: Any) -> None:
        blocking = self.offloaded_states & _NEEDED_BY_FORWARD
        if torch.is_grad_enabled():
            blocking |= self.offloaded_states & _NEEDED_BY_BACKWARD
        if blocking:
            names = ", ".join(sorted(s.value for s in blocking))
            raise RuntimeError(f"forward while states are offloaded ({names}): call engine.reload_states() first")


def _storage_key(value: torch.Tensor | torch.UntypedStorage) -> tuple[str, int]:
    storage = value.untyped_storage() if isinstance(value, torch.Tensor) else value
    return str(storage.device), storage.data_ptr()


def _group_by_storage(listed: StateTensors, todo: set[OffloadStateTypeEnum], skip: set[tuple[str, int]],
                      device_type: str) -> list[list[torch.Tensor]]:
    """Every listed tensor on a storage that a tensor of a `todo` type lives on, grouped by storage.
    Skipped: storages with no bytes (released, or scratch already offloaded), host copies of an
    earlier offload (`skip`), and storages off the accelerator (ZeRO-Offload's host buffers, Adam's
    step counters on a GPU host)."""
    def movable(tensor: torch.Tensor) -> bool:
        storage = tensor.untyped_storage()
        return (storage.nbytes() > 0 and storage.device.type == device_type
                and _storage_key(storage) not in skip)

    wanted = {_storage_key(t) for kind in todo for t in listed.get(kind, []) if movable(t)}
    groups: dict[tuple[str, int], dict[int, torch.Tensor]] = {}
    for tensors in listed.values():
        for tensor in tensors:
            key = _storage_key(tensor)
            if key in wanted:
                groups.setdefault(key, {})[id(tensor)] = tensor
    return [list(views.values()) for views in groups.values()]


def _is_scratch(views: list[torch.Tensor], listed: StateTensors) -> bool:
    """Whether every listed tensor on this storage is scratch (its bytes need no copy)."""
    ids = {id(t) for t in views}
    kinds = {kind for kind, tensors in listed.items() if any(id(t) in ids for t in tensors)}
    return kinds <= _SCRATCH


@torch.no_grad()
def _move_out(views: list[torch.Tensor], scratch: bool, pin: bool, non_blocking: bool) -> _MovedStorage:
    storage = views[0].untyped_storage()
    nbytes = storage.nbytes()
    geometry = [(t, int(t.storage_offset()), t.size(), tuple(t.stride())) for t in views]
    host = None
    if not scratch:
        host = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=pin).untyped_storage()
        host.copy_(storage, non_blocking=non_blocking)
        for tensor, offset, size, stride in geometry:
            tensor.data = _view_on(host, tensor, offset, size, stride)
    # Freed now, whoever else still refers to it ([Note: storage relocation]); a pending
    # non-blocking copy out of it is ordered before any reuse on its stream by the allocator.
    storage.resize_(0)
    return _MovedStorage(storage, nbytes, host, geometry)


@torch.no_grad()
def _move_in(moved: _MovedStorage, non_blocking: bool) -> None:
    moved.device_storage.resize_(moved.nbytes)
    if moved.host is not None:
        moved.device_storage.copy_(moved.host, non_blocking=non_blocking)
    for tensor, offset, size, stride in moved.views:
        tensor.data = _view_on(moved.device_storage, tensor, offset, size, stride)
