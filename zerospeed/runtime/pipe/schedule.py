"""Pipeline schedules: generators of instruction lists, one list per step (DeepSpeed's API).

`TrainSchedule` is DeepSpeed's synchronous 1F1B, instruction for instruction
(`deepspeed/runtime/pipe/schedule.py::TrainSchedule.steps`):
at step t stage s runs a forward when t and s have the same parity, a backward otherwise; the
communication of a step comes first, then the load, then the pass; the last step appends
`ReduceTiedGrads, ReduceGrads, OptimizerStep`. `InferenceSchedule` is DeepSpeed's forward-only
schedule with two alternating buffers. `GPipeSchedule` and `Interleaved1F1BSchedule` (not in
DeepSpeed) live in schedule_lowering.py, built from a compute order. `schedule_for(name, ...)`
maps the ds_config `pipeline.schedule` value to a class.

Every schedule here is checked by simulator.py: each micro-batch forwarded and backwarded once per
(virtual) stage, every send matched by a receive, no deadlock with blocking point-to-point
communication, and at most `num_pipe_buffers()` buffers live per chunk.
"""

from __future__ import annotations

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

__all__ = ["DataParallelSchedule", "InferenceSchedule", "PipeSchedule", "TrainSchedule"]


class PipeSchedule:
    """Base: the micro-batches of one batch on one stage; iterate it to get the steps."""

    num_chunks = 1  # model chunks (virtual stages) per rank; more only when interleaved

    def __init__(self, micro_batches: int, stages: int, stage_id: int) -> None:
        if micro_batches < 1 or stages < 1 or not 0 <= stage_id < stages:
            raise ValueError(f"invalid schedule: micro_batches={micro_batches}, stages={stages}, "
                             f"stage_id={stage_id}")
        self.micro_batches = micro_batches
        self.stages = stages
        self.stage_id = stage_id
        self.prev_stage = stage_id - 1
        self.next_stage = stage_id + 1

    def steps(self) -> Iterator[list[PipeInstruction]]:
        raise NotImplementedError

    def num_pipe_buffers(self) -> int:
        """Buffers per chunk the engine allocates (the bound the simulator checks)."""
        return self.micro_batches

    def _valid_micro_batch(self, micro_batch_id: int) -> bool:
        return 0 <= micro_batch_id < self.micro_batches

    def _valid_stage(self, stage_id: int) -> bool:
        return 0 <= stage_id < self.stages

    @property
    def stage(self) -> int:
        return self.stage_id

    @property
    def num_stages(self) -> int:
        return self.stages

    @property
    def num_micro_batches(self) -> int:
        return self.micro_batches

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.stages - 1

    def _buffer_idx(self, micro_batch_id: int) -> int:
        assert self._valid_micro_batch(micro_batch_id)
        return micro_batch_id % self.num_pipe_buffers()

    def __iter__(self) -> Iterator[list[PipeInstruction]]:
        return self.steps()


class InferenceSchedule(PipeSchedule):
    """Forward only; stage s runs micro-batch t - s at step t; two buffers alternate."""

    def steps(self) -> Iterator[list[PipeInstruction]]:
        for step_id in range(self.micro_batches + self.stages - 1):
            micro_batch_id = step_id - self.stage_id
            # Even stages receive into step%2 and send from the other buffer; odd stages the reverse,
            # so neighbours' send and receive buffers pair up.
            even = self.stage_id % 2 == 0
            recv_buf, send_buf = (step_id % 2, (step_id + 1) % 2) if even else ((step_id + 1) % 2, step_id % 2)
            current, previous = micro_batch_id, micro_batch_id - 1
            cmds: list[PipeInstruction] = []
            if (self.is_first_stage or self.is_last_stage) and self._valid_micro_batch(current):
                cmds.append(LoadMicroBatch(recv_buf, current))
            send = self._valid_stage(self.next_stage) and self._valid_micro_batch(previous)
            recv = self._valid_stage(self.prev_stage) and self._valid_micro_batch(current)
            # Even stages send first and odd stages receive first: blocking pairs never wait on each other.
            ordered = [("send", send), ("recv", recv)] if even else [("recv", recv), ("send", send)]
            for kind, wanted in ordered:
                if wanted and kind == "send":
                    cmds.append(SendActivation(send_buf, previous))
                elif wanted:
                    cmds.append(RecvActivation(recv_buf, current))
            if self._valid_micro_batch(current):
                cmds.append(ForwardPass(recv_buf, current))
            yield cmds

    def num_pipe_buffers(self) -> int:
        return 2


