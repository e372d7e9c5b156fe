"""Checkpoint files of Mixture-of-Experts models, in DeepSpeed's layout.

[Note: MoE checkpoint layout]
Besides the usual files, a checkpoint of a model with `MoE` layers holds
    <tag>/layer_<l>_expert_<e>_mp_rank_00_model_states.pt   one per MoE layer l and *global* expert e
    <tag>/expp_rank_<r>_mp_rank_00_optim_states.pt          stage 0: {"optimizer": state} per expert-parallel rank
                                                             (fp32: the torch optimizer's state dict, as DeepSpeed)
Layer l counts the `MoE` modules in `named_modules()` order. An expert file holds that expert's
entries of the module state dict under their full names, with the local expert index replaced by
the global one (`...deepspeed_experts.<e>.weight`), and is written by the ranks whose
expert-data-parallel rank is 0. The model-states file holds every other entry (gate included) and
`num_experts`. Because experts are named by global id, a checkpoint loads at any expert-parallel
size: each rank reads the files of the experts it now holds (`expert_states_for_rank`). The stage-0
optimizer files are per expert-parallel rank, so that optimizer state needs the saved ep size; stage-1/2
optim files reshard ([Note: MoE stage-1/2 reshard] in moe_reshard.py). At ZeRO 3
the expert files are written from weights each expert-data-parallel group gathers first, and the
weights load from the ZeRO partitions, resharded by global expert id ([Note: MoE stage-3 reshard]).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

import torch

from zerospeed.checkpoint.context import CheckpointContext
from zerospeed.comm.run_groups import ExpertGroups

__all__ = ["check_optimizer_topology", "check_stage_crossing", "expert_data_rank_lists", "expert_file_name", "expert_states_for_rank", "load_moe_optimizer", "loads_moe_optimizer_files", "merge_expert_states", "moe_modules",
           "optim_file_name", "save_moe_files", "stage0_optimizer_file_entry", "saved_expert_files", "split_expert_states", "strip_expert_states"]

_LOCAL = ".deepspeed_moe.experts.deepspeed_experts."
EP_SIZES_KEY = "zs_moe_ep_sizes"  # ours, in the model-states file: {expert group name: ep size} at save
# ours too: {ep size: for each ep rank, the ranks holding its experts, in expert-data-parallel order}
EXPERT_DATA_RANKS_KEY = "zs_moe_expert_data_ranks"


def expert_file_name(layer_id: int, expert_id: int, mp_rank: int = 0) -> str:
    return f"layer_{layer_id}_expert_{expert_id}_mp_rank_{mp_rank:02d}_model_states.pt"


def optim_file_name(ep_rank: int, mp_rank: int = 0) -> str:
    return f"expp_rank_{ep_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def moe_modules(module: torch.nn.Module) -> list[tuple[str, Any]]:
    """(name, MoE module) in named_modules order: index = the checkpoint's layer id."""
    from zerospeed.moe.layer import MoE

    return [(name, child) for name, child in module.named_modules() if isinstance(child, MoE)]


def split_expert_states(module: torch.nn.Module, state_dict: dict[str, Any], ep_rank_of: Any) -> tuple[
        dict[str, Any], dict[str, tuple[str, dict[str, Any]]]]:
    """(state dict without expert entries, {file name: (expert group, that expert's entries under global
    ids)})."""
    rest = dict(state_dict)
    files: dict[str, tuple[str, dict[str, Any]]] = {}
    for layer_id, (name, moe) in enumerate(moe_modules(module)):
        base = (f"{name}." if name else "") + _LOCAL[1:]
        first_global = ep_rank_of(moe.expert_group_name) * moe.num_local_experts
        for key in [k for k in rest if k.startswith(base)]:
            local_id, tail = key[len(base):].split(".", 1)
            global_id = first_global + int(local_id)
            entries = files.setdefault(expert_file_name(layer_id, global_id), (moe.expert_group_name, {}))[1]
            entries[f"{base}{global_id}.{tail}"] = rest.pop(key).detach().clone()
    return rest, files


def expert_states_for_rank(module: torch.nn.Module, tag_dir: str, ep_rank_of: Any, load: Any) -> dict[str, Any]:
    """This rank's expert entries, under local names, read from the global-id files."""
    states: dict[str, Any] = {}
    for layer_id, (name, moe) in enumerate(moe_modules(module)):
        base = (f"{name}." if name else "") + _LOCAL[1:]
        for local_id in range(moe.num_local_experts):
            global_id = ep_rank_of(moe.expert_group_name) * moe.num_local_experts + local_id
            path = os.path.join(tag_dir, expert_file_name(layer_id, global_id))
            if not os.path.isfile(path):
                raise FileNotFoundError(f"MoE checkpoint file {path} is missing: layer {layer_id} has no expert "
                                        f"{global_id} (the checkpoint holds fewer experts than this model)")
            for key, tensor in load(path).items():
                states[key.replace(f"{base}{global_id}.", f"{base}{local_id}.", 1)] = tensor
    return states


