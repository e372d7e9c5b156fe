"""Process groups built from a topology passed in explicitly; the one registry of which groups exist.

Every parallelism gets its groups here: the engine's data parallelism, and the pipeline, expert,
sequence and tensor-parallel features as they arrive. A caller describes the layout as a
``ProcessTopology`` (pure arithmetic, ``comm/topology.py``) and asks for the groups along one of
its axes; this module creates one process group per rank list (collectively: every rank creates
every group, in the topology's order, as torch.distributed requires) and keeps the one this rank
belongs to under a name. The accessor names are DeepSpeed's (``deepspeed/utils/groups.py``);
``zerospeed.utils.groups`` re-exports them at DeepSpeed's import path.

This module holds the only mutable module state about groups in the package (STYLE.md rule 5).
An engine builds its groups once as a frozen `RunGroups` ([Note: run groups] in run_groups.py) and
publishes it here (`publish_run_groups`): the accessors then read that value's groups. Code inside
the package is handed the value instead; only DeepSpeed-shaped entry points that cannot receive it
read the published one (ZeRO wrappers built directly, `deepspeed.checkpointing.configure`). A group whose rank list
is the whole world is the world group itself: creating a copy would cost a communicator and change
nothing.
"""

from __future__ import annotations

from typing import Any

from zerospeed.comm import comm
from zerospeed.comm.run_groups import AxisGroup, ExpertGroups, RunGroups, expert_group_name_for
from zerospeed.comm.topology import ProcessTopology, expert_rank_lists

__all__ = [
    "AxisGroup",
    "DATA_PARALLEL",
    "MODEL_PARALLEL",
    "PIPE_MODEL_PARALLEL",
    "SEQUENCE_DATA_PARALLEL",
    "SEQUENCE_PARALLEL",
    "create_axis_group",
    "create_rank_groups",
    "expert_groups",
    "get_run_groups",
    "publish_run_groups",
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_group",
    "get_model_parallel_group",
    "get_model_parallel_rank",
    "get_model_parallel_world_size",
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_src_rank",
    "get_tensor_model_parallel_world_size",
    "get_topology",
    "initialize",
    "initialize_data_parallel",
    "initialize_model_parallel",
    "initialize_sequence_parallel",
    "is_initialized",
    "reset",
    "adopt_sequence_parallel",
    "build_expert_groups",
    "forget_sequence_parallel",
    "_create_expert_and_data_parallel",
    "_get_data_parallel_group",
    "_get_data_parallel_rank",
    "_get_data_parallel_world_size",
    "_get_expert_data_parallel_group",
    "_get_expert_data_parallel_group_dict",
    "_get_expert_data_parallel_group_ranks",
    "_get_expert_data_parallel_rank",
    "_get_expert_data_parallel_world_size",
    "_get_expert_parallel_group",
    "_get_expert_parallel_group_dict",
    "_get_expert_parallel_group_ranks",
    "_get_expert_parallel_rank",
    "_get_expert_parallel_world_size",
    "_get_max_expert_parallel_group",
    "_get_max_expert_size",
    "_get_max_expert_size_name",
    "_get_sequence_data_parallel_group",
    "_get_sequence_data_parallel_rank",
    "_get_sequence_data_parallel_world_size",
    "_get_sequence_parallel_group",
    "_init_tp_mesh_device",
    "_get_sequence_parallel_rank",
    "_get_sequence_parallel_world_size",
]

DATA_PARALLEL = "data_parallel"
MODEL_PARALLEL = "model_parallel"
SEQUENCE_PARALLEL = "sequence_parallel"
SEQUENCE_DATA_PARALLEL = "sequence_data_parallel"
PIPE_MODEL_PARALLEL = "pipe_model_parallel"   # a pipeline's ranks sharing one data coordinate


# --- the registry (the only module state about groups) -----------------------------------------

