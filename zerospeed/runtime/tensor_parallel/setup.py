"""AutoTP at `deepspeed.initialize`: the groups, the shared starting weights, the sharding.

`tp_model_init(model, tp_size, dtype)` only records its arguments, on the model itself (DeepSpeed
0.19.8 records them in a process-wide global; a record per model means two models never see
each other's). At `initialize` the record and the ds_config's ``tensor_parallel`` section are
merged (the config wins where it speaks; a conflict is an error naming both values), then:

1. the grid ``data x model`` is built from one `ProcessTopology` (tp fastest, DeepSpeed's layout:
   tp groups are consecutive ranks, dp groups strided by tp);
2. every rank takes global rank 0's full weights and buffers, and the tp ranks share one torch
   RNG state, so dropout masks on replicated activations agree;
3. the linear layers are replaced by their tensor-parallel versions (shard.py).

[Note: AutoTP with ZeRO-3]
ZeRO-3 then partitions the already-cut model over the data-parallel group (the ranks with the same
tp rank, as DeepSpeed 0.19.8): each tp rank's pieces are its own parameters, partitioned and
gathered among its dp peers only; replicated parameters are partitioned the same way in every tp
group. The norm sums each parameter's real partition elements (stage3.py) as [Note:
gradient space] in runtime/grad_space.py says. Full weights: each tp rank's pieces are gathered over dp onto dp rank
0, then the tp group of dp rank 0 (global ranks 0..tp-1) joins them (engine_component.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from zerospeed import comm
from zerospeed.comm import groups
from zerospeed.comm.run_groups import RunGroups
from zerospeed.comm.topology import PipeModelDataParallelTopology
from zerospeed.runtime.tensor_parallel.config import TPTrainingConfig
from zerospeed.runtime.tensor_parallel.plan import Partition
from zerospeed.runtime.tensor_parallel.shard import apply_autotp

__all__ = ["TensorParallelSetup", "TpModelInitArgs", "build_tensor_parallel_grid", "record_tp_model_init",
           "resolve_tp_config", "setup_autotp"]

_RECORD_ATTR = "ds_tp_model_init_args"


@dataclasses.dataclass(frozen=True)
class TpModelInitArgs:
    """What `tp_model_init` was called with."""

    tp_size: int
    dtype: torch.dtype
    tp_group: Any = None


@dataclasses.dataclass
class TensorParallelSetup:
    """The engine's view of AutoTP: its config, groups and the plan it applied."""

    config: TPTrainingConfig
    tp_group: Any
    dp_group: Any
    plan: dict[str, Partition]

    @property
    def tp_size(self) -> int:
        return comm.get_world_size(self.tp_group)

    @property
    def tp_rank(self) -> int:
        return comm.get_rank(self.tp_group)


def record_tp_model_init(model: torch.nn.Module, tp_size: int, dtype: torch.dtype, tp_group: Any = None) -> None:
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_model_init: tp_size must be a positive int, got {tp_size!r}")
    previous = getattr(model, _RECORD_ATTR, None)
    new = TpModelInitArgs(tp_size, dtype, tp_group)
    if previous is not None and (previous.tp_size, previous.dtype) != (tp_size, dtype):
        raise ValueError(f"Conflicting tp_model_init arguments for one model: {previous} then {new}")
    setattr(model, _RECORD_ATTR, new)


