"""A pure simulator that checks a pipeline schedule on every stage at once (no processes).

It runs each stage's instruction stream with the engine's point-to-point semantics and checks:

* dependencies: a forward has its input (loaded on the first virtual stage, received elsewhere);
  the last virtual stage has its labels; a backward follows its forward and has its output
  gradient (received, or from the loss on the last virtual stage); a send follows the pass that
  produced what it sends;
* matching: a send and the receive it meets carry the same kind, micro-batch and chunk. Messages
  between two ranks are matched in order, whatever they carry, as gloo and NCCL match them (by
  source and tag): with 2 ranks and interleaved chunks, activations and gradients share a channel;
* completeness: every micro-batch is forwarded (and, for training, backwarded) exactly once on
  every virtual stage, and every stream runs to its end (otherwise: deadlock, with the blocked
  instructions named);
* buffers: a buffer is not reused while it still holds another micro-batch, and at most
  `num_pipe_buffers()` buffers per chunk are live at once; the peak is reported.

[Note: send modes] `max_pending_sends` is how a send completes. 0 models a *blocking* send
(DeepSpeed's): the sender waits until the receiver has taken the message (gloo's send waits for
the peer's receive), a rendezvous, the strictest model. n > 0 models the executor's non-blocking
sends: the message is posted and the sender goes on while at most n of its messages are still
untaken; one more and it waits for the oldest (executor.py's bound). A receive always blocks until
its message is there. Passing with 0 proves the schedule deadlock-free in every mode; a schedule
that passes only with n > 0 needs non-blocking sends.
"""

from __future__ import annotations

import collections
import dataclasses

from zerospeed.runtime.pipe.instructions import (
    BackwardPass,
    BufferOpInstruction,
    ForwardPass,
    PipeInstruction,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
)
from zerospeed.runtime.pipe.schedule import PipeSchedule

__all__ = ["ScheduleError", "SimulationReport", "simulate"]


class ScheduleError(AssertionError):
    """The schedule breaks one of the checked properties; the message says which and where."""


@dataclasses.dataclass
class SimulationReport:
    num_rounds: int
    peak_live_buffers: list[int]  # per stage, over all chunks
    instructions: list[list[PipeInstruction]]


@dataclasses.dataclass
class _StageState:
    stage_id: int
    stream: list[PipeInstruction]
    buffers_per_chunk: int
    position: int = 0
    posted: bool = False  # the current send's message is in its channel
    untaken: int = 0      # this stage's messages not yet received
    done: set[tuple[str, int, int]] = dataclasses.field(default_factory=set)  # (kind, chunk, mb)
    live: dict[tuple[int, int], int] = dataclasses.field(default_factory=dict)  # (chunk, buffer) -> mb
    last_use: dict[tuple[int, int], int] = dataclasses.field(default_factory=dict)  # (chunk, mb) -> position
    peak_live: int = 0

    def current(self) -> PipeInstruction | None:
        return self.stream[self.position] if self.position < len(self.stream) else None


def simulate(schedules: list[PipeSchedule], training: bool = True, max_pending_sends: int = 0) -> SimulationReport:
    """Check the schedules of all stages of one pipeline (index = stage id); sends block unless
    `max_pending_sends` > 0 ([Note: send modes])."""
    num_stages = len(schedules)
    num_chunks = schedules[0].num_chunks
    micro_batches = schedules[0].micro_batches
    states = []
    for stage_id, schedule in enumerate(schedules):
        stream = [cmd for step in schedule for cmd in step]
        state = _StageState(stage_id, stream, schedule.num_pipe_buffers())
        for position, cmd in enumerate(stream):
            if isinstance(cmd, BufferOpInstruction):
                state.last_use[(cmd.chunk_id, cmd.micro_batch_id)] = position
        states.append(state)
    sim = _Simulation(states, num_stages, num_chunks, micro_batches, max_pending_sends)
    rounds = sim.run()
    sim.check_complete(training)
    return SimulationReport(rounds, [s.peak_live for s in states], [s.stream for s in states])