_groups: dict[str, AxisGroup] = {}
_expert_groups: dict[str, AxisGroup] = {}       # "ep_size_<n>" -> expert-parallel group
_expert_data_groups: dict[str, AxisGroup] = {}  # "ep_size_<n>" -> expert-data-parallel group
_topology: ProcessTopology | None = None
_run: RunGroups | None = None                   # the last engine's groups ([Note: run groups])


def reset() -> None:
    """Forget every registered group (tests; a new process group after destroy_process_group)."""
    global _topology, _run
    _groups.clear()
    _expert_groups.clear()
    _expert_data_groups.clear()
    _topology = None
    _run = None


def publish_run_groups(run: RunGroups) -> None:
    """Make an engine's frozen groups the current ones: the accessors read them from here on."""
    global _run
    _groups[DATA_PARALLEL] = run.data_parallel
    if run.tensor_parallel is not None:
        _groups[MODEL_PARALLEL] = run.tensor_parallel
    if run.sequence_parallel is not None:
        _groups[SEQUENCE_PARALLEL] = run.sequence_parallel
        _groups[SEQUENCE_DATA_PARALLEL] = run.sequence_data_parallel
    if run.pipe_model_parallel is not None:
        _groups[PIPE_MODEL_PARALLEL] = run.pipe_model_parallel
    for name, expert in run.experts.items():
        _expert_groups[name], _expert_data_groups[name] = expert.expert_parallel, expert.expert_data_parallel
    _run = run


def get_run_groups() -> RunGroups | None:
    """The groups of the last engine built in this process (None before one)."""
    return _run


def expert_groups(group_name: str, run: RunGroups | None = None) -> ExpertGroups:
    """The groups of an expert group ("ep_size_<n>"): from `run` when given, else from the current
    run's value, else the ones DeepSpeed's `_create_expert_and_data_parallel` built for user code
    outside an engine."""
    if run is not None:
        return run.expert(group_name)
    if _run is not None and group_name in _run.experts:
        return _run.experts[group_name]
    ep = _expert(_expert_groups, group_name, "expert parallel")
    return ExpertGroups(ep.size, ep, _expert(_expert_data_groups, group_name, "expert data parallel"))


def is_initialized(name: str = DATA_PARALLEL) -> bool:
    return name in _groups


def get_group(name: str) -> AxisGroup:
    if name not in _groups:
        raise RuntimeError(f"process group {name!r} is not initialized; groups so far: {sorted(_groups)}")
    return _groups[name]


def get_topology() -> ProcessTopology | None:
    """The topology the data-parallel groups were last built from (None before `initialize`)."""
    return _topology


# --- building ----------------------------------------------------------------------------------

def create_rank_groups(rank_lists: list[list[int]], name: str | None = None) -> AxisGroup | None:
    """Create one group per list on every rank, in order (collective); return the one holding this
    rank, None when no list holds it. A list that is the whole world is the world group itself.

    For groups that are not one axis of a topology: the pipeline's tie groups (the stages sharing a
    tied layer) and its model group. With ``name`` this rank's group is registered (``get_group``).
    """
    rank, world_size = comm.get_rank(), comm.get_world_size()
    mine: AxisGroup | None = None
    for ranks in rank_lists:
        group = comm.get_world_group() if list(ranks) == list(range(world_size)) else comm.new_group(ranks)
        if rank in ranks:
            mine = AxisGroup(group, tuple(ranks))
    if mine is not None and name is not None:
        _groups[name] = mine
    return mine


def _new_groups(rank_lists: list[list[int]]) -> AxisGroup:
    """One group per list on every rank, in order; the one holding this rank (it must be in one)."""
    mine = create_rank_groups(rank_lists)
    if mine is None:
        raise ValueError(f"rank {comm.get_rank()} is in none of the rank lists {rank_lists}")
    return mine


def _check_world(topology: ProcessTopology) -> None:
    if topology.world_size() != comm.get_world_size():
        raise ValueError(f"topology {topology!r} covers {topology.world_size()} ranks but the world size is "
                         f"{comm.get_world_size()}")


