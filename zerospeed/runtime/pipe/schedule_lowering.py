"""Schedules beyond DeepSpeed's, built from a compute order: GPipe and interleaved 1F1B.

A schedule here is written as what it is: each rank's order of compute operations
(`ComputeOp`: forward or backward of one micro-batch on one model chunk). `lower()` turns the
orders of all ranks into instruction streams in three steps:

1. Timing: every rank runs its order, each op starting when the rank is free and its inputs exist
   (forward: the previous virtual stage's forward; backward: this stage's forward and the next
   virtual stage's backward). Forward costs 1 unit, backward 2. An order that cannot run is an
   error here, before any process sees it.
2. Communication: each cross-rank dependency becomes a send on the producer and a receive on the
   consumer, both keyed by the producer's finish time (ties broken by a global key). Every rank's
   stream is its computes and communications sorted by key, so all ranks meet their
   communications in one global order: blocking send/recv cannot deadlock (simulator.py checks it).
3. Buffers: a micro-batch occupies a buffer of its chunk from its first to its last instruction;
   buffers are handed out greedily, so `num_pipe_buffers()` is the peak the order needs.

Virtual stage `chunk * stages + rank` holds the chunk's layers (`PipelineModule(...,
num_chunks=v)` partitions into stages*v parts in that order), so activations leave the last rank
of chunk c for rank 0's chunk c+1: the first and last ranks talk directly.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator

from zerospeed.runtime.pipe.instructions import (
    BackwardPass,
    ForwardPass,
    LoadMicroBatch,
    OptimizerStep,
    PipeInstruction,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
)
from zerospeed.runtime.pipe.schedule import PipeSchedule

__all__ = ["ComputeOp", "GPipeSchedule", "Interleaved1F1BSchedule", "LoweredSchedule", "lower", "one_f_one_b_bubble"]

FORWARD_COST, BACKWARD_COST = 1, 2


@dataclasses.dataclass(frozen=True)
class ComputeOp:
    forward: bool
    chunk: int
    micro_batch: int


@dataclasses.dataclass(frozen=True)
class LoweredStreams:
    streams: list[list[list[PipeInstruction]]]  # rank -> steps -> instructions
    num_buffers: list[int]  # rank -> buffers per chunk
    makespan: int  # time units of the timed run (for the idle-fraction theory)
    busy: list[int]  # rank -> time units computing


def _timing(orders: list[list[ComputeOp]], num_stages: int, num_chunks: int) -> dict[tuple[int, ComputeOp], int]:
    """Finish time of every op (keyed by rank and op); raises if the orders cannot run."""
    last_virtual = num_stages * num_chunks - 1
    finish: dict[tuple[int, ComputeOp], int] = {}
    positions, free_at = [0] * num_stages, [0] * num_stages
    while any(positions[r] < len(orders[r]) for r in range(num_stages)):
        progressed = False
        for rank in range(num_stages):
            while positions[rank] < len(orders[rank]):
                op = orders[rank][positions[rank]]
                deps = _dependencies(rank, op, num_stages, last_virtual)
                if any(dep not in finish for dep in deps):
                    break
                start = max([free_at[rank]] + [finish[dep] for dep in deps])
                free_at[rank] = finish[(rank, op)] = start + (FORWARD_COST if op.forward else BACKWARD_COST)
                positions[rank] += 1
                progressed = True
        if not progressed:
            stuck = {r: orders[r][positions[r]] for r in range(num_stages) if positions[r] < len(orders[r])}
            raise ValueError(f"compute orders cannot run: each rank waits on another: {stuck}")
    return finish


def _locate(virtual: int, num_stages: int) -> tuple[int, int]:
    return virtual % num_stages, virtual // num_stages  # rank, chunk


def _dependencies(rank: int, op: ComputeOp, num_stages: int, last_virtual: int) -> list[tuple[int, ComputeOp]]:
    virtual = op.chunk * num_stages + rank
    if op.forward:
        if virtual == 0:
            return []
        prev_rank, prev_chunk = _locate(virtual - 1, num_stages)
        return [(prev_rank, ComputeOp(True, prev_chunk, op.micro_batch))]
    deps = [(rank, ComputeOp(True, op.chunk, op.micro_batch))]
    if virtual < last_virtual:
        next_rank, next_chunk = _locate(virtual + 1, num_stages)
        deps.append((next_rank, ComputeOp(False, next_chunk, op.micro_batch)))
    return deps


def lower(orders: list[list[ComputeOp]], num_chunks: int, training: bool) -> LoweredStreams:
    num_stages = len(orders)
    last_virtual = num_stages * num_chunks - 1
    finish = _timing(orders, num_stages, num_chunks)
    events: list[list[tuple[tuple, type, ComputeOp]]] = [[] for _ in range(num_stages)]
    for (rank, op), end in finish.items():
        start = end - (FORWARD_COST if op.forward else BACKWARD_COST)
        virtual = op.chunk * num_stages + rank
        events[rank].append(((start, 2, virtual, op.micro_batch), ForwardPass if op.forward else BackwardPass, op))
        if op.forward and (virtual == 0 or virtual == last_virtual):
            events[rank].append(((start, 1, virtual, op.micro_batch), LoadMicroBatch, op))
        if op.forward and virtual < last_virtual:
            _add_transfer(events, finish, rank, op, virtual, num_stages, (SendActivation, RecvActivation), +1)
        if not op.forward and virtual > 0:
            _add_transfer(events, finish, rank, op, virtual, num_stages, (SendGrad, RecvGrad), -1)
    num_buffers, streams = [], []
    for rank in range(num_stages):
        ordered = sorted(events[rank], key=lambda event: event[0])
        buffers, count = _assign_buffers(ordered)
        num_buffers.append(count)
        steps: list[list[PipeInstruction]] = []
        for _key, kind, op in ordered:
            cmd = kind(buffers[(op.chunk, op.micro_batch)], op.micro_batch, op.chunk)
            if kind in (ForwardPass, BackwardPass) or not steps:
                steps.append([])
            steps[-1].append(cmd)
        if training:
            steps.append([ReduceTiedGrads(), ReduceGrads(), OptimizerStep()])
        streams.append(steps)
    makespan = max(finish.values())
    busy = [sum(FORWARD_COST if op.forward else BACKWARD_COST for op in orders[r]) for r in range(num_stages)]
    return LoweredStreams(streams, num_buffers, makespan, busy)


def _add_transfer(events: list, finish: dict, rank: int, op: ComputeOp, virtual: int, num_stages: int,
                  kinds: tuple[type, type], direction: int) -> None:
    """Producer `op` on `rank` sends what the neighbouring virtual stage consumes, at its finish time."""
    send, recv = kinds
    peer_rank, peer_chunk = _locate(virtual + direction, num_stages)
    key = (finish[(rank, op)], 0, virtual, op.micro_batch)
    events[rank].append((key, send, op))
    events[peer_rank].append((key, recv, ComputeOp(op.forward, peer_chunk, op.micro_batch)))


def _assign_buffers(ordered: list[tuple[tuple, type, ComputeOp]]) -> tuple[dict[tuple[int, int], int], int]:
    first: dict[tuple[int, int], int] = {}
    last: dict[tuple[int, int], int] = {}
    for index, (_, _, op) in enumerate(ordered):
        first.setdefault((op.chunk, op.micro_batch), index)
        last[(op.chunk, op.micro_batch)] = index
    free: dict[int, list[int]] = {}
    next_id: dict[int, int] = {}
    assigned: dict[tuple[int, int], int] = {}
    for index, (_, _, op) in enumerate(ordered):
        key = (op.chunk, op.micro_batch)
        if first[key] == index:
            pool = free.setdefault(op.chunk, [])
            if pool:
                assigned[key] = pool.pop(0)
            else:
                assigned[key] = next_id.get(op.chunk, 0)
                next_id[op.chunk] = assigned[key] + 1
        if last[key] == index:
            free.setdefault(op.chunk, []).append(assigned[key])
            free[op.chunk].sort()
    return assigned, max(next_id.values(), default=1)


class LoweredSchedule(PipeSchedule):
    """A schedule given as compute orders (subclasses define `compute_order`)."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int, num_chunks: int = 1,
                 training: bool = True) -> None:
        super().__init__(micro_batches, stages, stage_id)
        if num_chunks < 1 or (num_chunks > 1 and stages < 2):
            raise ValueError(f"num_chunks must be >= 1, and 1 with a single stage; got {num_chunks} "
                             f"with {stages} stages")
        self.num_chunks = num_chunks
        self.training = training

    def compute_order(self, stage_id: int) -> list[ComputeOp]:
        raise NotImplementedError

    @functools.cached_property
    def lowered(self) -> LoweredStreams:
        orders = [self.compute_order(rank) for rank in range(self.stages)]
        if not self.training:
            orders = [[op for op in order if op.forward] for order in orders]
        return lower(orders, self.num_chunks, self.training)

    def steps(self) -> Iterator[list[PipeInstruction]]:
        yield from self.lowered.streams[self.stage_id]

    def num_pipe_buffers(self) -> int:
        return self.lowered.num_buffers[self.stage_id]

    def bubble_fraction(self) -> float:
        """This stage's idle share of the timed run (forward 1 unit, backward 2)."""
        return 1.0 - self.lowered.busy[self.stage_id] / self.lowered.makespan


