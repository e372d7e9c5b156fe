"""The flops profiler: parameters, MACs, FLOPs and latency of every module in a forward pass.

`FlopsProfiler(model)` attaches forward pre/post hooks to each module and, between
`start_profile()` and `stop_profile()`, intercepts every aten operator with a
`TorchDispatchMode`. Each operator's cost (`flop_counts.count_op`, see [Note: what is counted])
is added to every module on the stack of modules whose forward is running, so a parent's
numbers include its children's. Operators outside the model's forward (the loss, backward,
the optimizer) are not counted: the profile is of the forward pass, as DeepSpeed's is, and a
training step's FLOPs are derived from it (`training_step_flops`: backward = 2 x forward, plus
`recompute_fwd_factor` x forward for activation checkpointing).

Latency per module is wall time between its hooks with the accelerator synchronized, so it
includes the interception overhead; use it to rank modules, not as a benchmark.

`get_model_profile(model, input_shape=..., args=..., kwargs=...)` is DeepSpeed's one-call form
and returns `(flops, macs, params)`.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zerospeed.profiling.flop_counts import count_op
from zerospeed.profiling.profile_report import (ModuleProfile, duration_to_string, flops_to_string,
                                                format_aggregated, format_tree, macs_to_string,
                                                params_to_string)

__all__ = ["FlopsProfiler", "get_model_profile", "training_step_flops"]


def _synchronize() -> None:
    from zerospeed.accelerator import get_accelerator

    get_accelerator().synchronize()


def _count_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())


def training_step_flops(fwd_flops: float, recompute_fwd_factor: float = 0.0) -> float:
    """FLOPs of forward + backward: backward costs 2 x forward; recomputation adds a share of forward."""
    return fwd_flops * (3.0 + recompute_fwd_factor)


class _OpCounter(TorchDispatchMode):
    """Adds each operator's (flops, macs) to the profiles of the modules now running forward."""

    def __init__(self, profiler: FlopsProfiler) -> None:
        super().__init__()
        self.profiler = profiler

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        active = self.profiler._active
        if active and not self.profiler._ignored_depth:
            flops, macs = count_op(func, args, kwargs, out)
            if flops or macs:
                for profile in active.values():
                    profile.flops += flops
                    profile.macs += macs
        return out


