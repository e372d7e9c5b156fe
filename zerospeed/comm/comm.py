"""Process-group setup and one small function per collective, each through the comms logger.

Every collective the runtime issues goes through a function here, so a test (or a user, with the
`comms_logger` block) can see the op, the group size and the bytes of each call. Where a backend
lacks a native op the function falls back to an equivalent built from ops it has; the fallback is
chosen per backend once, by trying the native op.

[Note: gloo temporaries] torch's gloo backend runs a reduce-scatter as an all-reduce of a fresh
clone of the whole input, then copies this rank's slice out, and an all-gather through a fresh
staging buffer as large as the whole output, then copies each rank's slice in (ProcessGroupGloo.cpp).
Each adds its full size to the peak RSS and, on a CPU, first-touch page faults on every call
(thousands per step, on some steps and not others: jitter), where an in-place all-reduce allocates
nothing. Measured on 2 ranks x 28 MB: the reduce-scatter takes 3x and the all-gather 1.3x the time
of an in-place all-reduce of the same bytes. So a caller that owns a buffer it may overwrite uses the
in-place forms here, which on other backends are the native collectives:
* a reduce-scatter into this rank's own slice of the input (`reduce_scatter_rows_`) is, on gloo, the
  all-reduce alone (the same algorithm on the same data: the same sums, bit for bit);
* `all_gather_in_place` is one bitwise-OR (on NCCL integer-sum) all-reduce of a buffer zero outside
  this rank's pieces;
* `all_gather_rows_in_place` is, on gloo, one in-place broadcast per row from the rank that owns
  it: no staging at all. It first gathered in column chunks through gloo's all-gather (a 16 MiB
  staging buffer per chunk); those buffers, allocated and freed on gloo's threads, left 100-300
  MiB of freed heap resident after every step (glibc's arenas keep it), which on the vocab50k
  GPT, whose large activations are mmapped and never reuse it, sat under every forward's peak
  (issue 33). The broadcasts move the same bytes and are faster: 2 ranks, [2, n] fp32 rows with n
  = 3.6M / 13.25M / 24.8M (wide4 / vocab50k / wide10 partitions), 6-21 / 27-36 / 41-46 ms a call
  against 14-56 / 68-163 / 102-185 ms for the chunked all-gather (8 calls each, under load).
"""

from __future__ import annotations

import datetime
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from zerospeed.comm import exit_teardown
from zerospeed.comm.comms_logger import comms_logger, logged
from zerospeed.utils import heartbeat

ReduceOp = dist.ReduceOp
_DEFAULT_TIMEOUT_MIN = 10

# torch >= 2.12 renamed the tensor collectives; prefer the new names where they exist.
_all_gather_native = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_native = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_backends_without_reduce_scatter: set[str] = set()


def default_timeout() -> datetime.timedelta:
    return datetime.timedelta(minutes=int(os.environ.get("DEEPSPEED_TIMEOUT", _DEFAULT_TIMEOUT_MIN)))


# --- setup ---------------------------------------------------------------------------------

def is_available() -> bool:
    return dist.is_available()


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _discover_from_mpi_or_slurm(distributed_port: int) -> None:
    """Fill RANK / WORLD_SIZE / LOCAL_RANK / MASTER_* from Open MPI, MPICH or SLURM variables."""
    env = os.environ
    sources = (
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
        ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
        ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    )
    for rank_key, size_key, local_key in sources:
        if rank_key in env and size_key in env:
            env.setdefault("RANK", env[rank_key])
            env.setdefault("WORLD_SIZE", env[size_key])
            env.setdefault("LOCAL_RANK", env.get(local_key, "0"))
            break
    if "MASTER_ADDR" not in env and "SLURM_JOB_NODELIST" in env:
        env["MASTER_ADDR"] = _first_slurm_host(env["SLURM_JOB_NODELIST"])
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", str(distributed_port))


def _first_slurm_host(nodelist: str) -> str:
    """'node[03-05,7],gpu1' -> 'node03'."""
    head = nodelist.split(",")[0]
    if "[" not in head:
        return head
    prefix, ranges = head.split("[", 1)
    return prefix + ranges.split("-")[0].split(",")[0].rstrip("]")


_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True,
                     timeout: datetime.timedelta | None = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config: Any = None,
                     rank: int = -1, world_size: int = -1) -> None:
    """Initialize torch.distributed from the launcher's environment (or MPI / SLURM variables).

    A process group the user already created is adopted as is. With no launcher environment at
    all, a single-process group is created so the same code path runs at world size 1.
    """
    if not is_initialized() and dist_init_required is not False:
        _create_default_group(dist_backend, auto_mpi_discovery, distributed_port, verbose, timeout,
                              init_method, rank, world_size)
    if is_initialized():
        exit_teardown.register()  # [Note: gloo exit abort]


