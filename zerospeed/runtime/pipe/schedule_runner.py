"""`ScheduleRunner`: this stage's schedule for one batch, run and reduced; held by `PipelineEngine`.

The engine decides what a batch is (train or eval, how many micro-batches, which data) and what
a step does (its optimizer wrapper, counters, monitors). The runner owns the rest of the pipeline's
batch: which schedule this stage runs (`pipeline.schedule`, checked once here), its instruction
lists (built once per (training, micro-batches): instructions are frozen data, so every batch
replays the same lists), one `StageExecutor` per batch to run them (executor.py), the activation
message sizes per peer that outlive a batch ([Note: one message per activation transfer] in
p2p.py), and the reduction of the micro-batch losses the last stage computed: averaged over
micro-batches and data-parallel pipelines, then broadcast to every stage.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from zerospeed import comm
from zerospeed.runtime.pipe.executor import StageExecutor, StageHost
from zerospeed.runtime.pipe.instructions import PipeInstruction
from zerospeed.runtime.pipe.p2p import MessageSizes
from zerospeed.runtime.pipe.schedule import InferenceSchedule, PipeSchedule, TrainSchedule
from zerospeed.runtime.pipe.schedule_lowering import GPipeSchedule, Interleaved1F1BSchedule

__all__ = ["SCHEDULES", "ScheduleRunner"]

SCHEDULES = {"1f1b": TrainSchedule, "gpipe": GPipeSchedule, "interleaved_1f1b": Interleaved1F1BSchedule}


class ScheduleRunner:
    """Runs this stage's schedules over the pipeline ``grid``; the losses are averaged over
    ``dp_group`` (``dp_world_size`` pipelines) and results made on ``device``."""

    def __init__(self, schedule_name: str, grid: Any, num_chunks: int, dp_group: Any, dp_world_size: int,
                 device: torch.device) -> None:
        if schedule_name not in SCHEDULES:
            raise ValueError(f"pipeline.schedule must be one of {sorted(SCHEDULES)}, got {schedule_name!r}")
        interleaved = schedule_name == "interleaved_1f1b"
        if interleaved != (num_chunks > 1):
            raise ValueError(f"pipeline.schedule {schedule_name!r} needs PipelineModule(num_chunks=...) "
                             f"{'> 1' if interleaved else '== 1'}; the module has num_chunks={num_chunks}")
        self.schedule_name, self.grid, self.num_chunks = schedule_name, grid, num_chunks
        self.num_stages = grid.get_pipe_parallel_world_size()
        self.stage_id = grid.get_stage_id()
        self.dp_group, self.dp_world_size, self.device = dp_group, dp_world_size, device
        # Per peer, the size of the next activation message ([Note: one message per activation transfer]).
        self.bytes_sent: MessageSizes = {}
        self.bytes_received: MessageSizes = {}
        self.last_seconds: dict[str, float] = {}
        self.last_timeline: list[tuple[str, float, float]] = []
        self._steps: dict[tuple[bool, int], list[list[PipeInstruction]]] = {}

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def peer_rank(self, offset: int) -> int:
        """The global rank of the stage ``offset`` away (wrapping: interleaved chunks go last -> first)."""
        return self.grid.stage_to_global((self.stage_id + offset) % self.num_stages)

    # --- schedules ----------------------------------------------------------------------------
    def steps(self, training: bool, micro_batches: int) -> list[list[PipeInstruction]]:
        """This stage's instruction steps for a batch of ``micro_batches``."""
        key = (training, micro_batches)
        if key not in self._steps:
            self._steps[key] = list(self._schedule(training, micro_batches))
        return self._steps[key]

    def _schedule(self, training: bool, micro_batches: int) -> PipeSchedule:
        if self.schedule_name == "interleaved_1f1b":
            return Interleaved1F1BSchedule(micro_batches, self.num_stages, self.stage_id, self.num_chunks,
                                           training=training)
        if not training:
            return InferenceSchedule(micro_batches, self.num_stages, self.stage_id)
        return SCHEDULES[self.schedule_name](micro_batches, self.num_stages, self.stage_id)

    # --- one batch ----------------------------------------------------------------------------
    def run(self, host: StageHost, data_iter: Iterator[Any] | None, training: bool, micro_batches: int,
            compute_loss: bool = True, return_logits: bool = False) -> StageExecutor:
        """Execute one batch's schedule on this stage; the executor holds its losses and logits."""
        executor = StageExecutor(self, host, data_iter, training, micro_batches, compute_loss, return_logits)
        executor.run(self.steps(training, micro_batches))
        self.last_seconds = executor.seconds   # per instruction type, this stage
        self.last_timeline = executor.timeline
        return executor

    # --- losses -------------------------------------------------------------------------------
    def mean_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """Mean over micro-batches and data-parallel pipelines, broadcast from the last stage."""
        result = torch.zeros(1, dtype=torch.float32, device=self.device)
        if self.is_last_stage:
            result = (torch.stack([loss.float().reshape(()) for loss in losses]).sum() / len(losses)).reshape(1)
            if self.dp_world_size > 1:
                comm.all_reduce(result, group=self.dp_group)
                result /= self.dp_world_size
        if self.num_stages > 1:
            comm.broadcast(result, src=self.grid.stage_to_global(self.num_stages - 1),
                           group=self.grid.get_pipe_parallel_group())
        return result.reshape(())

    def reduce_outputs(self, outputs: list[Any], reduce: str | None, micro_batches: int) -> Any:
        """The last stage's eval outputs: as they are (None), or averaged (DeepSpeed's "avg")."""
        if reduce is None:
            return outputs
        if reduce.lower() != "avg":
            raise NotImplementedError(f"reduction type {reduce} not supported.")
        reduced = sum(o.float() for o in outputs) / micro_batches
        if self.dp_world_size > 1:
            reduced = reduced.clone()
            comm.all_reduce(reduced, group=self.dp_group)
            reduced /= self.dp_world_size
        return reduced

    def broadcast_from_last(self, value: torch.Tensor | None) -> torch.Tensor:
        """The last stage's scalar on every stage of this pipeline."""
        if self.num_stages == 1:
            assert value is not None, "a single stage is the last stage"
            return value
        src = self.grid.stage_to_global(self.num_stages - 1)
        result = value.detach().float().reshape(1).clone() if value is not None and self.is_last_stage \
            else torch.zeros(1, dtype=torch.float32, device=self.device)
        comm.broadcast(result, src=src, group=self.grid.get_pipe_parallel_group())
        return result.reshape(())
