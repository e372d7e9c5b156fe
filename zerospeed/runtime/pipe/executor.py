"""Runs one stage's instruction stream: the buffers and one small method per instruction.

The schedule decides the order (schedule.py); this module only does what each instruction says,
on the buffers of its chunk. Buffers hold, per (chunk, buffer_id): the stage's input (loaded or
received; kept until its gradient is sent back), its output (kept until backward), the output's
incoming gradients, and on the last virtual stage the labels and the micro-batch loss.

[Note: pipelined backward and the optimizer wrapper]
Every BackwardPass is one micro-batch's backward to the optimizer wrapper with `is_boundary`
False: it accumulates (ZeRO-2 also reduce-scatters, as it does per micro-batch anyway). The data-
parallel reduction of the rest happens once, at ReduceGrads, as `backward_epilogue(True)`. The
last stage divides each micro-batch loss by the number of micro-batches, so gradients are
averaged over micro-batches exactly once (DeepSpeed#7773 summed them for years).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from zerospeed.runtime.pipe import instructions as ins
from zerospeed.runtime.pipe import p2p

__all__ = ["MAX_PENDING_SENDS", "StageExecutor", "StageHost", "StagePlace"]

# Sends in flight per stage before the oldest is waited on: enough that a stage rarely waits for
# its neighbour, few enough that the tensors they hold stay a handful of activations. The
# simulator proves every schedule deadlock-free with it and with blocking sends ([Note: send modes]).
MAX_PENDING_SENDS = 16


@dataclasses.dataclass
class _Buffer:
    inputs: Any = None
    outputs: Any = None
    grads: list[torch.Tensor] | None = None
    labels: Any = None
    loss: torch.Tensor | None = None


class StageHost(Protocol):
    """What the executor uses of its engine: the stage's module, the optimizer wrapper its backward
    passes go through, and the step an OptimizerStep instruction takes."""

    module: Any
    optimizer: Any

    def _pipeline_optimizer_step(self) -> None: ...


class StagePlace(Protocol):
    """Where the stage sits (its runner, schedule_runner.py): stage, device, peers, message sizes."""

    num_stages: int
    stage_id: int
    device: torch.device
    bytes_sent: p2p.MessageSizes
    bytes_received: p2p.MessageSizes

    def peer_rank(self, offset: int) -> int: ...


class StageExecutor:
    """Executes instructions for one batch; built per batch by the schedule runner."""

    def __init__(self, place: StagePlace, host: StageHost, data_iter: Iterator[Any] | None, training: bool,
                 micro_batches: int, compute_loss: bool = True, return_logits: bool = False) -> None:
        self.place, self.host = place, host
        self.module: Any = host.module
        self.data_iter = data_iter
        self.training, self.micro_batches = training, micro_batches
        self.compute_loss, self.return_logits = compute_loss, return_logits
        self.num_stages = place.num_stages
        self.stage_id = place.stage_id
        self.last_virtual = self.num_stages * self.module.num_chunks - 1
        self.buffers: dict[tuple[int, int], _Buffer] = {}
        self.losses: list[torch.Tensor] = []   # per micro-batch, in micro-batch order, last virtual stage
        self.logits: list[Any] = []
        # (instruction name, start, end) in execution order, on `time.perf_counter`: what
        # benchmarks/bench_pipeline.py turns into each stage's idle fraction within the schedule's span.
        self.timeline: list[tuple[str, float, float]] = []
        self._sends: collections.deque[tuple[Any, torch.Tensor]] = collections.deque()
        self._next_rank, self._prev_rank = place.peer_rank(1), place.peer_rank(-1)
        handlers: dict[type, Callable[[Any], None]] = {
            ins.LoadMicroBatch: self._load, ins.ForwardPass: self._forward, ins.BackwardPass: self._backward,
            ins.SendActivation: self._send_activation, ins.RecvActivation: self._recv_activation,
            ins.SendGrad: self._send_grad, ins.RecvGrad: self._recv_grad,
            ins.ReduceTiedGrads: self._reduce_tied_grads, ins.ReduceGrads: self._reduce_grads,
            ins.OptimizerStep: self._optimizer_step,
        }
        # Per instruction type, its handler and the name the timeline records (one lookup each).
        self._dispatch = {kind: (handler, kind.__name__) for kind, handler in handlers.items()}

    def run(self, schedule: Any) -> None:
        """Execute every instruction, recording each one's start and end in `timeline`."""
        clock, record, dispatch = time.perf_counter, self.timeline.append, self._dispatch
        for step in schedule:
            for cmd in step:
                handler, name = dispatch[type(cmd)]
                start = clock()
                handler(cmd)
                record((name, start, clock()))
        self._wait_sends(0)   # not on an error: a peer that stopped would never receive

    @property
    def seconds(self) -> dict[str, float]:
        """Wall seconds spent per instruction type."""
        totals: dict[str, float] = {}
        for name, start, end in self.timeline:
            totals[name] = totals.get(name, 0.0) + end - start
        return totals

    def _wait_sends(self, keep: int) -> None:
        """Complete the oldest pending sends until `keep` are left (bounds the memory they hold)."""
        while len(self._sends) > keep:
            work, _tensor = self._sends.popleft()
            work.wait()

    # --- helpers ------------------------------------------------------------------------------
    def _buffer(self, cmd: ins.BufferOpInstruction) -> _Buffer:
        return self.buffers.setdefault((cmd.chunk_id, cmd.buffer_id), _Buffer())

    def _virtual(self, cmd: ins.BufferOpInstruction) -> int:
        return cmd.chunk_id * self.num_stages + self.stage_id

    def _to_device(self, value: Any) -> Any:
        if torch.is_tensor(value):
            return value.to(self.place.device)
        if isinstance(value, (tuple, list)):
            return type(value)(self._to_device(v) for v in value)
        return value

    # --- instructions -------------------------------------------------------------------------
    def _load(self, cmd: ins.LoadMicroBatch) -> None:
        if self.data_iter is None:
            raise ValueError("the first and last pipeline stages need a data iterator: pass data_iter= or "
                             "training_data= to deepspeed.initialize")
        batch = next(self.data_iter)
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise TypeError("each pipeline batch must be a pair (inputs, labels); got "
                            f"{type(batch).__name__}")
        buffer, virtual = self._buffer(cmd), self._virtual(cmd)
        if virtual == 0:
            buffer.inputs = self._to_device(batch[0])
        if virtual == self.last_virtual:
            buffer.labels = self._to_device(batch[1])

    def _forward(self, cmd: ins.ForwardPass) -> None:
        buffer = self._buffer(cmd)
        outputs = self.module(buffer.inputs, chunk=cmd.chunk_id) if self.module.num_chunks > 1 \
            else self.module(buffer.inputs)
        if self._virtual(cmd) != self.last_virtual:
            buffer.outputs = outputs
            return
        loss_fn = self.module.loss_fn
        if self.compute_loss and loss_fn is not None:
            buffer.loss = loss_fn(outputs, buffer.labels)
        else:
            buffer.loss = outputs
        if not self.training and self.return_logits:
            self.logits.append(outputs)
        self.losses.append(buffer.loss.detach() if torch.is_tensor(buffer.loss) else buffer.loss)

    def _backward(self, cmd: ins.BackwardPass) -> None:
        buffer, wrapper = self._buffer(cmd), self.host.optimizer
        wrapper.prepare_backward(False)
        if self._virtual(cmd) == self.last_virtual:
            assert buffer.loss is not None, "the last stage's forward left no loss to run backward from"
            loss = buffer.loss / self.micro_batches
            wrapper.scale_loss(loss).backward()
        else:
            outputs = p2p.grad_carrying(buffer.outputs)
            if outputs:
                torch.autograd.backward(outputs, buffer.grads)
        wrapper.backward_epilogue(False)
        buffer.outputs = buffer.grads = buffer.loss = buffer.labels = None

    def _send_activation(self, cmd: ins.SendActivation) -> None:
        self._sends.extend(p2p.send_activations(self._buffer(cmd).outputs, self._next_rank, self.place.device,
                                                self.place.bytes_sent))
        self._wait_sends(MAX_PENDING_SENDS)
        if not self.training:
            self._buffer(cmd).outputs = None

    def _recv_activation(self, cmd: ins.RecvActivation) -> None:
        self._buffer(cmd).inputs = p2p.recv_activations(self._prev_rank, self.place.device,
                                                        self.place.bytes_received)

    def _send_grad(self, cmd: ins.SendGrad) -> None:
        buffer = self._buffer(cmd)
        self._sends.extend(p2p.send_grads(buffer.inputs, self._prev_rank))
        self._wait_sends(MAX_PENDING_SENDS)
        buffer.inputs = None

    def _recv_grad(self, cmd: ins.RecvGrad) -> None:
        buffer = self._buffer(cmd)
        buffer.grads = p2p.recv_grads(buffer.outputs, self._next_rank)

    def _reduce_tied_grads(self, cmd: ins.ReduceTiedGrads) -> None:
        wrapper = self.host.optimizer
        wrapper.prepare_backward(False)
        self.module.tied_comms.reduce_and_inject()
        wrapper.backward_epilogue(False)

    def _reduce_grads(self, cmd: ins.ReduceGrads) -> None:
        self.host.optimizer.prepare_backward(False)
        self.host.optimizer.backward_epilogue(True)

    def _optimizer_step(self, cmd: ins.OptimizerStep) -> None:
        self.host._pipeline_optimizer_step()