def _config_dtype(raw: dict[str, Any]) -> torch.dtype | None:
    for key, dtype in (("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("fp16", torch.float16)):
        section = raw.get(key)
        if isinstance(section, dict) and section.get("enabled", False):
            return dtype
    return None


def resolve_tp_config(raw: dict[str, Any], model: torch.nn.Module) -> TPTrainingConfig:
    """The ``tensor_parallel`` section with `tp_model_init`'s record merged in."""
    section = dict(raw.get("tensor_parallel") or {})
    record: TpModelInitArgs | None = getattr(model, _RECORD_ATTR, None)
    if record is not None:
        given = section.get("autotp_size")
        if given not in (None, record.tp_size):
            raise ValueError(f"Conflicting tensor_parallel.autotp_size in config ({given}) and "
                             f"tp_model_init ({record.tp_size})")
        section["autotp_size"] = record.tp_size
        precision = _config_dtype(raw)
        if precision is not None and precision != record.dtype:
            raise ValueError(f"Conflicting dtype: config uses {precision} but tp_model_init requested {record.dtype}")
        section.setdefault("dtype", record.dtype)
        if record.tp_group is not None:
            section["tp"] = {**dict(section.get("tp") or {}), "tp_group": record.tp_group}
    return TPTrainingConfig(**section)


def _check_user_group(config: TPTrainingConfig, built: groups.AxisGroup) -> None:
    given = config.tensor_parallel.tp_group
    if given is None:
        return
    ranks = tuple(comm.get_global_rank(given, r) for r in range(comm.get_world_size(given)))
    if ranks != built.ranks:
        raise ValueError(f"tensor_parallel.tp.tp_group holds ranks {list(ranks)}, but AutoTP's layout puts this "
                         f"rank's tensor-parallel peers at {list(built.ranks)} (tp the fastest axis)")


@torch.no_grad()
def _share_starting_state(model: torch.nn.Module, tp_group: groups.AxisGroup) -> None:
    for tensor in [*model.parameters(), *model.buffers()]:
        comm.broadcast(tensor.data, src=0)
    rng = torch.get_rng_state()
    comm.broadcast(rng, src=tp_group.ranks[0], group=tp_group.group)
    torch.set_rng_state(rng)


def _build_grid(tp_size: int, world_size: int) -> None:
    """The data x model grid; kept when the registry already holds exactly this one (a second engine)."""
    topology = PipeModelDataParallelTopology(num_pp=1, num_mp=tp_size, num_dp=world_size // tp_size)
    current = groups.get_topology()
    if current is None or (current.axes, current.dims) != (topology.axes, topology.dims) \
            or not groups.is_initialized(groups.MODEL_PARALLEL):
        groups.initialize(topology)


def build_tensor_parallel_grid(tp_size: int, model: torch.nn.Module,
                               mpu: Any) -> tuple[groups.AxisGroup, groups.AxisGroup]:
    """AutoTP's (tensor, data) groups from the data x model grid, after the checks that come before
    any group is built (collective; `engine_groups.build_run_groups` calls it)."""
    _refuse_zero_init_model(tp_size, model)
    if mpu is not None:
        raise ValueError("tensor_parallel.autotp_size > 1 builds its own groups; do not pass an mpu as well")
    world_size = comm.get_world_size()
    if world_size % tp_size:
        raise ValueError(f"tensor_parallel.autotp_size ({tp_size}) must divide the world size ({world_size})")
    _build_grid(tp_size, world_size)
    return groups.get_group(groups.MODEL_PARALLEL), groups.get_group(groups.DATA_PARALLEL)


def setup_autotp(model: torch.nn.Module, raw_config: dict[str, Any], mpu: Any,
                 run_groups: RunGroups | None = None) -> TensorParallelSetup | None:
    """Shard ``model`` when AutoTP is on, over the run's tensor-parallel group (built here when no
    `run_groups` are given); None when it is off."""
    config = resolve_tp_config(raw_config, model)
    if config.tp_size <= 1:
        return None
    if run_groups is None or run_groups.tensor_parallel is None:
        tp, dp = build_tensor_parallel_grid(config.tp_size, model, mpu)
    else:
        tp, dp = run_groups.tensor_parallel, run_groups.data_parallel
    _check_user_group(config, tp)
    _share_starting_state(model, tp)
    plan = apply_autotp(model, tp.group, config.partition_config)
    return TensorParallelSetup(config, tp.group, dp.group, plan)


def _refuse_zero_init_model(tp_size: int, model: torch.nn.Module) -> None:
    """A model built under `zero.Init` holds partitions only; AutoTP cuts whole weights. DeepSpeed
    0.19.8 gathers each layer whole before cutting it; zerospeed does not (docs/compatibility.md)."""
    from zerospeed.runtime.zero.param_state import is_zero_param

    partitioned = [name for name, param in model.named_parameters() if is_zero_param(param)]
    if partitioned:
        raise ValueError(f"tensor_parallel.autotp_size={tp_size} with a model built under zero.Init (parameter "
                         f"'{partitioned[0]}' is partitioned) is not supported: build the model without "
                         "zero.Init; ZeRO stage 3 then partitions the tensor-parallel pieces at initialize")