class FlopsProfiler:
    """Per-module parameters, MACs, FLOPs and latency of `model`'s forward passes."""

    def __init__(self, model: torch.nn.Module, ds_engine: Any = None, recompute_fwd_factor: float = 0.0) -> None:
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = recompute_fwd_factor
        self.started = False
        self._profiles: dict[int, ModuleProfile] = {}
        self._active: dict[int, ModuleProfile] = {}   # modules whose forward is running (ordered)
        self._ignored_depth = 0
        self._start_s: dict[int, list[float]] = {}
        self._handles: list[Any] = []
        self._mode: _OpCounter | None = None

    # --- lifecycle --------------------------------------------------------------------------
    def start_profile(self, ignore_list: list[type] | None = None) -> None:
        """Reset the counts, attach the hooks and start intercepting operators."""
        self.reset_profile()
        ignored = tuple(ignore_list or ())
        for module in self.model.modules():
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(ignored)))
            self._handles.append(module.register_forward_hook(self._post_hook(ignored)))
        self._mode = _OpCounter(self)
        self._mode.__enter__()
        self.started = True

    def stop_profile(self) -> None:
        """Stop counting; the numbers stay readable until `end_profile`."""
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._active.clear()
        self.started = False

    def reset_profile(self) -> None:
        self._profiles = self._build_profiles()
        self._active.clear()
        self._start_s.clear()
        self._ignored_depth = 0

    def end_profile(self) -> None:
        """Stop and drop everything the profiler holds."""
        self.stop_profile()
        self._profiles = {}

    def _build_profiles(self) -> dict[int, ModuleProfile]:
        profiles: dict[int, ModuleProfile] = {}
        for name, module in self.model.named_modules(remove_duplicate=True):
            profile = ModuleProfile(name=name, class_name=type(module).__name__,
                                    depth=name.count(".") + 1 if name else 0, params=_count_params(module))
            profiles[id(module)] = profile
            if name:
                parent_name = name.rsplit(".", 1)[0] if "." in name else ""
                parent = self.model.get_submodule(parent_name)
                profiles[id(parent)].children.append(profile)
        return profiles

    # --- hooks ------------------------------------------------------------------------------
    def _pre_hook(self, ignored: tuple[type, ...]) -> Any:
        def hook(mod: torch.nn.Module, inputs: Any) -> None:
            if ignored and isinstance(mod, ignored):
                self._ignored_depth += 1
            profile = self._profiles.get(id(mod))
            if profile is not None:
                self._active[id(mod)] = profile
            _synchronize()
            self._start_s.setdefault(id(mod), []).append(time.perf_counter())

        return hook

    def _post_hook(self, ignored: tuple[type, ...]) -> Any:
        def hook(mod: torch.nn.Module, inputs: Any, output: Any) -> None:
            _synchronize()
            starts = self._start_s.get(id(mod))
            profile = self._profiles.get(id(mod))
            if starts:
                start_s = starts.pop()
                if profile is not None and not starts:  # outermost call of a re-entered module
                    profile.latency_s += time.perf_counter() - start_s
            if not starts:
                self._active.pop(id(mod), None)
            if ignored and isinstance(mod, ignored):
                self._ignored_depth -= 1

        return hook

    # --- totals -----------------------------------------------------------------------------
    @property
    def root(self) -> ModuleProfile:
        if not self._profiles:
            raise RuntimeError("no profile: call start_profile() and run a forward pass first")
        return self._profiles[id(self.model)]

    def get_total_flops(self, as_string: bool = False) -> int | str:
        flops = self.root.flops
        return flops_to_string(flops) if as_string else flops

    def get_total_macs(self, as_string: bool = False) -> int | str:
        macs = self.root.macs
        return macs_to_string(macs) if as_string else macs

    def get_total_params(self, as_string: bool = False) -> int | str:
        params = self.root.params
        return params_to_string(params) if as_string else params

    def get_total_duration(self, as_string: bool = False) -> float | str:
        """Forward wall time in seconds, summed over the profiled passes."""
        duration_s = self.root.latency_s
        return duration_to_string(duration_s) if as_string else duration_s

    def module_profiles(self) -> dict[str, ModuleProfile]:
        """Profiles by qualified module name ("" is the root)."""
        return {profile.name: profile for profile in self._profiles.values()}

    # --- report -----------------------------------------------------------------------------
    def format_model_profile(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                             detailed: bool = True, step_latency_s: float | None = None) -> str:
        """The report as text; `step_latency_s` (a whole training step) adds the achieved FLOP/s."""
        root = self.root
        fwd_rate = root.flops / root.latency_s if root.latency_s > 0 else 0.0
        lines = ["-------------------------- zerospeed flops profiler --------------------------",
                 f"Profile summary at step {profile_step}:",
                 f"{'params per device:':<60}{params_to_string(root.params)}",
                 f"{'fwd MACs per device:':<60}{macs_to_string(root.macs)}",
                 f"{'fwd flops per device:':<60}{flops_to_string(root.flops)}",
                 f"{'fwd latency:':<60}{duration_to_string(root.latency_s)}",
                 f"{'fwd FLOPS per device = fwd flops / fwd latency:':<60}{flops_to_string(fwd_rate)}"]
        if step_latency_s:
            step_flops = training_step_flops(root.flops, self.recompute_fwd_factor)
            lines += [f"{'fwd+bwd flops per device (bwd = 2 x fwd):':<60}{flops_to_string(step_flops)}",
                      f"{'step latency:':<60}{duration_to_string(step_latency_s)}",
                      f"{'achieved FLOPS per device = fwd+bwd flops / step latency:':<60}"
                      f"{flops_to_string(step_flops / step_latency_s)}"]
        lines += ["", "---------------------------- aggregated profile per device ----------------------------",
                  format_aggregated(root, module_depth, top_modules)]
        if detailed:
            lines += ["", "----------------------------- detailed profile per device -----------------------------",
                      "Each module: params and share of all params, MACs and share, fwd latency and share, "
                      "fwd FLOP/s. Parents include their children; operators a module runs outside its "
                      "submodules are counted in it alone.", "",
                      format_tree(root, module_depth)]
        return "\n".join(lines)

    def print_model_profile(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                            detailed: bool = True, output_file: str | None = None,
                            step_latency_s: float | None = None) -> None:
        text = self.format_model_profile(profile_step, module_depth, top_modules, detailed, step_latency_s)
        if output_file:
            with open(output_file, "w") as handle:
                handle.write(text + "\n")
        else:
            print(text, flush=True)

    def print_model_aggregated_profile(self, module_depth: int = -1, top_modules: int = 1) -> None:
        print(format_aggregated(self.root, module_depth, top_modules), flush=True)


def _input_from_shape(model: torch.nn.Module, input_shape: tuple[int, ...]) -> torch.Tensor:
    param = next(model.parameters(), None)
    dtype = param.dtype if param is not None else torch.float32
    device = param.device if param is not None else torch.device("cpu")
    return torch.randn(*input_shape, dtype=dtype, device=device)


def get_model_profile(model: torch.nn.Module, input_shape: tuple[int, ...] | None = None, args: list | None = None,
                      kwargs: dict | None = None, print_profile: bool = True, detailed: bool = True,
                      module_depth: int = -1, top_modules: int = 1, warm_up: int = 1, as_string: bool = True,
                      output_file: str | None = None, ignore_modules: list[type] | None = None,
                      mode: str = "forward") -> tuple[Any, Any, Any]:
    """Profile one forward pass of `model` (after `warm_up` unprofiled ones): `(flops, macs, params)`.

    The input is `args` / `kwargs`, or with `input_shape` a random tensor of that shape in the
    model's dtype. With `as_string` the three numbers come back as unit strings.
    """
    if mode != "forward":
        raise ValueError(f"get_model_profile: mode={mode!r} is not supported; only 'forward'")
    args = list(args or [])
    kwargs = dict(kwargs or {})
    if input_shape is not None:
        if args:
            raise ValueError("get_model_profile: pass either input_shape or args, not both")
        args = [_input_from_shape(model, tuple(input_shape))]
    if not args and not kwargs:
        raise ValueError("get_model_profile needs input_shape, args or kwargs")
    profiler = FlopsProfiler(model)
    with torch.no_grad():
        for _ in range(warm_up):
            model(*args, **kwargs)
        profiler.start_profile(ignore_list=ignore_modules)
        model(*args, **kwargs)
    root = profiler.root   # the totals as numbers (get_total_* return strings on request)
    flops, macs, params = root.flops, root.macs, root.params
    profiler.stop_profile()
    if print_profile:
        profiler.print_model_profile(profile_step=warm_up, module_depth=module_depth, top_modules=top_modules,
                                     detailed=detailed, output_file=output_file)
    profiler.end_profile()
    if as_string:
        return flops_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params