def _create_default_group(dist_backend: str | None, auto_mpi_discovery: bool, distributed_port: int,
                          verbose: bool, timeout: datetime.timedelta | None, init_method: str | None,
                          rank: int, world_size: int) -> None:
    from zerospeed.accelerator import get_accelerator

    backend = dist_backend or get_accelerator().communication_backend_name()
    if auto_mpi_discovery and rank < 0 and not all(k in os.environ for k in _LAUNCH_VARS):
        _discover_from_mpi_or_slurm(distributed_port)
    if rank < 0 and "RANK" not in os.environ and init_method is None:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    kwargs: dict[str, Any] = {"backend": backend, "timeout": timeout or default_timeout()}
    if init_method is not None:
        kwargs["init_method"] = init_method
    if rank >= 0:
        kwargs["rank"] = rank
    if world_size > 0:
        kwargs["world_size"] = world_size
    dist.init_process_group(**kwargs)
    if verbose and get_rank() == 0:
        from zerospeed.utils.logging import logger

        logger.info("Initialized torch.distributed: backend=%s world_size=%d", backend, get_world_size())


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def destroy_process_group(group: Any = None) -> None:
    """Destroy ``group`` (all groups by default), after a barrier on gloo.

    A barrier first (on gloo) means every rank's earlier work on the group is done and the
    workers' last job, the barrier, holds no Python tensors, so no worker thread still needs the GIL
    when the interpreter finalizes ([Note: gloo exit abort] in exit_teardown.py; measured before
    the exit teardown existed: 2 of 20 runs of one stage-0 step on 2 ranks aborted at exit without
    the barrier, 0 of 40 with it). destroy_process_group is collective anyway (torch's docs: every
    rank calls it); during an exception's clean-up the barrier is skipped.
    """
    member = group is not dist.GroupMember.NON_GROUP_MEMBER  # torch's destroy ignores non-members
    # While an exception propagates (a `finally:` or `except:` clean-up), the other ranks may be
    # blocked in a collective this rank will never join: a barrier would hang both instead of
    # letting this rank exit, which is what makes the job fail fast.
    failing = sys.exc_info()[0] is not None
    if is_initialized() and member and not failing and dist.get_backend(group) == "gloo":
        barrier(group)
    dist.destroy_process_group(group)


def configure(config: Any = None, enabled: bool | None = None, prof_all: bool | None = None,
              prof_ops: list[str] | None = None, verbose: bool | None = None,
              debug: bool | None = None) -> None:
    """Set the comms logger from a `comms_logger` config section and/or explicit overrides."""
    if config is not None:
        comms_logger.configure(config.enabled, config.verbose, config.prof_all, config.prof_ops, config.debug)
    comms_logger.configure(enabled, verbose, prof_all, prof_ops, debug)


def log_summary() -> None:
    if get_rank() == 0:
        print(comms_logger.summary(), flush=True)


# --- group queries -------------------------------------------------------------------------

def get_rank(group: Any = None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group: Any = None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def get_world_group() -> Any:
    return dist.group.WORLD


def new_group(ranks: list[int] | None = None, **kwargs: Any) -> Any:
    return dist.new_group(ranks, **kwargs)


def get_global_rank(group: Any, group_rank: int) -> int:
    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


# --- collectives ---------------------------------------------------------------------------

@logged("all_reduce", lambda tensor, *a, **k: tensor)
def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


@logged("broadcast", lambda tensor, *a, **k: tensor)
def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


@logged("all_gather_into_tensor", lambda output, *a, **k: output)
def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group: Any = None,
                           async_op: bool = False) -> Any:
    """Gather equal-sized `input` shards of every rank into `output`, in rank order."""
    return _all_gather_native(output, input, group=group, async_op=async_op)


@logged("all_gather_into_tensor", lambda rows, *a, **k: rows)
def all_gather_rows_in_place(rows: torch.Tensor, group: Any = None) -> None:
    """`rows` ([world size, n], each row contiguous): every rank's row r of its own `rows` holds
    rank r's shard; afterwards every rank holds all rows. Synchronous. Logged as the equivalent
    all_gather_into_tensor. On gloo one broadcast per row ([Note: gloo temporaries])."""
    rank = dist.get_rank(group)
    if dist.get_backend(group) == "gloo":
        for owner in range(rows.shape[0]):
            dist.broadcast(rows[owner], src=get_global_rank(group, owner), group=group)
    elif rows.is_contiguous():
        _all_gather_native(rows.view(-1), rows[rank], group=group)
    else:
        dist.all_gather(list(rows.unbind(0)), rows[rank].clone(), group=group)


