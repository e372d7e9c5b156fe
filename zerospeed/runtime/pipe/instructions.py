"""Pipeline instructions: what one stage does, as plain frozen dataclasses.

A schedule (schedule.py) yields, per step, a list of these; `PipelineEngine` executes them and the
simulator (simulator.py) checks them without processes. The names and the `buffer_id` field are
DeepSpeed's (`deepspeed.runtime.pipe.schedule`). Two fields are ours, so a schedule can be
checked and so one rank can hold several model chunks:

* `micro_batch_id`: which micro-batch the instruction concerns (DeepSpeed leaves it implicit);
* `chunk_id`: which of this rank's model chunks (virtual stages) it runs, 0 unless interleaved.
  Virtual stage `chunk_id * num_stages + stage_id` holds the chunk's layers; activations flow to
  the next virtual stage, i.e. to rank `(stage_id + 1) % num_stages`, and gradients back.
"""

from __future__ import annotations

import dataclasses

__all__ = [
    "BackwardPass",
    "BufferOpInstruction",
    "ForwardPass",
    "LoadMicroBatch",
    "OptimizerStep",
    "PipeInstruction",
    "RecvActivation",
    "RecvGrad",
    "ReduceGrads",
    "ReduceTiedGrads",
    "SendActivation",
    "SendGrad",
]


@dataclasses.dataclass(frozen=True)
class PipeInstruction:
    """Base of every instruction; `name` is the class name, as in DeepSpeed."""

    @property
    def name(self) -> str:
        return type(self).__name__


@dataclasses.dataclass(frozen=True)
class OptimizerStep(PipeInstruction):
    """Step the optimizer (clipping, scheduler, counters) once all gradients are reduced."""


@dataclasses.dataclass(frozen=True)
class ReduceGrads(PipeInstruction):
    """Average gradients over the data-parallel group."""


@dataclasses.dataclass(frozen=True)
class ReduceTiedGrads(PipeInstruction):
    """Sum the gradients of tied weights over the stages that hold a copy."""


@dataclasses.dataclass(frozen=True)
class BufferOpInstruction(PipeInstruction):
    """An instruction on one pipeline buffer (one in-flight micro-batch of one chunk)."""

    buffer_id: int
    micro_batch_id: int = -1
    chunk_id: int = 0


@dataclasses.dataclass(frozen=True)
class LoadMicroBatch(BufferOpInstruction):
    """First stage: load the inputs; last stage: load the labels."""


@dataclasses.dataclass(frozen=True)
class ForwardPass(BufferOpInstruction):
    pass


@dataclasses.dataclass(frozen=True)
class BackwardPass(BufferOpInstruction):
    pass


@dataclasses.dataclass(frozen=True)
class SendActivation(BufferOpInstruction):
    pass


@dataclasses.dataclass(frozen=True)
class RecvActivation(BufferOpInstruction):
    pass


@dataclasses.dataclass(frozen=True)
class SendGrad(BufferOpInstruction):
    pass


@dataclasses.dataclass(frozen=True)
class RecvGrad(BufferOpInstruction):
    pass