def create_axis_group(topology: ProcessTopology, axis: str, name: str | None = None) -> AxisGroup:
    """This rank's group along ``axis`` of ``topology`` (collective: every rank must call it).

    With ``name`` the group is registered for the accessors (``get_group(name)``). An axis the
    topology lacks yields this rank alone, as a size-1 axis would.
    """
    _check_world(topology)
    rank_lists = topology.get_axis_comm_lists(axis) or [[r] for r in range(topology.world_size())]
    axis_group = _new_groups(rank_lists)
    if name is not None:
        _groups[name] = axis_group
    return axis_group


def _adopt(name: str, group: Any) -> AxisGroup:
    """Register a group the user's `mpu` built (its ranks read back from torch.distributed)."""
    ranks = tuple(comm.get_global_rank(group, r) for r in range(comm.get_world_size(group)))
    _groups[name] = AxisGroup(group, ranks)
    return _groups[name]


def initialize_data_parallel(topology: ProcessTopology | None = None, mpu: Any = None) -> AxisGroup:
    """The data-parallel group: the user's ``mpu`` group, else the ``data`` axis of ``topology``.

    Without either, every rank is a data-parallel peer (a one-axis topology over the world).
    """
    global _topology
    if mpu is not None:
        return _adopt(DATA_PARALLEL, mpu.get_data_parallel_group())
    topology = topology or ProcessTopology(["data"], [comm.get_world_size()])
    _topology = topology
    return create_axis_group(topology, "data", DATA_PARALLEL)


def initialize_model_parallel(topology: ProcessTopology) -> AxisGroup:
    """The model (tensor) parallel group: the ``model`` axis of ``topology``."""
    return create_axis_group(topology, "model", MODEL_PARALLEL)


def initialize_sequence_parallel(topology: ProcessTopology) -> tuple[AxisGroup, AxisGroup]:
    """Sequence-parallel group (the ``sequence`` axis) and sequence-data-parallel group.

    The second spans the ``data`` and ``sequence`` axes together: ZeRO partitions and reduces
    gradients over it when sequence parallelism is on (DeepSpeed's
    ``_get_sequence_data_parallel_group``).
    """
    sequence = create_axis_group(topology, "sequence", SEQUENCE_PARALLEL)
    fused = _fuse_axes(topology, ("data", "sequence"))
    _groups[SEQUENCE_DATA_PARALLEL] = create_axis_group(fused, "fused")
    return sequence, _groups[SEQUENCE_DATA_PARALLEL]


def adopt_sequence_parallel(sequence_group: Any, sequence_data_group: Any) -> None:
    """Register sequence-parallel groups a user's ``mpu`` built (DeepSpeed's ALST mpu)."""
    _adopt(SEQUENCE_PARALLEL, sequence_group)
    _adopt(SEQUENCE_DATA_PARALLEL, sequence_data_group)


def forget_sequence_parallel() -> None:
    """Drop the sequence-parallel groups: a later engine without them must not see a stale size."""
    _groups.pop(SEQUENCE_PARALLEL, None)
    _groups.pop(SEQUENCE_DATA_PARALLEL, None)


def _fuse_axes(topology: ProcessTopology, axes: tuple[str, ...]) -> ProcessTopology:
    """The topology with ``axes`` (which must be adjacent, in order) merged into one axis ``fused``."""
    names = topology.get_axis_names()
    present = [a for a in axes if a in names]
    if not present:
        return ProcessTopology([*names, "fused"], [*topology.dims, 1])
    start = names.index(present[0])
    if names[start:start + len(present)] != present:
        raise ValueError(f"axes {present} must be adjacent in {names} to form one group")
    size = 1
    for axis in present:
        size *= topology.get_dim(axis)
    return ProcessTopology([*names[:start], "fused", *names[start + len(present):]],
                           [*topology.dims[:start], size, *topology.dims[start + len(present):]])