def saved_expert_files(tag_dir: str) -> list[str]:
    pattern = re.compile(r"layer_\d+_expert_\d+_mp_rank_\d+_model_states\.pt")
    return sorted(f for f in os.listdir(tag_dir) if pattern.fullmatch(f))


# --- what the one save / load sequence calls (weight_files.py) ------------------------------

def _ep_rank_of(ctx: CheckpointContext) -> Callable[[str], int]:
    """Expert group name -> this rank's expert-parallel rank there, from the run's groups ([Note: run
    groups] in comm/run_groups.py)."""
    from zerospeed import comm

    return lambda group_name: comm.get_rank(ctx.run_groups.expert(group_name).expert_parallel.group)


def _largest_expert_groups(ctx: CheckpointContext) -> ExpertGroups:
    """The run's expert groups of its largest ep size (DeepSpeed's `_get_max_expert_size_name`)."""
    return max(ctx.run_groups.experts.values(), key=lambda expert: expert.ep_size)


def strip_expert_states(ctx: CheckpointContext, model_states: dict[str, Any], module_key: str) -> None:
    """The model-states file keeps non-expert entries only, plus DeepSpeed's `num_experts` and our ep sizes."""
    model_states[module_key], _ = split_expert_states(ctx.module, model_states[module_key], _ep_rank_of(ctx))
    model_states["num_experts"] = ctx.num_experts
    model_states[EP_SIZES_KEY] = {moe.expert_group_name: moe.ep_size for _, moe in moe_modules(ctx.module)}
    # every size of the run: the stage-0 `expp_rank` files follow the largest one's ranks
    sizes = {expert.ep_size for expert in ctx.run_groups.experts.values()}
    data_before = bool(ctx.ds_config.get("use_data_before_expert_parallelism", False))
    model_states[EXPERT_DATA_RANKS_KEY] = {size: expert_data_rank_lists(size, data_before)
                                           for size in sizes | set(model_states[EP_SIZES_KEY].values())}


def expert_data_rank_lists(ep_size: int, data_before_expert: bool) -> list[list[int]]:
    """For each expert-parallel rank, the ranks that hold its experts (its expert-data-parallel group)."""
    from zerospeed import comm
    from zerospeed.comm.topology import expert_rank_lists

    world_size = comm.get_world_size()
    ep_rank = {r: group.index(r) for group in expert_rank_lists(world_size, ep_size, 1, data_before_expert)[0]
               for r in group}
    return [[r for r in range(world_size) if ep_rank[r] == p] for p in range(ep_size)]


def save_moe_files(ctx: CheckpointContext, transaction: Any, optimizer_entry: Any) -> None:
    """Expert files (by expert-data-parallel rank 0 of each group) and, where the optimizer state is
    replicated (stage 0), the per-ep-rank optimizer file ([Note: MoE checkpoint layout])."""
    from zerospeed import comm

    for file_name, (group_name, entries) in _expert_files(ctx).items():
        if comm.get_rank(ctx.run_groups.expert(group_name).expert_data_parallel.group) == 0:
            transaction.write(file_name, entries)
    largest = _largest_expert_groups(ctx)
    if optimizer_entry is not None and comm.get_rank(largest.expert_data_parallel.group) == 0:
        transaction.write(optim_file_name(_ep_rank_of(ctx)(largest.name)), {"optimizer": optimizer_entry})


def _expert_files(ctx: CheckpointContext) -> dict[str, tuple[str, dict[str, Any]]]:
    """Each expert's entries with full weights: where they are partitioned (ZeRO-3) each
    expert-data-parallel group gathers its experts first ([Note: MoE at stage 3]; every rank calls
    this, each in its group). The entries are copied while gathered."""
    experts = [p for _, moe in moe_modules(ctx.module) for p in moe.deepspeed_moe.experts.parameters()]
    with ctx.optimizer.gathered_parameters(experts):
        _, files = split_expert_states(ctx.module, ctx.module.state_dict(), _ep_rank_of(ctx))
    return files


def merge_expert_states(ctx: CheckpointContext, tag_dir: str, module_state: dict[str, Any],
                        load: Any) -> dict[str, Any]:
    """`module_state` (from the model-states file) plus this rank's experts from their files."""
    return {**module_state, **expert_states_for_rank(ctx.module, tag_dir, _ep_rank_of(ctx), load)}


