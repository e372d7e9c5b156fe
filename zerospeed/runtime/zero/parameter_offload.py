"""Module hooks that drive the coordinator (DeepSpeed's
`deepspeed/runtime/zero/parameter_offload.py::DeepSpeedZeRoOffload`).

[Note: hooks and autograd]
Every module (z3-leaf modules as a whole, their children untouched) gets four hooks:
- forward pre-hook: fetch the module's parameters (its own and its external ones); the root's
  pre-hook first calls `coordinator.reset_step()`;
- forward post-hook: release them; and, when grad is on, route the outputs through `_BackwardHook`,
  an identity autograd function whose backward fetches the parameters again before the module's
  own backward runs;
- the pre-hook also routes the inputs that require grad through `_BackwardHook`, whose backward
  counts them down and releases the parameters when the module's backward is done. A module
  whose inputs need no grad (an embedding) is released at the end of backward, by `release_all`.

[Note: reads of a partitioned parameter]
`module._parameters` is replaced by `_ZeroParamDict`. Reading a parameter that is not gathered
while some module's forward is running gathers it and registers it as an external parameter of
the running module, so it is fetched with that module from then on (a tied LM head reading the
embedding). Outside any forward the read returns the partitioned parameter (`shape == [0]`); a
gradient that arrives for it with the wrong shape raises an error naming the module and parameter.

[Note: compiled blocks]
`engine.compile()` at stage 3 compiles each transformer block's `forward` on its own and makes the
block a fetch unit (`set_fetch_units`): like a z3 leaf, the block's hooks fetch and release its
whole subtree, and its descendants get no hooks and plain `_parameters` dicts. The hooks then run
in the block's `__call__`, eagerly, around the compiled `forward`: no gather, release or autograd
hook is traced, so dynamo sees a block without a graph break, and every collective stays on the
eager side, in the same order on every rank whatever the graphs each rank compiled (no hang when
ranks see different sequence lengths). Unlike a z3 leaf, a unit's gradients are reduced as they
arrive (not deferred): the backward hook releases the block after its compiled backward returned.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, cast

import torch

from zerospeed.comm.run_groups import RunGroups
from zerospeed.runtime.zero.param_state import (
    ZeroParameter,
    ZeroParamStatus,
    is_zero_param,
    set_persist,
    set_strict,
)
from zerospeed.runtime.zero.partition_parameters import (
    compute_device,
    convert_to_zero_param,
    gather_params,
    register_external_parameter,
    release_params,
)
from zerospeed.runtime.zero.gather_order_check import GatherOrderCheck
from zerospeed.runtime.zero.offload_client_hooks import OffloadClientHooks
from zerospeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
from zerospeed.utils.z3_leaf_module import (apply_zero_leaf_module_config, get_z3_leaf_modules, set_z3_leaf_modules,
                                            unset_z3_leaf_modules, z3_leaf_module)

__all__ = ["DeepSpeedZeRoOffload", "check_partition_group", "partition_group", "get_z3_leaf_modules", "set_z3_leaf_modules", "unset_z3_leaf_modules",
           "z3_leaf_module"]


def partition_group(param: torch.nn.Parameter, dp_group: Any, run_groups: RunGroups | None = None) -> Any:
    """[Note: MoE at stage 3] An expert parameter (`allreduce=False`, `group_name`) is partitioned over
    its expert-data-parallel group: the ranks that hold the same experts (from the run's groups,
    [Note: run groups] in comm/run_groups.py). Every other parameter over the data-parallel group."""
    if getattr(param, "allreduce", True) is False and hasattr(param, "group_name"):
        from zerospeed.comm import groups

        return groups.expert_groups(param.group_name, run_groups).expert_data_parallel.group
    return dp_group


def check_partition_group(param: torch.nn.Parameter, dp_group: Any, name: str,
                          run_groups: RunGroups | None = None) -> None:
    """A parameter partitioned by zero.Init (over the data-parallel group, before any expert group
    existed) cannot serve as an expert parameter."""
    wanted = partition_group(param, dp_group, run_groups)
    # (the MoE layer deep-copies its expert: under zero.Init the copies even lose their ZeRO state)
    if wanted is not dp_group and getattr(getattr(param, "zs_state", None), "group", None) is not wanted:
        raise ValueError(f"ZeRO-3: expert parameter {name!r} ({param.group_name}) was partitioned by "  # type: ignore[attr-defined]
                         "zero.Init over the data-parallel group; build MoE models outside zero.Init "
                         "(the engine partitions expert parameters over their expert-data-parallel group)")


class _ZeroParamDict(dict):
    """`module._parameters` at stage 3: see [Note: reads of a partitioned parameter]."""

    offload: DeepSpeedZeRoOffload

    def __getitem__(self, name: str) -> Any:
        param = super().__getitem__(name)
        if is_zero_param(param) and param.zs_state.status is not ZeroParamStatus.AVAILABLE:
            self.offload.on_read_outside_module(param)
        return param


class _BackwardHook(torch.autograd.Function):
    """Identity on `tensors` whose backward first calls `on_backward()`: how a module learns that
    backward reached its outputs (pre-backward: gather) or its inputs (post-backward: release)."""

    @staticmethod
    def forward(ctx: Any, on_backward: Callable[[], None], *tensors: torch.Tensor) -> Any:
        ctx.on_backward = on_backward
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        ctx.on_backward()
        return (None, *grads)


# `Function.apply` below its Python preamble: that binds default arguments for a `setup_context`
# (`_BackwardHook` has none) and maps the arguments to unwrap dead functorch wrappers (a no-op on
# every other tensor); ~100 calls a step made it a visible share of the hooks' cost (issue 33)
_apply_function = super(torch.autograd.Function, _BackwardHook).apply


def _backward_hook(on_backward: Callable[[], None], *tensors: torch.Tensor) -> Any:
    """`_BackwardHook.apply(on_backward, *tensors)`."""
    if torch._C._are_functorch_transforms_active():
        return _BackwardHook.apply(on_backward, *tensors)
    return _apply_function(on_backward, *tensors)


class DeepSpeedZeRoOffload(OffloadClientHooks):
    """Partitions a module's parameters (if not done by zero.Init) and hooks it to the coordinator."""

    def __init__(self, module: torch.nn.Module, zero_config: Any, dp_group: Any,
                 param_names: dict[torch.nn.Parameter, str] | None = None,
                 param_dtype: torch.dtype | None = None, run_groups: RunGroups | None = None) -> None:
        self.module = module
        self.dp_group = dp_group
        self.run_groups = run_groups
        names = param_names or {}
        self._convert(module, names, param_dtype)
        # _convert made every parameter a ZeroParameter
        self.params = cast(list[ZeroParameter], list({id(p): p for p in module.parameters()}.values()))
        self._mark_persistent(zero_config.param_persistence_threshold, zero_config.model_persistence_threshold)
        self.coordinator = PartitionedParameterCoordinator(
            prefetch_bucket_size=1 if zero_config.allgather_sequential else zero_config.prefetch_bucket_size,
            max_live_parameters=zero_config.max_live_parameters,
            max_reuse_distance=zero_config.max_reuse_distance, all_params=self.params)
        self._module_ids: dict[int, int] = {}
        self._module_names: dict[int, str] = {}   # module id -> "qualified.name (Class)", for errors
        self._fwd_stack: list[torch.nn.Module] = []
        self._grads_remaining: dict[int, int] = {}
        self._handles: list[Any] = []
        self._hooks_of: dict[int, _ModuleHooks] = {}   # module id -> what its hooks fetch and call
        self._unit_ids: set[int] = set()   # [Note: compiled blocks]
        # DeepSpeed's leaf_module config, and the MoE blocks zerospeed finds ([Note: ZeRO-3 leaf modules])
        apply_zero_leaf_module_config(module, zero_config.leaf_module)
        self._register_deepspeed_module(module)  # also gives modules ds_external_parameters()
        self.leaf_param_ids = {p.zs_state.ds_id for m in get_z3_leaf_modules(module)
                               for p in m.parameters() if is_zero_param(p)}
        if zero_config.check_module_order or zero_config.enable_sanity_checks:   # [Note: gather-order check]
            self.coordinator.order_check = GatherOrderCheck(
                dp_group, lambda module_id: self._module_names.get(module_id, "(outside any module)"),
                compute_device(), every_gather=zero_config.enable_sanity_checks)
        for param in self.params:
            set_strict(param)

    # --- setup --------------------------------------------------------------------------------
    def _convert(self, module: torch.nn.Module, names: dict[torch.nn.Parameter, str],
                 param_dtype: torch.dtype | None) -> None:
        for name, param in module.named_parameters(remove_duplicate=True):
            if not is_zero_param(param):
                if param_dtype is not None and param.is_floating_point():
                    param.data = param.data.to(param_dtype)
                # The engine broadcast the unpartitioned params from rank 0 already.
                convert_to_zero_param(param, partition_group(param, self.dp_group, self.run_groups),
                                      name=names.get(param, name),
                                      broadcast=False)
            else:  # built under zero.Init: the model-level name replaces the class-level one
                check_partition_group(param, self.dp_group, names.get(param, name), self.run_groups)
                param.zs_state.name = names.get(param, name)

    def _mark_persistent(self, threshold: int, model_threshold: int) -> None:
        total = 0
        for param in sorted(self.params, key=lambda p: p.zs_state.ds_id):
            state = param.zs_state
            persist = state.numel <= threshold and total + state.numel <= model_threshold
            total += state.numel if persist else 0
            set_persist(param, persist)
        # Applied here, at initialize, as DeepSpeed does; zero.Init partitioned every parameter.
        gather_params([p for p in self.params if p.zs_state.persist]).wait()
        # Persisted at Init but not under this config: drop the full data.
        release_params([p for p in self.params if not p.zs_state.persist])

    def set_fetch_units(self, units: list[torch.nn.Module]) -> None:
        """Make each of `units` fetched and released as a whole, its descendants unhooked
        ([Note: compiled blocks]); the hooks are reinstalled and the prefetch trace recorded anew."""
        self._unit_ids |= {id(unit) for unit in units}
        for unit in units:
            for sub in unit.modules():
                if isinstance(sub._parameters, _ZeroParamDict):
                    sub._parameters = dict(sub._parameters)
        self.remove_hooks()
        self._module_ids.clear()
        self._module_names.clear()
        self._hooks_of.clear()
        self._install_hooks(self.module)
        self.coordinator._invalidate_trace()   # the quiet one: the module ids changed, not the order

    def _is_unit(self, module: torch.nn.Module) -> bool:
        """Fetched as a whole: a z3 leaf or a compiled block."""
        return _marked_leaf(module) or id(module) in self._unit_ids

    def _install_hooks(self, root: torch.nn.Module) -> None:
        counter = 0
        pending = [root]
        names = {id(m): name for name, m in root.named_modules()}
        while pending:  # pre-order; z3 leaves are not recursed into
            module = pending.pop(0)
            self._module_ids[id(module)] = counter
            self._module_names[counter] = f"{names.get(id(module)) or '(root)'} ({type(module).__name__})"
            counter += 1
            module.__dict__["ds_id"] = self._module_ids[id(module)]
            self._hooks_of[id(module)] = _ModuleHooks(self, module, self._module_ids[id(module)])
            if not isinstance(module._parameters, _ZeroParamDict) and id(module) not in self._unit_ids:
                replaced = _ZeroParamDict(module._parameters)
                replaced.offload = self
                module._parameters = replaced
            self._handles.append(module.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post_forward))
            if not self._is_unit(module):
                pending = list(module.children()) + pending
        self._handles.append(root.register_forward_pre_hook(self._root_pre_forward, prepend=True))

    def _params_of(self, module: torch.nn.Module) -> tuple[ZeroParameter, ...]:
        """What the module's hooks fetch and release: its own parameters (a z3 leaf's, its whole
        subtree's) and its external ones. Four hooks per module per step ask, and collecting them
        through `module.parameters()` was the hooks' largest Python cost, so a module's answer is
        kept (in its `_ModuleHooks`) while its own and external parameters are the same objects."""
        return self._hooks_of[id(module)].params()

    # --- hooks --------------------------------------------------------------------------------
    def _root_pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        self.coordinator.reset_step()

    def _pre_forward(self, module: torch.nn.Module, args: Any, kwargs: Any) -> Any:
        self._fwd_stack.append(module)
        hooks = self._hooks_of[id(module)]
        params = hooks.params()
        if not params:
            return None
        self.coordinator.fetch_sub_module(hooks.module_id, params, forward=True)
        if not torch.is_grad_enabled():
            return None
        return self._wrap_inputs(hooks, args, kwargs)

    def _post_forward(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        self._fwd_stack.pop()
        hooks = self._hooks_of[id(module)]
        params = hooks.params()
        if not params:
            return None
        self.coordinator.release_sub_module(hooks.module_id, params)
        if not torch.is_grad_enabled():
            return None
        return _map_tensors(output, hooks.wrap_outputs)

    def _wrap_inputs(self, hooks: _ModuleHooks, args: Any, kwargs: Any) -> Any:
        if not kwargs and type(args) is tuple and not any(isinstance(a, _CONTAINERS) for a in args):
            return self._wrap_flat_inputs(hooks, args)
        grad_tensors = [t for t in _tensors(args) + _tensors(kwargs) if t.requires_grad]
        self._grads_remaining[id(hooks.module)] = len(grad_tensors)
        if not grad_tensors:
            return None
        return _map_tensors(args, hooks.wrap_inputs), _map_tensors(kwargs, hooks.wrap_inputs)

    def _wrap_flat_inputs(self, hooks: _ModuleHooks, args: tuple[Any, ...]) -> Any:
        """`_wrap_inputs` for the usual call, positional tensors and scalars: one pass, the same result
        (nested inputs are counted but not wrapped, by the general path above)."""
        count = 0
        items = list(args)
        for index, value in enumerate(items):
            if isinstance(value, torch.Tensor) and value.requires_grad:
                count += 1
                if value.is_floating_point():
                    items[index] = _backward_hook(hooks.on_post_backward, value)[0]
        self._grads_remaining[id(hooks.module)] = count
        return (tuple(items), {}) if count else None

    def pre_backward(self, module: torch.nn.Module) -> None:
        hooks = self._hooks_of[id(module)]
        self.coordinator.fetch_sub_module(hooks.module_id, hooks.params(), forward=False)

    def post_backward(self, module: torch.nn.Module) -> None:
        remaining = self._grads_remaining.get(id(module), 0) - 1
        self._grads_remaining[id(module)] = remaining
        if remaining == 0:
            hooks = self._hooks_of[id(module)]
            self.coordinator.release_sub_module(hooks.module_id, hooks.params())

    def on_read_outside_module(self, param: ZeroParameter) -> None:
        if not self._fwd_stack:
            return
        borrower = self._fwd_stack[-1]
        register_external_parameter(borrower, param)
        self.coordinator.fetch_now(param, self._module_ids[id(borrower)])
        param.zs_state.active_sub_modules.add(self._module_ids[id(borrower)])

    def check_module_order(self) -> None:
        """End of a backward: raise `ModuleOrderError` if the ranks gathered different parameters in it
        ([Note: gather-order check]). Every rank calls it once per backward."""
        if self.coordinator.order_check is not None:
            self.coordinator.order_check.end_backward()

    def partition_all_parameters(self) -> None:
        self._fwd_stack.clear()
        self._grads_remaining.clear()
        self.coordinator.release_all()

    def refresh_persistent_parameters(self) -> None:
        """After a step the partitions changed: re-gather the parameters kept whole."""
        from zerospeed.runtime.zero.param_conversion import drop_data

        persistent = [p for p in self.params if p.zs_state.persist]
        for param in persistent:
            if param.zs_state.status is ZeroParamStatus.AVAILABLE:
                drop_data(param)
        gather_params(persistent).wait()

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class _ModuleHooks:
    """One hooked module: its id, what its hooks fetch and release (kept while its own and external
    parameters are the same objects) and the callbacks its autograd hooks call, made once at install
    instead of a closure per call."""

    __slots__ = ("offload", "module", "module_id", "_key", "_params")

    def __init__(self, offload: DeepSpeedZeRoOffload, module: torch.nn.Module, module_id: int) -> None:
        self.offload, self.module, self.module_id = offload, module, module_id
        self._key: tuple[Any, ...] | None = None
        self._params: tuple[ZeroParameter, ...] = ()

    def params(self) -> tuple[ZeroParameter, ...]:
        module = self.module
        external = module.__dict__.get("_zs_external_params")   # partition_parameters.external_parameters
        leaf = module.__dict__.get("_z3_leaf")   # _is_unit, inline: four calls a module a step
        if (getattr(type(module), "_z3_leaf", False) if leaf is None else leaf) or \
                id(module) in self.offload._unit_ids:   # a subtree: not cached
            return _unique_zero_params([*module.parameters(), *(external.values() if external else ())])
        key = (*module._parameters.values(), None, *external.values()) if external else \
            (*module._parameters.values(), None)
        cached = self._key
        if cached is None or len(cached) != len(key) or not all(map(operator.is_, cached, key)):
            own = module._parameters.values()
            self._key, self._params = key, _unique_zero_params([*own, *(external.values() if external else ())])
        return self._params

    def on_pre_backward(self) -> None:
        self.offload.pre_backward(self.module)

    def on_post_backward(self) -> None:
        self.offload.post_backward(self.module)

    def wrap_outputs(self, tensors: tuple[torch.Tensor, ...]) -> Any:
        return _backward_hook(self.on_pre_backward, *tensors)

    def wrap_inputs(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Routes the tensors that require grad of one call through one `_BackwardHook` each."""
        on_backward = self.on_post_backward
        return tuple(_backward_hook(on_backward, t)[0] if t.requires_grad else t for t in tensors)


_CONTAINERS = (list, tuple, dict)


def _marked_leaf(module: torch.nn.Module) -> bool:
    """`z3_leaf_module(module)` without nn.Module's `__getattr__`, a Python call that raises for every
    unmarked module, several times a step: the flag is in the instance dict (`set_z3_leaf_module`)
    or, set by hand, on the class."""
    flag = module.__dict__.get("_z3_leaf")
    return bool(getattr(type(module), "_z3_leaf", False) if flag is None else flag)


def _unique_zero_params(params: list[Any]) -> tuple[ZeroParameter, ...]:
    return tuple({id(p): p for p in params if is_zero_param(p)}.values())


def _tensors(value: Any) -> list[torch.Tensor]:
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _map_tensors(value: Any, fn: Any) -> Any:
    """Apply `fn` to the floating tensors of `value` (top-level tensor / tuple / list / dict)."""
    if torch.is_tensor(value):
        return fn((value,))[0] if value.is_floating_point() else value
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        items = list(value)
        index = [i for i, v in enumerate(items) if torch.is_tensor(v) and v.is_floating_point()]
        if not index:
            return value
        mapped = fn(tuple(items[i] for i in index))
        for i, new in zip(index, mapped):
            items[i] = new
        return type(value)(items)
    if isinstance(value, dict):
        keys = [k for k, v in value.items() if torch.is_tensor(v) and v.is_floating_point()]
        if keys:
            mapped = fn(tuple(value[k] for k in keys))
            for key, new in zip(keys, mapped):
                value[key] = new
        return value
    return value