def initialize(topology: ProcessTopology | None = None, mpu: Any = None) -> AxisGroup:
    """Data-parallel groups plus every other axis ``topology`` has (``model``, ``sequence``)."""
    data = initialize_data_parallel(topology, mpu)
    if topology is not None and "model" in topology.get_axis_names():
        initialize_model_parallel(topology)
    if topology is not None and "sequence" in topology.get_axis_names():
        initialize_sequence_parallel(topology)
    return data


def _create_expert_and_data_parallel(expert_parallel_size_: int, mp_size: int | None = None,
                                     pp_size: int | None = None, mp_mode: str = "tp",
                                     use_data_before_expert_parallel_: bool = False) -> None:
    """Expert-parallel and expert-data-parallel groups named ``ep_size_<n>`` (DeepSpeed's layout).

    Collective; a second call for the same size is a no-op, as in DeepSpeed.
    """
    if mp_size not in (None, 1):
        raise NotImplementedError("expert groups with model parallelism (mp_size > 1) are not supported yet")
    build_expert_groups(expert_parallel_size_, pp_size or 1, use_data_before_expert_parallel_)


def build_expert_groups(ep_size: int, pp_size: int = 1, use_data_before_expert_parallel: bool = False) -> ExpertGroups:
    """The expert-parallel and expert-data-parallel groups of one ep size (collective), registered
    under "ep_size_<n>"; built once per size in a process, later calls get the same groups."""
    name = expert_group_name_for(ep_size)
    if name not in _expert_groups:
        lists = expert_rank_lists(comm.get_world_size(), ep_size, pp_size, use_data_before_expert_parallel)
        # DeepSpeed creates the expert-data groups first: every rank must create them in one order.
        _expert_data_groups[name] = _new_groups(lists.expert_data_parallel)
        _expert_groups[name] = _new_groups(lists.expert_parallel)
    return ExpertGroups(ep_size, _expert_groups[name], _expert_data_groups[name])


# --- DeepSpeed's accessors -------------------------------------------------------------------

def get_data_parallel_group() -> Any:
    return get_group(DATA_PARALLEL).group


def get_data_parallel_world_size() -> int:
    return len(get_group(DATA_PARALLEL).ranks)


def get_data_parallel_rank() -> int:
    return comm.get_rank(get_data_parallel_group())


def _get_data_parallel_group() -> Any:
    """The data-parallel group; the world group before the engine has built one (as DeepSpeed)."""
    return get_data_parallel_group() if is_initialized(DATA_PARALLEL) else comm.get_world_group()


def _get_data_parallel_world_size() -> int:
    return comm.get_world_size(_get_data_parallel_group())


def _get_data_parallel_rank() -> int:
    return comm.get_rank(_get_data_parallel_group())


def get_model_parallel_group() -> Any:
    return get_group(MODEL_PARALLEL).group


def get_model_parallel_world_size() -> int:
    return len(get_group(MODEL_PARALLEL).ranks) if is_initialized(MODEL_PARALLEL) else 1


def get_model_parallel_rank() -> int:
    return comm.get_rank(get_model_parallel_group()) if is_initialized(MODEL_PARALLEL) else 0


# Tensor parallelism (AutoTP) is the model-parallel axis: DeepSpeed's tensor accessors read it.
def get_tensor_model_parallel_group() -> Any:
    return get_model_parallel_group()


def get_tensor_model_parallel_world_size() -> int:
    return get_model_parallel_world_size()


def get_tensor_model_parallel_rank() -> int:
    return get_model_parallel_rank()


def get_tensor_model_parallel_src_rank() -> int:
    """The global rank of this rank's tensor-parallel group's first member."""
    return get_group(MODEL_PARALLEL).ranks[0] if is_initialized(MODEL_PARALLEL) else comm.get_rank()


