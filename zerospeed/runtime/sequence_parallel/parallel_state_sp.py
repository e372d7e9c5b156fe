"""DeepSpeed's ALST ``mpu`` (``deepspeed.runtime.sequence_parallel.parallel_state_sp``).

`UlyssesSPAttentionHF.register_with_transformers` returns this module; clients hand it to
``deepspeed.initialize(mpu=...)``. The groups live in the one registry, ``zerospeed.comm.groups``
(built from DeepSpeed's ``(data, sequence)`` grid, groups_setup.py); these functions read them.
Unlike DeepSpeed, calling `initialize_sequence_parallel` again rebuilds the groups instead of
asserting, so a process can train two models one after the other.
"""

from __future__ import annotations

from typing import Any

from zerospeed import comm
from zerospeed.comm import groups
from zerospeed.runtime.sequence_parallel.groups_setup import sequence_parallel_topology

__all__ = [
    "get_model_parallel_group", "get_model_parallel_rank", "get_model_parallel_world_size",
    "get_sequence_data_parallel_group", "get_sequence_data_parallel_rank",
    "get_sequence_data_parallel_world_size", "get_sequence_parallel_group", "get_sequence_parallel_rank",
    "get_sequence_parallel_world_size", "initialize_sequence_parallel",
]


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Build the sequence-parallel and sequence-data-parallel groups (collective)."""
    if sequence_parallel_size <= 1:
        raise ValueError(f"sequence_parallel_size must be greater than 1, got {sequence_parallel_size}")
    groups.initialize_sequence_parallel(sequence_parallel_topology(comm.get_world_size(), sequence_parallel_size))


def get_sequence_parallel_group() -> Any:
    return groups._get_sequence_parallel_group()


def get_sequence_data_parallel_group() -> Any:
    if not groups.is_initialized(groups.SEQUENCE_DATA_PARALLEL):
        raise RuntimeError("sequence data parallel group is not initialized; call initialize_sequence_parallel")
    return groups._get_sequence_data_parallel_group()


def get_sequence_parallel_world_size() -> int:
    return comm.get_world_size(get_sequence_parallel_group())


def get_sequence_data_parallel_world_size() -> int:
    return comm.get_world_size(get_sequence_data_parallel_group())


def get_sequence_parallel_rank() -> int:
    return comm.get_rank(get_sequence_parallel_group())


def get_sequence_data_parallel_rank() -> int:
    return comm.get_rank(get_sequence_data_parallel_group())


# DeepSpeed aliases model parallelism to sequence parallelism in this mpu (its only extra axis).
get_model_parallel_rank = get_sequence_parallel_rank
get_model_parallel_world_size = get_sequence_parallel_world_size
get_model_parallel_group = get_sequence_parallel_group