@logged("reduce_scatter_tensor", lambda output, input, *a, **k: input)
def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op: Any = ReduceOp.SUM,
                          group: Any = None, async_op: bool = False) -> Any:
    """Reduce `input` over the group and leave rank r's r-th equal slice in `output`.

    `output` may be this rank's slice of `input` (in place, as NCCL defines it); the rest of
    `input` is then left undefined. Falls back to all_reduce + slice on a backend without a native
    reduce-scatter. Note for overlap code: on gloo, the async handle's `is_completed()` stays
    False after `wait()` and it has no future, so callers must only ever `wait()` on it.
    """
    backend = dist.get_backend(group)
    if backend == "gloo" and _is_own_slice(output, input, dist.get_rank(group)):
        return dist.all_reduce(input, op=op, group=group, async_op=async_op)  # [Note: gloo temporaries]
    if backend not in _backends_without_reduce_scatter:
        try:
            return _reduce_scatter_native(output, input, op=op, group=group, async_op=async_op)
        except RuntimeError as error:
            if "not supported" not in str(error) and "not implemented" not in str(error).lower():
                raise
            _backends_without_reduce_scatter.add(backend)
    return _reduce_scatter_by_all_reduce(output, input, op, group)


def _is_own_slice(output: torch.Tensor, input: torch.Tensor, rank: int) -> bool:
    if output.dtype != input.dtype or not (output.is_contiguous() and input.is_contiguous()):
        return False
    return output.data_ptr() == input.data_ptr() + rank * output.numel() * output.element_size()


def _reduce_scatter_by_all_reduce(output: torch.Tensor, input: torch.Tensor, op: Any, group: Any) -> None:
    reduced = input.clone()
    dist.all_reduce(reduced, op=op, group=group)
    rank = dist.get_rank(group)
    output.copy_(reduced.view(-1).narrow(0, rank * output.numel(), output.numel()).view_as(output))


def reduce_scatter_fn(output: torch.Tensor, input: torch.Tensor, op: Any = ReduceOp.SUM,
                      group: Any = None, async_op: bool = False) -> Any:
    """DeepSpeed's name for reduce_scatter_tensor."""
    return reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)


def prefers_in_place(group: Any = None) -> bool:
    """Whether `group`'s collectives are cheaper as the in-place all-reduce forms ([Note: gloo
    temporaries]). Only a cost choice: the in-place forms are correct on every backend."""
    return dist.get_backend(group) == "gloo"


def reduce_scatter_rows_(rows: torch.Tensor, group: Any = None, async_op: bool = False) -> tuple[Any, torch.Tensor]:
    """Sum `rows` (`[world_size, n]`, contiguous) over the group: (work, this rank's row of the sum, a
    view of `rows`). `rows` may be overwritten: the reduce-scatter is in place, into this rank's row
    (on gloo the all-reduce alone, [Note: gloo temporaries])."""
    mine = rows[dist.get_rank(group)]
    return reduce_scatter_tensor(mine, rows.view(-1), group=group, async_op=async_op), mine


# backends with a bitwise-OR reduction (NCCL has none)
_BACKENDS_WITH_BITWISE_OR = frozenset({"gloo", "mpi"})


def in_place_gather_op(backend: str) -> Any:
    """The reduction `all_gather_in_place` all-reduces with: bitwise OR where the backend has it, else
    an integer sum, which is as exact, as each element has one non-zero summand."""
    return ReduceOp.BOR if backend in _BACKENDS_WITH_BITWISE_OR else ReduceOp.SUM


@logged("all_gather_in_place", lambda flat, *a, **k: flat)
def all_gather_in_place(flat: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    """Each rank has written its own pieces of `flat` and zeros everywhere else; afterwards every rank
    holds every piece. One all-reduce of `flat`'s integer view (`in_place_gather_op`: bitwise OR, or
    integer sum on NCCL), so the bits are exact (-0.0 and NaN included), where a float sum would turn
    -0.0 into 0.0. `flat`: contiguous, 1-D, on any backend."""
    bits = flat.view(torch.uint8)
    if bits.numel() % 4 == 0:
        bits = bits.view(torch.int32)
    op = in_place_gather_op(dist.get_backend(group))
    return dist.all_reduce(bits, op=op, group=group, async_op=async_op)


@logged("all_to_all_single", lambda output, input, *a, **k: input)
def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None, group: Any = None,
                      async_op: bool = False) -> Any:
    return dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                  group=group, async_op=async_op)


@logged("send", lambda tensor, *a, **k: tensor)
def send(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> None:
    dist.send(tensor, dst=dst, group=group, tag=tag)


@logged("recv", lambda tensor, *a, **k: tensor)
def recv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0) -> Any:
    return dist.recv(tensor, src=src, group=group, tag=tag)


@logged("isend", lambda tensor, *a, **k: tensor)
def isend(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> Any:
    return dist.isend(tensor, dst=dst, group=group, tag=tag)


@logged("irecv", lambda tensor, *a, **k: tensor)
def irecv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0) -> Any:
    return dist.irecv(tensor, src=src, group=group, tag=tag)


def barrier(group: Any = None) -> None:
    if is_initialized():
        with heartbeat.collective("barrier"), comms_logger.timed("barrier", get_world_size(group), 0, False):
            dist.barrier(group=group)
