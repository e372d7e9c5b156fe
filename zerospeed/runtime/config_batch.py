"""The batch triangle: train_batch_size = micro batch per GPU x gradient accumulation x data-parallel
world size, derived the way DeepSpeed derives it (`DeepSpeedConfig._set_batch_related_parameters`)."""

from __future__ import annotations

from typing import Any

import torch

from zerospeed.runtime.config_utils import ConfigError

__all__ = ["data_parallel_world_size", "resolve_batch_sizes"]


def resolve_batch_sizes(train_batch_size: int | None, micro_batch: int | None, grad_acc: int | None,
                        world_size: int, world_size_source: str | None = None) -> tuple[int, int, int]:
    """(train_batch_size, micro_batch_per_gpu, gradient_accumulation_steps), DeepSpeed's way.

    Any two given derive the third by floor division in DeepSpeed's order; one given sets
    GAS = 1. A given value <= 0 is an error naming its key. A triangle that cannot close (a derived
    value of 0, or TBS != MBS * GAS * world_size) is an error naming the three values as given and
    the world size with where it came from (DeepSpeed reports the derived 0 instead, a value the
    user never set).
    """
    tbs, mbs, gas = train_batch_size, micro_batch, grad_acc
    _check_positive(tbs, mbs, gas)
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
    if min(tbs, mbs, gas) <= 0 or tbs != mbs * gas * world_size:
        given = ", ".join(f"{key} {'not set' if value is None else value}" for key, value in zip(
            _BATCH_KEYS, (train_batch_size, micro_batch, grad_acc)))
        source = f" (from {world_size_source})" if world_size_source else ""
        raise ConfigError(f"Check batch related parameters: {given} on world_size {world_size}{source} cannot "
                          "satisfy train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps"
                          f" * world_size (derived: {tbs} != {mbs} * {gas} * {world_size})")
    return tbs, mbs, gas


_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _check_positive(tbs: int | None, mbs: int | None, gas: int | None) -> None:
    for key, value in zip(_BATCH_KEYS, (tbs, mbs, gas)):
        if value is not None and value <= 0:
            raise ConfigError(f"{key}: {value} has to be greater than 0")


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