class TrainSchedule(PipeSchedule):
    """DeepSpeed's synchronous 1F1B (see the module docstring)."""

    def steps(self) -> Iterator[list[PipeInstruction]]:
        prev_micro_batch_id = -1
        total_steps = 2 * (self.micro_batches + self.stages - 1)
        for step_id in range(total_steps):
            micro_batch_id, is_forward = self._step_to_micro_batch(step_id)
            prev_valid = self._valid_micro_batch(prev_micro_batch_id)
            curr_valid = self._valid_micro_batch(micro_batch_id)
            prev_buffer = self._buffer_idx(prev_micro_batch_id) if prev_valid else -1
            curr_buffer = self._buffer_idx(micro_batch_id) if curr_valid else -1
            cmds: list[PipeInstruction] = []
            if is_forward:
                if prev_valid and self._valid_stage(self.prev_stage):
                    cmds.append(SendGrad(prev_buffer, prev_micro_batch_id))
                if curr_valid and self._valid_stage(self.prev_stage):
                    cmds.append(RecvActivation(curr_buffer, micro_batch_id))
            else:
                if curr_valid and self._valid_stage(self.next_stage):
                    cmds.append(RecvGrad(curr_buffer, micro_batch_id))
                if prev_valid and self._valid_stage(self.next_stage):
                    cmds.append(SendActivation(prev_buffer, prev_micro_batch_id))
            if (self.is_first_stage or self.is_last_stage) and is_forward and curr_valid:
                cmds.append(LoadMicroBatch(curr_buffer, micro_batch_id))
            if curr_valid:
                cmds.append((ForwardPass if is_forward else BackwardPass)(curr_buffer, micro_batch_id))
            if step_id == total_steps - 1:
                cmds.extend([ReduceTiedGrads(), ReduceGrads(), OptimizerStep()])
            prev_micro_batch_id = micro_batch_id
            yield cmds

    def num_pipe_buffers(self) -> int:
        """The most forwards in flight: the distance to the last stage (at least 2, as DeepSpeed)."""
        return max(2, min(self.stages - self.stage_id, self.micro_batches))

    def _step_to_micro_batch(self, step_id: int) -> tuple[int, bool]:
        s, num_stages = self.stage_id, self.stages
        if step_id % 2 == s % 2:  # forward step
            base = step_id // 2 if step_id % 2 == 0 else (step_id - 1) // 2
            return base - s // 2, True
        if step_id % 2 == 0:  # even step on an odd stage: backward
            return step_id // 2 - num_stages + (s + 1) // 2, False
        return (step_id - 1) // 2 - num_stages + 1 + s // 2, False  # odd step on an even stage


class DataParallelSchedule(PipeSchedule):
    """One stage, plain gradient accumulation (DeepSpeed's example schedule)."""

    def steps(self) -> Iterator[list[PipeInstruction]]:
        for step_id in range(self.micro_batches):
            cmds: list[PipeInstruction] = [LoadMicroBatch(0, step_id), ForwardPass(0, step_id), BackwardPass(0, step_id)]
            if step_id == self.micro_batches - 1:
                cmds.extend([ReduceGrads(), OptimizerStep()])
            yield cmds

    def num_pipe_buffers(self) -> int:
        return 1
