"""Setup steps of `DeepSpeedEngine.__init__` that are not sequencing: the parallel layout, parameter
broadcast, the basic optimizer, the LR scheduler, input casting."""

from __future__ import annotations

from typing import Any

import torch

from zerospeed import comm
from zerospeed.comm.layout import ParallelLayout, parallel_layout_for_run
from zerospeed.runtime.optimizer_factory import build_basic_optimizer


@torch.no_grad()
def broadcast_module_from_rank0(module: torch.nn.Module, group: Any) -> None:
    """Every rank starts from the source rank's parameters and buffers (DeepSpeed broadcasts params).

    Expert parameters (`allreduce=False`) are skipped. Parameters already partitioned by zero.Init (they have a `ds_id`) were made consistent when
    they were partitioned; they are skipped."""
    if comm.get_world_size(group) == 1:
        return
    source = comm.get_global_rank(group, 0)
    # Expert parameters differ between expert-parallel ranks; engine_moe broadcasts them in their groups.
    replicated = [p for p in module.parameters() if not hasattr(p, "ds_id") and getattr(p, "allreduce", True)] \
        + list(module.buffers())
    for tensor in replicated:
        comm.broadcast(tensor.data, src=source, group=group)


def configure_basic_optimizer(config: Any, module: torch.nn.Module, client_optimizer: Any,
                              model_parameters: Any) -> torch.optim.Optimizer:
    """The client's optimizer (an instance, or a callable given the params), else the config's."""
    params = model_parameters if model_parameters is not None else module.parameters()
    if client_optimizer is not None:
        if isinstance(client_optimizer, torch.optim.Optimizer):
            return client_optimizer
        if callable(client_optimizer):
            return client_optimizer(params)
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or a callable, got {type(client_optimizer)}")
    offload = _offloads_optimizer(config)
    if str(config.optimizer_name).lower() == "muon":
        _prepare_muon(module, bool((config.optimizer_params or {}).get("per_head_muon", False)))
    return build_basic_optimizer(config.optimizer_name, config.optimizer_params, params, offload=offload)


def _prepare_muon(module: torch.nn.Module, per_head: bool = False) -> None:
    """`use_muon` on every parameter (DeepSpeed's rule), and with `per_head_muon` the attention
    projections' heads ([Note: per-head Muon] in zero/muon/per_head.py). A matrix split over tensor-parallel ranks
    by AutoTP is joined for Newton-Schulz ([Note: Muon with AutoTP] in zero/muon/tp_matrices.py);
    one split by another library (no AutoTP shard record) is refused: its layout is unknown."""
    from zerospeed.runtime.zero.muon.param_groups import tag_muon_params
    from zerospeed.runtime.zero.muon.per_head import tag_per_head

    tag_muon_params(module)
    tag_per_head(module, per_head)
    split = [name for name, p in module.named_parameters() if getattr(p, "use_muon", False)
             and getattr(p, "tensor_model_parallel", False) and getattr(p, "ds_tp_shard", None) is None]
    if split:
        raise ValueError(f"the Muon optimizer with tensor-parallel parameters not split by AutoTP is not implemented "
                         f"by zerospeed: {split[:3]} are marked tensor_model_parallel with no AutoTP shard record, "
                         "so their whole matrices, which Newton-Schulz needs, cannot be rebuilt")


def _offloads_optimizer(config: Any) -> bool:
    offload = config.zero_config.offload_optimizer
    return offload is not None and offload.enabled   # cpu or nvme: the CPU optimizer steps the masters


def build_lr_scheduler(config: Any, optimizer: torch.optim.Optimizer | None, client_scheduler: Any) -> Any:
    """The client's scheduler (an instance, or a callable given the optimizer), else the config's."""
    if client_scheduler is not None:
        return client_scheduler(optimizer) if callable(client_scheduler) and not hasattr(client_scheduler, "step") \
            else client_scheduler
    if config.scheduler_name is None:
        return None
    from zerospeed.runtime.lr_schedules import build_lr_scheduler as build_named

    return build_named(config.scheduler_name, config.scheduler_params or {}, optimizer)


def cast_inputs(inputs: tuple, dtype: torch.dtype) -> tuple:
    """fp16.auto_cast: floating-point positional inputs (recursing into lists, tuples, dicts) to
    `dtype`. Keyword arguments are left as they are, as DeepSpeed leaves them (its forward casts
    `inputs` only), so a model called with `**batch` sees the same dtypes under either library."""

    def cast(value: Any) -> Any:
        if torch.is_tensor(value) and value.is_floating_point():
            return value.to(dtype)
        if isinstance(value, (list, tuple)):
            return type(value)(cast(v) for v in value)
        if isinstance(value, dict):
            return {k: cast(v) for k, v in value.items()}
        return value

    return cast(inputs)


def build_parallel_layout(raw_config: dict[str, Any], model: torch.nn.Module, mpu: Any,
                          pipe_stages: int) -> ParallelLayout:
    """The run's `ParallelLayout`, read before anything is grouped or cut, so that `validate()`
    refuses a combination with the model untouched ([Note: combination table] in comm/layout.py)."""
    from zerospeed.moe.layer import MoE
    from zerospeed.runtime.tensor_parallel.setup import resolve_tp_config

    ep_sizes = [child.ep_size for child in model.modules() if isinstance(child, MoE)]
    mpu_sequence_size = None
    if mpu is not None and hasattr(mpu, "get_sequence_parallel_group"):
        mpu_sequence_size = comm.get_world_size(mpu.get_sequence_parallel_group())
    return parallel_layout_for_run(raw_config, comm.get_world_size(), pipe_stages=pipe_stages,
                                   tensor_size=resolve_tp_config(raw_config, model).tp_size,
                                   moe_expert_sizes=ep_sizes,
                                   mpu_sequence_size=mpu_sequence_size)
