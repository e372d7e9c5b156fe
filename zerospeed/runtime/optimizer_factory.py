"""Building the optimizer: the basic (torch) optimizer from the `optimizer` block or the client,
then the one wrapper the ZeRO stage and precision call for. This is the one place that branches
on the stage: the engine and `checkpoint/` ask the wrapper instead ([Note: stage dispatch] in
base_optimizer.py, [Note: checkpoint contract] in checkpoint/contract.py), and
tests/runtime/test_optimizer_contract.py and test_optimizer_checkpointing.py check every wrapper
answers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch

from zerospeed.comm.run_groups import RunGroups
from zerospeed.runtime.base_optimizer import DeepSpeedOptimizer
from zerospeed.runtime.fp16.loss_scaler import LossScaler, create_loss_scaler
from zerospeed.runtime.grad_space import GradSpace, PipelineStages
from zerospeed.runtime.precision import PrecisionSettings

# DeepSpeed's own optimizer names (matched case-insensitively); anything else is a torch.optim name.
ADAM, ADAMW, ADAGRAD, LAMB, LION, SGD, MUON = "adam", "adamw", "adagrad", "lamb", "lion", "sgd", "muon"


def _group_params(model_parameters: Any) -> list[Any]:
    """Param groups with no params are dropped; a param in two groups is an error (as DeepSpeed)."""
    params = list(model_parameters)
    if params and isinstance(params[0], dict):
        params = [group for group in params if len(list(group["params"])) > 0]
        seen: set[int] = set()
        for group in params:
            group["params"] = list(group["params"])
            for param in group["params"]:
                if id(param) in seen:
                    raise ValueError("A parameter appears in more than one optimizer param group")
                seen.add(id(param))
    return params


def build_basic_optimizer(name: str, params: dict[str, Any] | None, model_parameters: Iterable[Any],
                          offload: bool = False) -> torch.optim.Optimizer:
    """The optimizer the `optimizer` block names, over `model_parameters`."""
    params = dict(params or {})
    if "max_grad_norm" in params:
        raise ValueError("'max_grad_norm' is not supported as an optimizer parameter; "
                         "use the top-level 'gradient_clipping' key of the config instead")
    groups = _group_params(model_parameters)
    lowered = name.lower()
    if lowered in (ADAM, ADAMW):
        return _build_adam(lowered, params, groups, offload)
    if lowered == ADAGRAD:
        return _from_ops_or_torch("adagrad", "DeepSpeedCPUAdagrad", offload, groups, params, torch.optim.Adagrad)
    if lowered == LION:
        return _build_lion(groups, params, offload)
    if lowered == MUON:
        return _build_muon(groups, params, offload)
    if lowered in _MUP_CLASSES:
        return _build_mup(lowered, groups, params)
    if lowered == LAMB:
        from zerospeed.ops.lamb import FusedLamb

        return FusedLamb(groups, **params)
    if lowered == SGD and not hasattr(torch.optim, name):
        return torch.optim.SGD(groups, **params)
    optimizer_class = getattr(torch.optim, name, None)
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise ValueError(f"{name} is not a supported DeepSpeed Optimizer")
    return optimizer_class(groups, **params)


def _build_adam(lowered: str, params: dict[str, Any], groups: list[Any], offload: bool) -> torch.optim.Optimizer:
    torch_adam = bool(params.pop("torch_adam", False))
    adam_w_mode = bool(params.pop("adam_w_mode", True)) or lowered == ADAMW
    if torch_adam:  # as DeepSpeed: torch's class with torch's defaults (AdamW: weight decay 0.01), offload or not
        return (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)(groups, **params)
    bias_correction = params.pop("bias_correction", True)
    params.setdefault("weight_decay", 0.0)  # FusedAdam's and DeepSpeedCPUAdam's default
    if offload or not bias_correction:
        from zerospeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, bias_correction=bias_correction, adamw_mode=adam_w_mode, **params)
    return (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)(groups, **params)


def _build_lion(groups: list[Any], params: dict[str, Any], offload: bool) -> torch.optim.Optimizer:
    from zerospeed.ops.lion import DeepSpeedCPULion

    return DeepSpeedCPULion(groups, **params)


# DeepSpeed's muP optimizers come from the `mup` package, as there (it logs an error and then fails
# with a NameError when mup is missing; here the error says what to install).
_MUP_CLASSES = {"muadam": "MuAdam", "muadamw": "MuAdamW", "musgd": "MuSGD"}


def _build_mup(lowered: str, groups: list[Any], params: dict[str, Any]) -> torch.optim.Optimizer:
    class_name = _MUP_CLASSES[lowered]
    try:
        import mup  # type: ignore[import-not-found]
    except ImportError as error:
        raise ValueError(f"optimizer type {class_name} needs the mup package: pip install mup") from error
    return getattr(mup, class_name)(groups, **params)


def _build_muon(groups: list[Any], params: dict[str, Any], offload: bool) -> torch.optim.Optimizer:
    """DeepSpeed's Muon type (any case): `MuonWithAuxAdam`, never torch's 2-D-only `torch.optim.Muon`.
    Offloaded or not, the same class: its state lives where the offload holder puts its tensors
    (host memory or NVMe files, [Note: unit files] in zero/offload/unit_files.py)."""
    from zerospeed.runtime.zero.muon.param_groups import build_muon_optimizer

    return build_muon_optimizer(params, groups)


def _from_ops_or_torch(module: str, class_name: str, offload: bool, groups: list[Any], params: dict[str, Any],
                       torch_class: Callable[..., torch.optim.Optimizer]) -> torch.optim.Optimizer:
    if offload:
        import importlib

        return getattr(importlib.import_module(f"zerospeed.ops.{module}"), class_name)(groups, **params)
    return torch_class(groups, **params)


def build_loss_scaler(config: Any, precision: PrecisionSettings) -> LossScaler:
    dynamic = config.fp16_enabled and config.loss_scale == 0
    return create_loss_scaler(precision.param_dtype, static_loss_scale=config.loss_scale or 1.0,
                              dynamic_scaling=dynamic, dynamic_loss_args=config.dynamic_loss_scale_args)


# Optimizers whose update is element-wise, hence exact on ZeRO's flat partitions. DeepSpeed's list is
# Adam / AdamW / Adagrad and its own ops; SGD and the other element-wise torch optimizers are exact
# too, so they are allowed here. Anything else (e.g. LAMB's per-tensor trust ratio) needs the flag.
_ZERO_SAFE_OPTIMIZERS = ("Adam", "AdamW", "Adagrad", "SGD", "RMSprop", "Adamax", "NAdam", "RAdam", "Adadelta",
                         "DeepSpeedCPUAdam", "DeepSpeedCPUAdagrad", "DeepSpeedCPULion", "FusedAdam", "FusedLion",
                         # not elementwise, but every ZeRO wrapper registers its matrices' owners with it
                         # ([Note: owner-based Muon] in zero/muon/owner_plan.py)
                         "MuonWithAuxAdam")


def check_zero_supported(basic: torch.optim.Optimizer, config: Any) -> None:
    name = type(basic).__name__
    if config.zero_optimization_stage > 0 and name not in _ZERO_SAFE_OPTIMIZERS \
            and not config.zero_allow_untested_optimizer:
        raise ValueError(f"You are using an untested ZeRO Optimizer ({name}). Please add "
                         '<"zero_allow_untested_optimizer": true> in the configuration file to use it.')


def build_grad_space(stage: int, dp_group: Any, params: list[Any], module: torch.nn.Module,
                     run_groups: RunGroups | None = None) -> GradSpace:
    """The step's gradient space, once, from the run's groups ([Note: gradient space] in
    grad_space.py; [Note: run groups] in comm/run_groups.py): ZeRO 1-3 partitions over `dp_group`,
    stage 0's expert parts over their ep groups, AutoTP's split elements over the tp group, and a
    pipeline's stages (its pipe and pipe x tensor groups) with the tied copies its module counts."""
    base = GradSpace.data_parallel(dp_group, stage > 0, params, run_groups)
    if run_groups is None:
        return base
    from zerospeed.runtime.pipe.module import PipelineModule

    pipeline = None
    if isinstance(module, PipelineModule) and run_groups.pipe_parallel is not None \
            and run_groups.pipe_model_parallel is not None:
        tied = module.tied_comms
        pipeline = PipelineStages(run_groups.pipe_parallel.group, run_groups.pipe_model_parallel.group,
                                  lambda: tied.duplicate_sq_norm(dp_group))
    return dataclasses.replace(base, tp_group=run_groups.tp_group, pipeline=pipeline)