class GPipeSchedule(LoweredSchedule):
    """All forwards, then all backwards (holds every micro-batch's activations)."""

    def compute_order(self, stage_id: int) -> list[ComputeOp]:
        forwards = [ComputeOp(True, 0, mb) for mb in range(self.micro_batches)]
        return forwards + [ComputeOp(False, 0, mb) for mb in range(self.micro_batches)]


class Interleaved1F1BSchedule(LoweredSchedule):
    """Megatron's interleaved 1F1B: each rank holds `num_chunks` model chunks (virtual stages).

    Forwards go through the chunks in groups of `stages` micro-batches; warm-up is
    `2 * (stages - stage_id - 1) + (num_chunks - 1) * stages` forwards, then one forward / one
    backward, then the remaining backwards. Needs micro_batches to be a multiple of stages."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int, num_chunks: int = 2,
                 training: bool = True) -> None:
        if micro_batches % stages != 0:
            raise ValueError(f"interleaved 1F1B needs micro-batches (gradient_accumulation_steps = {micro_batches}) "
                             f"to be a multiple of the pipeline stages ({stages})")
        super().__init__(micro_batches, stages, stage_id, num_chunks, training)

    def _op(self, k: int, forward: bool) -> ComputeOp:
        group = k // self.stages
        chunk = group % self.num_chunks
        micro_batch = (k // (self.stages * self.num_chunks)) * self.stages + k % self.stages
        return ComputeOp(forward, chunk if forward else self.num_chunks - 1 - chunk, micro_batch)

    def compute_order(self, stage_id: int) -> list[ComputeOp]:
        total = self.micro_batches * self.num_chunks
        warmup = min(2 * (self.stages - stage_id - 1) + (self.num_chunks - 1) * self.stages, total)
        order = [self._op(k, True) for k in range(warmup)]
        for i in range(total - warmup):
            order += [self._op(warmup + i, True), self._op(i, False)]
        return order + [self._op(k, False) for k in range(total - warmup, total)]


def one_f_one_b_bubble(micro_batches: int, stages: int) -> float:
    """The idle fraction of synchronous 1F1B: (S-1)/(M+S-1)."""
    return (stages - 1) / (micro_batches + stages - 1)