def check_stage_crossing(ctx: CheckpointContext, saved_stage: int, tag_dir: str, model_state: dict[str, Any]) -> None:
    """Which MoE checkpoints cross between stage 3 and stages 0-2 ([Note: MoE stage crossing]): ours from
    stage 3 into any stage and from stages 1-2 into stage 3 do; a stage-0 one into stage 3 and one without
    our expert rank layout (DeepSpeed's) into stage 3 do not."""
    stage3 = bool(ctx.optimizer.weights_in_optimizer_files)
    if not stage3 or saved_stage == 3:
        return
    if saved_stage == 0:
        raise ValueError(f"checkpoint {tag_dir} of an MoE model was saved at zero_optimization.stage 0 and this run "
                         "is at stage 3: a stage-0 MoE checkpoint keeps its optimizer state per expert-parallel rank "
                         "in expp_rank_* files without parameter names, which stage 3 cannot partition; load it at "
                         "stage 0-2, save at stage 1 or 2, and load that at stage 3")
    if not model_state.get(EP_SIZES_KEY):
        raise ValueError(f"checkpoint {tag_dir} of an MoE model has no '{EP_SIZES_KEY}' (not saved by zerospeed, "
                         "e.g. DeepSpeed's): its experts' optimizer partitions cannot be named by global expert id, so "
                         "it loads at stages 0-2 only")


def check_optimizer_topology(ctx: CheckpointContext, saved_stage: int, tag_dir: str,
                             model_state: dict[str, Any]) -> bool:
    """Whether the optimizer state of an MoE checkpoint saved at stages 0-2 must be resharded through the
    full state ([Note: MoE stage-1/2 reshard]); raises where it cannot be. Expert weights load at any
    size. Stage 3 reshards on its own ([Note: MoE stage-3 reshard])."""
    if ctx.optimizer.weights_in_optimizer_files:
        return False
    saved_sizes = model_state.get(EP_SIZES_KEY)
    sizes = {moe.expert_group_name: moe.ep_size for _, moe in moe_modules(ctx.module)}
    saved_world = model_state.get("dp_world_size", ctx.dp_world_size)
    partitioned = ctx.optimizer.checkpoint_files(ctx.dp_rank, ctx.mp_rank).optim_states is not None
    if not ((saved_sizes is not None and saved_sizes != sizes) or (partitioned and saved_world != ctx.dp_world_size)):
        return False
    # ours, saved and loaded at 1/2, one ep size: every rank's optim file names its experts' fragments
    single_size = len(set((saved_sizes or {}).values())) == 1
    if partitioned and saved_stage in (1, 2) and single_size and model_state.get(EXPERT_DATA_RANKS_KEY):
        return True
    advice = ("expert weights reshard; optimizer states of MoE models reshard at stages 1-2 only from a "
              "zerospeed stage-1/2 checkpoint with one expert-parallel size; load with "
              "load_optimizer_states=False (or load_module_only=True)")
    raise ValueError(f"checkpoint {tag_dir} was saved at stage {saved_stage} with expert-parallel sizes {saved_sizes} "
                     f"on {saved_world} data-parallel ranks, this run has {sizes} on {ctx.dp_world_size}: {advice}")


def loads_moe_optimizer_files(ctx: CheckpointContext) -> bool:
    """Whether this run's optimizer state is in the per-ep-rank files (replicated state: stage 0)."""
    return ctx.optimizer.checkpoint_files(ctx.dp_rank, ctx.mp_rank).optim_states is None


def load_moe_optimizer(ctx: CheckpointContext, tag_dir: str, load: Any) -> None:
    """Replicated state: this rank's optimizer state is its expert-parallel rank's file, not rank 0's."""
    from zerospeed.checkpoint.zero_checkpoint import stage0_wrapper_state

    path = os.path.join(tag_dir, optim_file_name(_ep_rank_of(ctx)(_largest_expert_groups(ctx).name)))
    # DeepSpeed's fp32 layout (the torch optimizer's state dict) or the unfused low-precision one
    state = stage0_wrapper_state(ctx, load(path)["optimizer"])
    ctx.optimizer.load_state_dict(state, load_optimizer_states=True)
    if "fp32_groups" not in state:   # no masters saved: re-derived from the loaded weights
        ctx.optimizer.refresh_fp32_params()


def stage0_optimizer_file_entry(ctx: CheckpointContext, wrapper_entry: Any) -> Any:
    """What the replicated-state `expp_rank` file holds: in fp32 the torch optimizer's state dict, as
    DeepSpeed writes it (its bare optimizer), so each library loads the other's; in fp16/bf16 our
    wrapper's."""
    replicated = ctx.optimizer.replicated_state(ctx.param_names)
    if wrapper_entry is None or replicated is None or replicated.fp32_masters:
        return wrapper_entry
    return {"state": wrapper_entry["state"], "param_groups": wrapper_entry["param_groups"]}
