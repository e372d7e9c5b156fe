"""`zero.Init`: build a model already partitioned (DeepSpeed's `partition_parameters.Init`).

While the context is active every `nn.Module` subclass's `__init__` is wrapped; when the outermost
`__init__` of a module object returns, its direct parameters are broadcast from rank 0 of the
group and partitioned. A module's parameters therefore exist whole only while that module is being
constructed: no rank ever holds the full model.

Every parameter is partitioned, whatever its size (DeepSpeed does the same: its placeholder
`param.data` has 0 elements). The stage-3 persistence threshold is *not* applied here: the engine
applies it at `initialize` (`DeepSpeedZeRoOffload._mark_persistent`), as DeepSpeed's
`DeepSpeedZeRoOffload.mark_persistent_parameters` does; until then `ds_persist` is False (as in
DeepSpeed for a model built before any engine exists, checked side by side in tests/compat).

A config (dict, path, or `DeepSpeedConfig`) may still hold Hugging Face's ``"auto"`` values:
transformers calls `zero.Init` before it fills the hidden-size-dependent ones. Only the sections
zero.Init reads are used (``zero_optimization``, ``fp16``/``bf16``); the batch triangle is not
resolved here, so ``"auto"`` batch sizes are fine too (DeepSpeed fails on those with a TypeError).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any, Self

import torch

from zerospeed import comm
from zerospeed.runtime.config_utils import warn_config
from zerospeed.runtime.zero.param_conversion import convert_to_zero_param
from zerospeed.runtime.zero.param_state import is_zero_param

__all__ = ["Init"]

# Arguments DeepSpeed's Init accepts that zerospeed does not act on: name -> the value that is a no-op.
_IGNORED_DEFAULTS: dict[str, Any] = {
    "mem_efficient_linear": True, "pin_memory": False, "zero_param_parallel_group": None,
    "zero_quantized_weights": False, "zero_quantized_nontrainable_weights": False, "param_swapper": None,
    "tensor_overrides": None,
}
_IGNORED_WHY = {
    "mem_efficient_linear": "torch's F.linear is used as is",
    "pin_memory": "partitions are not page-locked",
    "zero_param_parallel_group": "ZeRO++ hpZ is not implemented",
    "zero_quantized_weights": "ZeRO++ qwZ is not implemented",
    "zero_quantized_nontrainable_weights": "quantized frozen weights are not implemented",
    "param_swapper": "the engine builds its own parameter swapper",
    "tensor_overrides": "dtype and device are set by dtype= / remote_device= only",
    "remote_device": "partitions are built in host memory, not on NVMe; they move to NVMe at initialize when "
                     "the engine's zero_optimization.offload_param.device is nvme",
}
_warned: set[str] = set()


def _warn_ignored(options: dict[str, Any]) -> None:
    """One warning per process for each accepted-but-ignored option set to a value that matters."""
    for name, value in options.items():
        default = _IGNORED_DEFAULTS.get(name, None)
        if name in _warned or value is default or value == default:
            continue
        _warned.add(name)
        why = _IGNORED_WHY.get(name, "zerospeed does not implement it")
        warn_config(f"zero.Init: argument {name}={value!r} is accepted but ignored ({why})")


def _all_module_classes() -> Iterator[type]:
    seen: set[type] = set()
    pending = [torch.nn.Module]
    while pending:
        cls = pending.pop()
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.add(sub)
                pending.append(sub)
                yield sub


class Init:
    """`with zero.Init(): model = Model()` builds `model` already partitioned.

    `module=` partitions an existing model. `peak_full_numel` records the most full-parameter
    elements alive at any post-init point (tests).
    """

    def __init__(self, module: torch.nn.Module | None = None, data_parallel_group: Any = None,
                 mem_efficient_linear: bool = True, remote_device: Any = None, pin_memory: bool = False,
                 config_dict_or_path: Any = None, config: Any = None, enabled: bool = True,
                 dtype: torch.dtype | None = None, mpu: Any = None, **ignored: Any) -> None:
        self.enabled = enabled
        self.group = data_parallel_group if data_parallel_group is not None else (
            mpu.get_data_parallel_group() if mpu is not None else None)
        settings = init_settings(config_dict_or_path if config_dict_or_path is not None else config)
        if settings is not None:
            dtype = dtype if dtype is not None else settings.dtype
            remote_device = settings.remote_device if settings.remote_device is not None else remote_device
        honoured_device = str(getattr(remote_device, "value", remote_device)) != "nvme"   # none / cpu are
        _warn_ignored({"mem_efficient_linear": mem_efficient_linear, "pin_memory": pin_memory, **ignored,
                       **({} if honoured_device else {"remote_device": remote_device})})
        self.dtype = dtype
        self.device = _target_device(remote_device)
        self._patched: dict[type, Any] = {}
        self.peak_full_numel = 0
        if module is not None and enabled:
            self._ensure_dist()
            for child in module.modules():
                self._partition_module(child)

    def _ensure_dist(self) -> None:
        if not comm.is_initialized():
            comm.init_distributed()
        if self.group is None:
            self.group = comm.get_world_group()

    def __enter__(self) -> Self:
        if not self.enabled:
            return self
        self._ensure_dist()
        for cls in _all_module_classes():
            if "__init__" in cls.__dict__:
                self._patch(cls)
        self._patch_init_subclass()
        return self

    def _patch_init_subclass(self) -> None:
        """Classes defined inside the context get their __init__ wrapped as well."""
        original = torch.nn.Module.__dict__.get("__init_subclass__")
        self._original_init_subclass = original
        init_ctx = self

        def init_subclass(cls: type, **kwargs: Any) -> None:
            if original is not None:
                original.__func__(cls, **kwargs)
            else:
                super(torch.nn.Module, cls).__init_subclass__(**kwargs)  # type: ignore[misc]
            if "__init__" in cls.__dict__:
                init_ctx._patch(cls)

        torch.nn.Module.__init_subclass__ = classmethod(init_subclass)  # type: ignore[assignment]

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        if self._original_init_subclass is None:
            del torch.nn.Module.__init_subclass__
        else:
            torch.nn.Module.__init_subclass__ = self._original_init_subclass  # type: ignore[method-assign]
        for cls, original in self._patched.items():
            cls.__init__ = original  # type: ignore[misc]
        self._patched.clear()

    def _patch(self, cls: type) -> None:
        if cls in self._patched:
            return
        original = cls.__dict__["__init__"]
        self._patched[cls] = original
        init_ctx = self

        @functools.wraps(original)
        def wrapped(module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
            depth = module.__dict__.get("_zs_init_depth", 0)
            module.__dict__["_zs_init_depth"] = depth + 1
            try:
                original(module, *args, **kwargs)
            finally:
                module.__dict__["_zs_init_depth"] = depth
            if depth == 0:
                del module.__dict__["_zs_init_depth"]
                init_ctx._partition_module(module)

        cls.__init__ = wrapped  # type: ignore[misc]

    @torch.no_grad()
    def _partition_module(self, module: torch.nn.Module) -> None:
        full_now = sum(p.numel() for p in module.parameters(recurse=False) if not is_zero_param(p))
        self.peak_full_numel = max(self.peak_full_numel, full_now)
        for name, param in list(module._parameters.items()):
            if param is None or is_zero_param(param):
                continue
            if self.dtype is not None and param.is_floating_point():
                param.data = param.data.to(self.dtype)
            param.data = param.data.to(self.device)  # partitions live on the accelerator (or remote_device)
            _convert(param, self.group, name=f"{type(module).__name__}.{name}")


def _convert(param: torch.nn.Parameter, group: Any, name: str) -> Any:
    return convert_to_zero_param(param, group, name=name)


class InitSettings:
    """What zero.Init takes from a ds_config."""

    def __init__(self, dtype: torch.dtype, remote_device: str | None) -> None:
        self.dtype, self.remote_device = dtype, remote_device


def init_settings(config: Any) -> InitSettings | None:
    """The dtype and offload device a zero.Init config asks for (None: no config).

    As DeepSpeed's `_set_dtype`: bf16 enabled -> bfloat16, fp16 -> half, else float32; the
    parameter-offload device replaces `remote_device`.
    """
    if config is None:
        return None
    from zerospeed.runtime.config import DeepSpeedRootConfig, load_ds_config
    from zerospeed.runtime.config_keys import validate_section

    root = getattr(config, "model", None)
    if not isinstance(root, DeepSpeedRootConfig):
        root = validate_section(DeepSpeedRootConfig, load_ds_config(config))
    dtype = torch.bfloat16 if root.bf16.enabled else torch.float16 if root.fp16.enabled else torch.float32
    zero = root.zero_optimization
    device = zero.offload_param.device.value if zero.offload_param is not None else None
    return InitSettings(dtype, device)


def _target_device(remote_device: Any) -> torch.device:
    if remote_device is not None and str(remote_device) not in ("none", "OffloadDeviceEnum.none"):
        return torch.device("cpu")  # cpu / nvme offload: partitions stay in host memory
    from zerospeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())