def _init_tp_mesh_device(tensor_model_parallel_size: int = 1, data_parallel_size: int | None = None) -> None:
    """DeepSpeed's AutoTP grid: ``data`` x ``model`` with the model (tp) axis fastest, so the tp
    groups are consecutive ranks and the data-parallel groups strided by tp. A no-op once built."""
    if is_initialized(MODEL_PARALLEL):
        return
    from zerospeed.comm.topology import PipeModelDataParallelTopology

    world_size, tp_size = comm.get_world_size(), int(tensor_model_parallel_size)
    if tp_size < 1 or world_size % tp_size:
        raise ValueError(f"tensor parallel size {tp_size} must divide the world size {world_size}")
    dp_size = data_parallel_size or world_size // tp_size
    initialize(PipeModelDataParallelTopology(num_pp=1, num_mp=tp_size, num_dp=dp_size))


def _get_sequence_parallel_group() -> Any:
    if not is_initialized(SEQUENCE_PARALLEL):
        raise KeyError("No sequence parallel group found")
    return get_group(SEQUENCE_PARALLEL).group


def _get_sequence_parallel_world_size() -> int:
    return len(get_group(SEQUENCE_PARALLEL).ranks) if is_initialized(SEQUENCE_PARALLEL) else 1


def _get_sequence_parallel_rank() -> int:
    return comm.get_rank(_get_sequence_parallel_group()) if is_initialized(SEQUENCE_PARALLEL) else 0


def _get_sequence_data_parallel_group() -> Any:
    """Data x sequence when sequence parallelism is on, else the data-parallel group."""
    if is_initialized(SEQUENCE_DATA_PARALLEL):
        return get_group(SEQUENCE_DATA_PARALLEL).group
    return _get_data_parallel_group()


def _get_sequence_data_parallel_world_size() -> int:
    return comm.get_world_size(_get_sequence_data_parallel_group())


def _get_sequence_data_parallel_rank() -> int:
    return comm.get_rank(_get_sequence_data_parallel_group())


def _expert(table: dict[str, AxisGroup], group_name: str, what: str) -> AxisGroup:
    if group_name not in table:
        raise RuntimeError(f"{what} group {group_name!r} is not initialized; "
                           f"call _create_expert_and_data_parallel first (have: {sorted(table)})")
    return table[group_name]


def _get_expert_parallel_group(group_name: str) -> Any:
    return _expert(_expert_groups, group_name, "expert parallel").group


def _get_expert_parallel_group_ranks(group_name: str) -> list[int]:
    return list(_expert(_expert_groups, group_name, "expert parallel").ranks)


def _get_expert_parallel_group_dict() -> dict[str, Any]:
    return {name: g.group for name, g in _expert_groups.items()}


def _get_expert_parallel_world_size(group_name: str) -> int:
    return len(_expert(_expert_groups, group_name, "expert parallel").ranks)


def _get_expert_parallel_rank(group_name: str) -> int:
    return comm.get_rank(_get_expert_parallel_group(group_name))


def _get_expert_data_parallel_group(group_name: str) -> Any:
    return _expert(_expert_data_groups, group_name, "expert data parallel").group


def _get_expert_data_parallel_group_ranks(group_name: str) -> list[int]:
    return list(_expert(_expert_data_groups, group_name, "expert data parallel").ranks)


def _get_expert_data_parallel_group_dict() -> dict[str, Any]:
    return {name: g.group for name, g in _expert_data_groups.items()}


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    return len(_expert(_expert_data_groups, group_name, "expert data parallel").ranks)


def _get_expert_data_parallel_rank(group_name: str) -> int:
    return comm.get_rank(_get_expert_data_parallel_group(group_name))


def _get_max_expert_size() -> int | None:
    sizes = [int(name.split("_")[2]) for name in _expert_groups]
    return max(sizes) if sizes else None


def _get_max_expert_size_name() -> str:
    return f"ep_size_{_get_max_expert_size()}"


def _get_max_expert_parallel_group() -> Any:
    return _get_expert_parallel_group(_get_max_expert_size_name())