def build_optimizer_wrapper(basic: torch.optim.Optimizer, config: Any, precision: PrecisionSettings,
                            dp_group: Any, param_names: dict[torch.nn.Parameter, str],
                            module: torch.nn.Module, run_groups: RunGroups | None = None) -> DeepSpeedOptimizer:
    """The one place the ZeRO stage is branched on."""
    check_zero_supported(basic, config)
    stage = config.zero_optimization_stage
    loss_scaler = build_loss_scaler(config, precision)
    zero_config = config.zero_config
    params = [p for group in basic.param_groups for p in group["params"] if p.requires_grad]
    space = build_grad_space(stage, dp_group, params, module, run_groups)
    if stage == 0:
        from zerospeed.runtime.data_parallel import DataParallelOptimizer

        return DataParallelOptimizer(basic, precision, loss_scaler, dp_group, zero_config.reduce_bucket_size, space,
                                     run_groups=run_groups)
    from zerospeed.runtime.zero.offload.offload_states import build_offload_states

    offload = build_offload_states(basic, config, dp_group, module, precision.param_dtype)  # checks host RAM
    if stage in (1, 2):
        from zerospeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        return DeepSpeedZeroOptimizer(basic, zero_config, precision, loss_scaler, dp_group,
                                      partition_grads=stage == 2, param_names=param_names, offload=offload,
                                      grad_space=space, run_groups=run_groups)
    from zerospeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    return DeepSpeedZeroOptimizer_Stage3(module, basic, zero_config, precision, loss_scaler, dp_group,
                                         param_names=param_names, offload=offload, aio_config=config.aio_config,
                                         grad_space=space, run_groups=run_groups)


