"""Mixture-of-Experts checkpoints at another world or expert-parallel size (stage 3, and stages 1/2).

[Note: MoE stage-3 reshard]
In a stage-3 checkpoint every rank's optim file holds its chunk of each parameter's fp32 master and
moments: a dense parameter is cut into ceil(numel / W) chunks over all W ranks, an expert parameter
into ceil(numel / (W / ep)) chunks over its expert-data-parallel group (the ranks that hold the same
experts), and both under the *local* names of the saving rank: its `deepspeed_experts.<l>` is global
expert `ep_rank * local experts + l`. To load at another world or ep size, the export reads every
file with each parameter's own partition size and renames experts by the saving rank's ep rank (from
the rank layout recorded in `zs_moe_expert_data_ranks`, else DeepSpeed's default: rank r holds ep
rank r % ep's experts), giving the full state under global names ([Note: full layout]); the import
cuts each parameter of this rank by its own partition group and global name. The generic stage-3
exporter and importer do the work, given these names and partition sizes.

[Note: MoE stage crossing]
The same naming carries MoE checkpoints between stage 3 and stages 0-2. Stage-1/2 optim files also
hold each expert parameter under the saving rank's local name, its fragments spread over the ranks
of its expert-data-parallel group in rank order: `export_zero12` renames them by the saving rank's
ep rank, so either export gives the full state under global names, and every importer (stages 0,
1/2, 3) looks an expert parameter up by its global name (`full_state_names`) and, at 1/2, cuts it by
the rank of its own param group's partition group. The expert files (whole weights by global id,
at every stage) load as before. Not crossed: stage-0 files (per ep rank, unnamed torch optimizer
state) into stage 3, and checkpoints without our rank layout (DeepSpeed's) into stage 3.

[Note: MoE stage-1/2 reshard]
The same path reshards a stage-1/2 MoE checkpoint loaded at stages 1/2 on another data-parallel world
size or expert-parallel size: `check_optimizer_topology` (moe_checkpoint.py) sees the layout differ,
every rank reads every saved rank's optim file into the full state (`export_zero12`, experts renamed
by the saving rank's ep rank from `zs_moe_expert_data_ranks`) and the ZeRO 1/2 wrapper's `load_full_state` cuts dense
parameters over the new data-parallel group and each expert over its new expert-data-parallel group.
An ep-size change at the same world size needs this too: the own-file load would hand each rank
partitions of other experts. Refused still (a `ValueError`): several ep sizes in one model, checkpoints
without our rank layout (DeepSpeed's), and stage 0 at another ep size (per-ep-rank `expp_rank` files).
DeepSpeed needs its universal checkpoint for such a change.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from zerospeed.comm.run_groups import RunGroups

__all__ = ["Zero3Naming", "full_state_names", "import_coords", "saved_naming"]

_EXPERT_KEY = ".deepspeed_moe.experts.deepspeed_experts."
EP_SIZES_KEY = "zs_moe_ep_sizes"
EXPERT_DATA_RANKS_KEY = "zs_moe_expert_data_ranks"


@dataclasses.dataclass(frozen=True)
class Zero3Naming:
    """How a saved stage-3 file names and partitions its parameters: `partition_world(name)` ranks
    share a parameter, `rename(rank, name)` is its name in the full state."""

    partition_world: Callable[[str], int]
    rename: Callable[[int, str], str]


def _local_experts_per_layer(names: list[str]) -> dict[str, int]:
    """MoE layer prefix -> experts per rank, from the local ids in the names (same on every rank)."""
    counts: dict[str, int] = {}
    for name in names:
        if _EXPERT_KEY in name:
            prefix, tail = name.split(_EXPERT_KEY, 1)
            counts[prefix] = max(counts.get(prefix, 0), int(tail.split(".", 1)[0]) + 1)
    return counts


def _to_global(name: str, ep_rank: int, per_layer: dict[str, int]) -> str:
    if _EXPERT_KEY not in name:
        return name
    prefix, tail = name.split(_EXPERT_KEY, 1)
    local, rest = tail.split(".", 1)
    return f"{prefix}{_EXPERT_KEY}{ep_rank * per_layer[prefix] + int(local)}.{rest}"


def saved_naming(model_state: dict[str, Any], names: list[str], world_size: int, tag_dir: str) -> Zero3Naming:
    """The naming of a stage-3 MoE checkpoint saved on `world_size` ranks."""
    sizes = sorted(set((model_state.get(EP_SIZES_KEY) or {}).values()))
    if len(sizes) != 1:
        raise ValueError(f"checkpoint {tag_dir}: resharding a stage-3 MoE checkpoint needs one expert-parallel "
                         f"size in '{EP_SIZES_KEY}', found {sizes}")
    ep_size = int(sizes[0])
    lists = (model_state.get(EXPERT_DATA_RANKS_KEY) or {}).get(ep_size) or \
        [[p + ep_size * i for i in range(world_size // ep_size)] for p in range(ep_size)]
    ep_rank_of = {rank: p for p, ranks in enumerate(lists) for rank in ranks}
    if sorted(ep_rank_of) != list(range(world_size)):
        raise ValueError(f"checkpoint {tag_dir}: its expert rank layout {lists} does not cover its {world_size} ranks")
    per_layer = _local_experts_per_layer(names)
    expert_world = world_size // ep_size
    return Zero3Naming(partition_world=lambda name: expert_world if _EXPERT_KEY in name else world_size,
                       rename=lambda rank, name: _to_global(name, ep_rank_of[rank], per_layer))


def full_state_names(param_names: dict[torch.nn.Parameter, str], run_groups: RunGroups | None) -> dict[str, str]:
    """This rank's parameter names -> their names in the full state: an expert parameter's local expert
    id replaced by its global one, every other name unchanged (the importers of every stage use it)."""
    return {name: import_coords(param, name, 1, 0, run_groups)[0] for param, name in param_names.items()}


def import_coords(param: torch.nn.Parameter, name: str, world_size: int, dp_rank: int,
                  run_groups: RunGroups | None) -> tuple[str, int, int]:
    """(name in the full state, ranks sharing the parameter, this rank's index among them): an expert
    parameter (marked by `Experts`) is renamed by global id and partitioned over its expert-data-parallel
    group, both from the run's groups (`run_groups`, [Note: run groups] in comm/run_groups.py; a ZeRO
    wrapper built directly, without them, passes None: the groups the last engine published)."""
    from zerospeed import comm
    from zerospeed.comm import groups
    from zerospeed.moe.utils import is_moe_param

    local_experts = getattr(param, "zs_num_local_experts", None)
    if not (is_moe_param(param) and _EXPERT_KEY in name and local_experts is not None):
        return name, world_size, dp_rank
    expert = groups.expert_groups(param.group_name, run_groups)  # type: ignore[attr-defined]
    group = expert.expert_data_parallel.group
    ep_rank = comm.get_rank(expert.expert_parallel.group)
    prefix = name.split(_EXPERT_KEY, 1)[0]
    return _to_global(name, ep_rank, {prefix: local_experts}), comm.get_world_size(group), comm.get_rank(group)