class _Simulation:
    def __init__(self, states: list[_StageState], num_stages: int, num_chunks: int, micro_batches: int,
                 max_pending_sends: int) -> None:
        self.states, self.num_stages, self.num_chunks, self.micro_batches = states, num_stages, num_chunks, micro_batches
        self.last_virtual = num_stages * num_chunks - 1
        self.max_pending_sends = max_pending_sends
        # (sender, receiver) -> messages in flight, oldest first: (send kind, micro-batch, receiver's chunk, text)
        self.channels: dict[tuple[int, int], collections.deque[tuple[str, int, int, str]]] = {}

    def virtual(self, state: _StageState, chunk: int) -> int:
        return chunk * self.num_stages + state.stage_id

    def run(self) -> int:
        rounds = 0
        while any(s.current() is not None for s in self.states):
            rounds += 1
            progressed = False
            for state in self.states:
                while (cmd := state.current()) is not None and not isinstance(cmd, _COMM):
                    self.execute_local(state, cmd)
                    progressed = True
            for state in self.states:
                cmd = state.current()
                if isinstance(cmd, (SendActivation, SendGrad)) and self.try_send(state, cmd):
                    progressed = True
                elif isinstance(cmd, (RecvActivation, RecvGrad)) and self.try_recv(state, cmd):
                    progressed = True
            if not progressed and any(s.current() is not None for s in self.states):
                blocked = {s.stage_id: s.current() for s in self.states if s.current() is not None}
                raise ScheduleError(f"deadlock: every stage waits; blocked at {blocked}")
        return rounds

    def execute_local(self, state: _StageState, cmd: PipeInstruction) -> None:
        if isinstance(cmd, BufferOpInstruction):
            self.check_dependencies(state, cmd)
            self.occupy(state, cmd)
            state.done.add((cmd.name, cmd.chunk_id, cmd.micro_batch_id))
            self.release_if_last_use(state, cmd)
        state.position += 1

    def check_dependencies(self, state: _StageState, cmd: BufferOpInstruction) -> None:
        chunk, mb = cmd.chunk_id, cmd.micro_batch_id
        virtual = self.virtual(state, chunk)
        needs: list[str] = []
        if isinstance(cmd, ForwardPass):
            needs.append("LoadMicroBatch" if virtual == 0 else "RecvActivation")
            if virtual == self.last_virtual and virtual != 0:
                needs.append("LoadMicroBatch")
        elif isinstance(cmd, BackwardPass):
            needs.append("ForwardPass")
            if virtual != self.last_virtual:
                needs.append("RecvGrad")
        elif isinstance(cmd, SendActivation):
            needs.append("ForwardPass")
        elif isinstance(cmd, SendGrad):
            needs.append("BackwardPass")
        for need in needs:
            if (need, chunk, mb) not in state.done:
                raise ScheduleError(f"stage {state.stage_id}: {cmd} before {need} of micro-batch {mb} chunk {chunk}")
        if (cmd.name, chunk, mb) in state.done:
            raise ScheduleError(f"stage {state.stage_id}: {cmd} runs micro-batch {mb} chunk {chunk} twice")
        if not 0 <= mb < self.micro_batches:
            raise ScheduleError(f"stage {state.stage_id}: {cmd} names micro-batch {mb} outside [0, {self.micro_batches})")

    def occupy(self, state: _StageState, cmd: BufferOpInstruction) -> None:
        if not 0 <= cmd.buffer_id < state.buffers_per_chunk:
            raise ScheduleError(f"stage {state.stage_id}: {cmd} uses buffer {cmd.buffer_id} of "
                                f"{state.buffers_per_chunk}")
        key = (cmd.chunk_id, cmd.buffer_id)
        holder = state.live.get(key)
        if holder is not None and holder != cmd.micro_batch_id:
            raise ScheduleError(f"stage {state.stage_id}: {cmd} overwrites buffer {cmd.buffer_id} of chunk "
                                f"{cmd.chunk_id} still holding micro-batch {holder}")
        state.live[key] = cmd.micro_batch_id
        state.peak_live = max(state.peak_live, len(state.live))

    def release_if_last_use(self, state: _StageState, cmd: BufferOpInstruction) -> None:
        if state.last_use[(cmd.chunk_id, cmd.micro_batch_id)] == state.position:
            del state.live[(cmd.chunk_id, cmd.buffer_id)]

    def try_send(self, sender: _StageState, cmd: SendActivation | SendGrad) -> bool:
        """Post the message (once), then complete if few enough of the sender's messages are untaken."""
        progressed = False
        if not sender.posted:
            self.check_dependencies(sender, cmd)
            forward = isinstance(cmd, SendActivation)
            peer_id = (sender.stage_id + (1 if forward else -1)) % self.num_stages
            wraps = sender.stage_id == (self.num_stages - 1 if forward else 0)
            peer_chunk = cmd.chunk_id + ((1 if forward else -1) if wraps else 0)
            if wraps and self.num_stages > 1 and not 0 <= peer_chunk < self.num_chunks:
                raise ScheduleError(f"stage {sender.stage_id}: {cmd} sends past the end of the pipeline")
            channel = self.channels.setdefault((sender.stage_id, peer_id), collections.deque())
            channel.append((cmd.name, cmd.micro_batch_id, peer_chunk, f"stage {sender.stage_id} {cmd}"))
            sender.posted, progressed = True, True
            sender.untaken += 1
        if sender.untaken > self.max_pending_sends:
            return progressed
        sender.posted = False
        self.execute_local(sender, cmd)
        return True

    def try_recv(self, receiver: _StageState, cmd: RecvActivation | RecvGrad) -> bool:
        """Take the oldest message from the peer, if any; it must be the one this receive expects."""
        forward = isinstance(cmd, RecvActivation)
        peer_id = (receiver.stage_id + (-1 if forward else 1)) % self.num_stages
        channel = self.channels.get((peer_id, receiver.stage_id))
        if not channel:
            return False
        kind, micro_batch, chunk, text = channel.popleft()
        expected = "SendActivation" if forward else "SendGrad"
        if (kind, micro_batch, chunk) != (expected, cmd.micro_batch_id, cmd.chunk_id):
            raise ScheduleError(f"{text} meets stage {receiver.stage_id} {cmd}: kind, micro-batch or chunk differ")
        self.states[peer_id].untaken -= 1
        self.execute_local(receiver, cmd)
        return True

    def check_complete(self, training: bool) -> None:
        kinds = ["ForwardPass", "BackwardPass"] if training else ["ForwardPass"]
        for state in self.states:
            for chunk in range(self.num_chunks):
                for kind in kinds:
                    missing = [mb for mb in range(self.micro_batches) if (kind, chunk, mb) not in state.done]
                    if missing:
                        raise ScheduleError(f"stage {state.stage_id} chunk {chunk}: no {kind} for micro-batches {missing}")
            if state.untaken:
                raise ScheduleError(f"stage {state.stage_id}: {state.untaken} messages sent but never received")
            if state.live:
                raise ScheduleError(f"stage {state.stage_id}: buffers still live at the end: {state.live}")


_COMM = (SendActivation, RecvActivation, SendGrad, RecvGrad)