def build_parameter_offload(config: Any, precision: PrecisionSettings, dp_group: Any,
                            param_names: dict[torch.nn.Parameter, str], module: torch.nn.Module,
                            run_groups: RunGroups | None = None) -> Any:
    """The engine without an optimizer ([Note: engine without an optimizer] in engine.py): at stage 3
    the partitioning hooks alone, DeepSpeed's `DeepSpeedZeRoOffload` as `engine.optimizer`, with the
    coordinator and prefetch an engine with an optimizer gets; below stage 3 nothing (weights whole)."""
    if config.zero_optimization_stage != 3:
        return None
    from zerospeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

    zero_config = config.zero_config
    offload = zero_config.offload_param
    offload_enabled = offload is not None and offload.enabled
    if offload_enabled and offload.device.value == "nvme":
        raise NotImplementedError("zero_optimization.offload_param.device='nvme' without an optimizer "
                                  "(ZeRO-Inference from NVMe) is not implemented; use device 'cpu' or none")
    hooks = DeepSpeedZeRoOffload(module, zero_config, dp_group, param_names, precision.param_dtype, run_groups)
    if offload_enabled:   # the partitions live in host memory; gathers run on the compute device
        _partitions_to_host(hooks.params, bool(offload.pin_memory))
    return hooks


def _partitions_to_host(params: list[Any], pin_memory: bool) -> None:
    from zerospeed.runtime.zero.param_state import set_partition

    pin = pin_memory and torch.cuda.is_available()
    for param in params:
        partition = param.zs_state.partition
        if partition.device.type != "cpu":
            set_partition(param, torch.empty(partition.shape, dtype=partition.dtype, pin_memory=pin).copy_(partition))
