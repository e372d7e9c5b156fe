"""The batch triangle: train_batch_size = micro batch per GPU x gradient accumulation x data-parallel
world size, derived the way DeepSpeed derives it (`DeepSpeedConfig._set_batch_related_parameters`)."""

from __future__ import annotations

from typing import Any

import torch

from zerospeed.runtime.config_utils import ConfigError

__all__ = ["data_parallel_world_size", "resolve_batch_sizes"]


def resolve_batch_sizes(train_batch_size: int | None, micro_batch: int | None, grad_acc: int | None,
                        world_size: int, world_size_source: str | None = None) -> tuple[int, int, int]:
    """(train_batch_size, micro_batch_per_gpu, gradient_accumulation_steps), DeepSpeed's way (§2.2).

    Any two given derive the third by floor division in DeepSpeed's order; one given sets
    GAS = 1. Then every value must be > 0 and TBS == MBS * GAS * world_size, with DeepSpeed's
    assertion messages (plus where the world size came from, the usual culprit).
    """
    tbs, mbs, gas = train_batch_size, micro_batch, grad_acc
    _check_positive(tbs, mbs, gas, allow_none=True)
    if tbs is not None and mbs is not None and gas is None:
        gas = (tbs // mbs) // world_size
    elif tbs is not None and gas is not None and mbs is None:
        mbs = (tbs // world_size) // gas
    elif mbs is not None and gas is not None and tbs is None:
        tbs = mbs * gas * world_size
    elif tbs is not None and mbs is None and gas is None:
        gas, mbs = 1, tbs // world_size
    elif mbs is not None and tbs is None and gas is None:
        gas, tbs = 1, mbs * world_size
    elif tbs is None and mbs is None:
        raise ConfigError("Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided")
    assert tbs is not None and mbs is not None and gas is not None
    _check_positive(tbs, mbs, gas, allow_none=False)
    if tbs != mbs * gas * world_size:
        source = f" (world_size {world_size} from {world_size_source})" if world_size_source else ""
        raise ConfigError("Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu "
                          f"* gradient_acc_step * world_size {tbs} != {mbs} * {gas} * {world_size}{source}")
    return tbs, mbs, gas


def _check_positive(tbs: int | None, mbs: int | None, gas: int | None, allow_none: bool) -> None:
    for value, message in ((tbs, "Train batch size: {} has to be greater than 0"),
                           (mbs, "Micro batch size per gpu: {} has to be greater than 0"),
                           (gas, "Gradient accumulation steps: {} has to be greater than 0")):
        if value is None and allow_none:
            continue
        if value is None or value <= 0:
            raise ConfigError(message.format(value))


def data_parallel_world_size(world_size: int | None, mpu: Any, mesh_device: Any,
                              sequence_parallel_size: int) -> tuple[int, str]:
    if world_size is not None:
        return world_size, "the world_size argument"
    if mpu is not None and hasattr(mpu, "get_data_parallel_world_size"):
        return mpu.get_data_parallel_world_size(), "mpu.get_data_parallel_world_size()"
    if mesh_device is not None:
        names = list(getattr(mesh_device, "mesh_dim_names", None) or ())
        if "data_parallel" in names:
            return mesh_device.size(names.index("data_parallel")), "the mesh's data_parallel dimension"
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
        if sequence_parallel_size > 1:
            return world // sequence_parallel_size, f"torch.distributed world size {world} / sequence_parallel_size"
        return world, "the torch.distributed world size"
    return 1, "torch.distributed not initialized"
