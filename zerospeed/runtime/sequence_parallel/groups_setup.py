"""The engine's sequence-parallel layout: which ranks share a sample, which replicate the model.

With ``sequence_parallel_size = sp`` on ``W`` ranks the layout is DeepSpeed's (its ``(dp, sp)``
device mesh and its ALST ``parallel_state_sp``): a ``ProcessTopology(["data", "sequence"],
[W // sp, sp])``, so the ranks of one sequence-parallel group are consecutive (``[0, 1]``,
``[2, 3]`` for sp 2 on 4 ranks) and the data-parallel peers of rank 0 are ``0, sp, 2 sp, ...``.
ZeRO partitions and gradients are reduced over the sequence-data-parallel group (all ``W``
ranks): every rank holds a replica of the model, whatever slice of the sequence it saw.

[Note: gradient averaging under sequence parallelism]
The engine averages gradients over all ``W`` ranks. With the loss convention DeepSpeed's ALST
recipe and transformers' Trainer use (every sp rank's loss is the whole sample's token-weighted
loss, aggregated with a differentiable all-gather), and with `sequence_parallel_loss`, the sum of
the sp ranks' gradients is ``sp`` times the full-sequence gradient; dividing by ``W`` gives
exactly the gradient of full-sequence training averaged over the ``W // sp`` data-parallel
replicas. DeepSpeed divides by ``W // sp`` instead, which leaves those gradients ``sp`` times too
large (DeepSpeed issue 5248); see docs/compatibility.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from zerospeed import comm
from zerospeed.comm import groups
from zerospeed.comm.topology import ProcessTopology

__all__ = ["SequenceParallelGroups", "build_sequence_parallel", "sequence_parallel_topology"]


@dataclasses.dataclass(frozen=True)
class SequenceParallelGroups:
    sequence_parallel_group: Any
    sequence_data_parallel_group: Any
    data_parallel_group: Any
    sequence_parallel_size: int
    data_parallel_size: int


def sequence_parallel_topology(world_size: int, sequence_parallel_size: int,
                               data_parallel_size: int | None = None) -> ProcessTopology:
    """DeepSpeed's ``(data, sequence)`` rank grid; a clear error for sizes that do not fit."""
    if sequence_parallel_size < 1 or world_size % sequence_parallel_size != 0:
        raise ValueError(f"sequence_parallel_size={sequence_parallel_size} must divide the world size {world_size}")
    dp = world_size // sequence_parallel_size
    if data_parallel_size is not None and data_parallel_size != dp:
        raise ValueError(f"data_parallel_size={data_parallel_size} but world size {world_size} / "
                         f"sequence_parallel_size {sequence_parallel_size} = {dp}")
    return ProcessTopology(["data", "sequence"], [dp, sequence_parallel_size])


def build_sequence_parallel(sequence_size: int, mpu: Any) -> SequenceParallelGroups | None:
    """The groups for the layout's sequence size (``sequence_parallel_size`` in the ds_config, whose
    ``data_parallel_size`` the layout checked), or a sequence-parallel ``mpu``'s (collective).

    Returns None (and forgets any groups an earlier engine in this process built) without them.
    """
    if mpu is not None and hasattr(mpu, "get_sequence_parallel_group"):
        return _from_mpu(mpu)
    if sequence_size <= 1:
        if mpu is None:
            groups.forget_sequence_parallel()
        return None
    if mpu is not None:
        raise ValueError("sequence_parallel_size in the ds_config cannot be combined with an mpu that has no "
                         "sequence-parallel group (pipeline or model parallelism with Ulysses is not supported)")
    topology = sequence_parallel_topology(comm.get_world_size(), sequence_size)
    data = groups.initialize(topology)
    return SequenceParallelGroups(groups._get_sequence_parallel_group(), groups._get_sequence_data_parallel_group(),
                                  data.group, sequence_size, topology.get_dim("data"))


def _from_mpu(mpu: Any) -> SequenceParallelGroups:
    sp_group, seq_dp_group = mpu.get_sequence_parallel_group(), mpu.get_sequence_data_parallel_group()
    groups.adopt_sequence_parallel(sp_group, seq_dp_group)
    sp_size = comm.get_world_size(sp_group)
    dp_size = comm.get_world_size(seq_dp_group) // sp_size
    # DeepSpeed's ALST mpu has no data-parallel group; its layout is the (data, sequence) grid.
    topology = sequence_parallel_topology(comm.get_world_size(), sp_size)
    data = groups.create_axis_group(topology, "data", groups.DATA_PARALLEL)
    return SequenceParallelGroups(sp_group, seq_dp_group, data.group, sp_size, dp_size)
