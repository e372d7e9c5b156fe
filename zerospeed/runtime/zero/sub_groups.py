"""Stage 3's optimizer sub-groups as plain data: how the trainable parameters are cut into
sub-groups, and which of them `offload_optimizer` holds on the host (`ratio`).

A sub-group is one flat fp32 master and one "param" of the optimizer; its index counts across
param groups in order (sub-groups of group 0 first). Pure functions over partition sizes, so the
wrapper (stage3.py) and the host-memory check (offload/host_memory_check.py) agree without a process.
"""

from __future__ import annotations

__all__ = ["largest_sub_group_numel", "num_sub_groups_on_device", "offloaded_partition_numel", "plan_sub_groups",
           "sub_group_numels"]


def plan_sub_groups(partition_numels: list[int], sub_group_size: int) -> list[list[int]]:
    """Indices cut into runs whose partition numel first reaches `sub_group_size` (pure)."""
    groups: list[list[int]] = []
    current: list[int] = []
    total = 0
    for index, numel in enumerate(partition_numels):
        current.append(index)
        total += numel
        if total >= sub_group_size:
            groups.append(current)
            current, total = [], 0
    if current:
        groups.append(current)
    return groups


def num_sub_groups_on_device(num_sub_groups: int, ratio: float) -> int:
    """How many leading sub-groups stay on the accelerator with `offload_optimizer.ratio`.

    DeepSpeed's rule, float arithmetic and truncation included: sub-group i is offloaded iff
    `i >= int((1 - ratio) * N)`. So ratio 1 offloads all, ratio 0 none, and rounding favours
    offloading (ratio 0.9 of 10 sub-groups: `int(0.0999... * 10)` = 0, all ten offloaded).
    """
    return int((1 - ratio) * num_sub_groups)


def sub_group_numels(partition_numels_per_group: list[list[int]], sub_group_size: int) -> list[int]:
    """Elements of each of this rank's sub-groups, in sub-group order: per param group, the
    partition numels of its trainable params in order, cut as stage 3 cuts them."""
    return [sum(numels[i] for i in cut) for numels in partition_numels_per_group
            for cut in plan_sub_groups(numels, sub_group_size)]


def offloaded_partition_numel(partition_numels_per_group: list[list[int]], sub_group_size: int,
                              ratio: float) -> int:
    """Elements of this rank's partition in offloaded sub-groups (the last ones)."""
    sizes = sub_group_numels(partition_numels_per_group, sub_group_size)
    return sum(sizes[num_sub_groups_on_device(len(sizes), ratio):])


def largest_sub_group_numel(partition_numels_per_group: list[list[int]], sub_group_size: int) -> int:
    """Elements of this rank's largest sub-group (0 without any): what one NVMe staging buffer
    must hold, since a stage-3 sub-group is swapped whole (as DeepSpeed sizes its swap buffers);
    it exceeds `sub_group_size` by less than the last parameter's partition."""
    return max(sub_group_numels(partition_numels_per_group, sub_group_size), default=0)
