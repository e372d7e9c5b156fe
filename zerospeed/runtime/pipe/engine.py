"""`PipelineEngine`: DeepSpeed's pipelined engine, driving schedules given as data.

It is a `DeepSpeedEngine` (config, optimizer wrapper, scheduler, monitors, counters, checkpoint
plumbing) whose forward / backward / step are replaced by `train_batch()` and `eval_batch()`: each
builds this stage's schedule (schedule.py, schedule_lowering.py) and hands it to a
`StageExecutor` (executor.py). Micro-batches are the gradient accumulation steps.

Differences from DeepSpeed: ZeRO-2 works with pipelining (DeepSpeed refuses it); GPipe and
interleaved 1F1B are selectable (`pipeline.schedule`); activation shapes may change every batch;
the global gradient norm (and so clipping) covers every stage with tied weights counted once: the
optimizer's gradient space has the pipeline's part ([Note: gradient space] in grad_space.py), and
every stage skips the same fp16 overflow steps, keeping one loss scale.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, cast

import torch

from zerospeed import comm
from zerospeed.runtime.engine import DeepSpeedEngine
from zerospeed.runtime.engine_checkpointer import CheckpointSite
from zerospeed.runtime.pipe.checkpointing import pipeline_checkpoint_site
from zerospeed.runtime.pipe.executor import StageExecutor
from zerospeed.runtime.pipe.instructions import PipeInstruction
from zerospeed.runtime.pipe.module import PipelineError, PipelineModule
from zerospeed.runtime.pipe.p2p import MessageSizes
from zerospeed.runtime.pipe.schedule import InferenceSchedule, PipeSchedule, TrainSchedule
from zerospeed.runtime.pipe.schedule_lowering import GPipeSchedule, Interleaved1F1BSchedule
from zerospeed.utils.logging import logger

__all__ = ["PipelineEngine"]

_ONLY_TRAIN_BATCH = "Only train_batch() is accessible in pipeline mode."
_SCHEDULES = {"1f1b": TrainSchedule, "gpipe": GPipeSchedule, "interleaved_1f1b": Interleaved1F1BSchedule}


class PipelineEngine(DeepSpeedEngine):
    def __init__(self, *args: Any, has_bool_tensors: bool = False, **kwargs: Any) -> None:
        model = kwargs.get("model")
        if not isinstance(model, PipelineModule):
            raise TypeError("PipelineEngine needs a PipelineModule as model")
        kwargs["mpu"] = model.mpu()
        super().__init__(*args, **kwargs)
        self.grid = model.mpu()
        self.num_stages = self.grid.get_pipe_parallel_world_size()
        self.stage_id = self.grid.get_stage_id()
        self.micro_batches = self.gradient_accumulation_steps()
        self.schedule_name = str(getattr(self._config.pipeline, "schedule", "1f1b")).lower()
        self._check_supported(model)
        self._pipe_module.tied_comms.start_tracking()
        self.data_iterator: Iterator[Any] | None = None
        if self.training_dataloader is not None and (self.is_first_stage() or self.is_last_stage()):
            self.data_iterator = _repeat(self.training_dataloader)
        self.agg_train_loss: torch.Tensor | None = None
        # Per peer, the size of the next activation message ([Note: one message per activation transfer]).
        self.activation_bytes_sent: MessageSizes = {}
        self.activation_bytes_received: MessageSizes = {}
        self.eval_return_logits = False
        self._batch_time_s = 0.0
        self.last_batch_seconds: dict[str, float] = {}
        self.last_batch_timeline: list[tuple[str, float, float]] = []
        self._schedule_steps: dict[tuple[bool, int], list[list[PipeInstruction]]] = {}
        logger.info("RANK=%d STAGE=%d LAYERS=%d [%d, %d) STAGE_PARAMS=%d", self.global_rank, self.stage_id,
                    len(model.forward_funcs), model._local_start, model._local_stop,
                    sum(p.numel() for p in model.parameters() if p.requires_grad))

    def _checkpoint_site(self) -> CheckpointSite:
        return pipeline_checkpoint_site(self)

    @property
    def _pipe_module(self) -> PipelineModule:
        return cast(PipelineModule, self.module)

    def _pipe_stages(self, model: torch.nn.Module) -> int:
        return model.num_stages if isinstance(model, PipelineModule) else 1

    def _check_supported(self, model: PipelineModule) -> None:
        """The schedule and the batch; combinations with other features are refused by the run's
        `ParallelLayout` (comm/layout.py) before anything is built."""
        if self.schedule_name not in _SCHEDULES:
            raise ValueError(f"pipeline.schedule must be one of {sorted(_SCHEDULES)}, got {self.schedule_name!r}")
        interleaved = self.schedule_name == "interleaved_1f1b"
        if interleaved != (model.num_chunks > 1):
            raise ValueError(f"pipeline.schedule {self.schedule_name!r} needs PipelineModule(num_chunks=...) "
                             f"{'> 1' if interleaved else '== 1'}; the module has num_chunks={model.num_chunks}")
        tbs, mbs, gas = self.train_batch_size(), self.train_micro_batch_size_per_gpu(), self.gradient_accumulation_steps()
        if tbs != mbs * gas * self.dp_world_size:
            raise ValueError(f"train_batch_size {tbs} != micro-batch {mbs} * gradient_accumulation_steps {gas} * "
                             f"data-parallel size {self.dp_world_size}")

    # --- DeepSpeed's refusals -------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError(_ONLY_TRAIN_BATCH)

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError(_ONLY_TRAIN_BATCH)

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise PipelineError(_ONLY_TRAIN_BATCH)

    # --- queries ------------------------------------------------------------------------------
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def get_pipeline_parallel_rank(self) -> int:
        return self.stage_id

    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        self.data_iterator = iterator

    def set_dataloader(self, loader: Any) -> None:
        if self.is_first_stage() or self.is_last_stage():
            self.data_iterator = _repeat(loader)

    def set_train_batch_size(self, train_batch_size: int) -> None:
        super().set_train_batch_size(train_batch_size)
        self.micro_batches = self.gradient_accumulation_steps()

    def _steps(self, training: bool, micro_batches: int) -> list[list[PipeInstruction]]:
        """This stage's instruction steps, built once per (training, micro-batches): instructions are
        frozen data, so every batch replays the same lists instead of regenerating them."""
        key = (training, micro_batches)
        if key not in self._schedule_steps:
            self._schedule_steps[key] = list(self._schedule(training, micro_batches))
        return self._schedule_steps[key]

    def _schedule(self, training: bool, micro_batches: int) -> PipeSchedule:
        chunks = self._pipe_module.num_chunks
        if self.schedule_name == "interleaved_1f1b":
            return Interleaved1F1BSchedule(micro_batches, self.num_stages, self.stage_id, chunks, training=training)
        if not training:
            return InferenceSchedule(micro_batches, self.num_stages, self.stage_id)
        return _SCHEDULES[self.schedule_name](micro_batches, self.num_stages, self.stage_id)

    # --- training -----------------------------------------------------------------------------
    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """Run one batch (gradient_accumulation_steps micro-batches per pipeline) and step; returns
        the mean loss over the batch, averaged over data-parallel pipelines, on every stage."""
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled. Use eval_batch() instead.")
        if self.optimizer is None:
            raise ValueError("train_batch() needs an optimizer (the ds_config `optimizer` block or optimizer=)")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        start = time.perf_counter()
        self.monitoring.tput_timer.start()
        executor = StageExecutor(self, self.data_iterator, training=True)
        executor.run(self._steps(True, self.micro_batches))
        self.last_batch_seconds = executor.seconds   # per instruction type, this stage
        self.last_batch_timeline = executor.timeline
        with torch.no_grad():
            self.agg_train_loss = self._aggregate_loss(executor.losses)
        self.monitoring.record_loss(self.agg_train_loss)
        self.monitoring.on_micro_step_end(True)
        self.monitoring.on_boundary(self)
        self._batch_time_s += time.perf_counter() - start
        self._print_progress()
        return self.agg_train_loss

    def _pipeline_optimizer_step(self) -> None:
        self.micro_steps += self.micro_batches
        self.gas_boundary_ctr += 1
        self._take_model_step(None)

    def _aggregate_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """Mean over micro-batches and data-parallel pipelines, broadcast from the last stage."""
        result = torch.zeros(1, dtype=torch.float32, device=self.device)
        if self.is_last_stage():
            result = (torch.stack([loss.float().reshape(()) for loss in losses]).sum() / len(losses)).reshape(1)
            if self.dp_world_size > 1:
                comm.all_reduce(result, group=self.dp_group)
                result /= self.dp_world_size
        if self.num_stages > 1:
            comm.broadcast(result, src=self.grid.stage_to_global(self.num_stages - 1),
                           group=self.grid.get_pipe_parallel_group())
        return result.reshape(())

    def _print_progress(self) -> None:
        every = self.steps_per_print()
        if not every or self.global_steps % every != 0:
            return
        iter_time = self._batch_time_s / every
        self._batch_time_s = 0.0
        if self.global_rank == 0:
            print(f"steps: {self.global_steps} loss: {float(self.agg_train_loss or 0.0):0.4f} "
                  f"iter time (s): {iter_time:0.3f} samples/sec: {self.train_batch_size() / iter_time:0.3f}")

    # --- evaluation ---------------------------------------------------------------------------
    def eval_batch(self, data_iter: Iterator[Any], return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str | None = "avg", bcast_loss: bool = True,
                   num_micro_batches: int | None = None) -> Any:
        """Forward `num_micro_batches` (default: gradient_accumulation_steps) micro-batches without
        gradients; returns the mean loss (DeepSpeed's reductions and broadcast)."""
        self.module.eval()
        self.eval_return_logits = return_logits
        micro_batches = self.micro_batches if num_micro_batches is None else num_micro_batches
        executor = StageExecutor(self, data_iter, training=False, compute_loss=compute_loss)
        comm.barrier()
        with torch.no_grad():
            executor.run(self._steps(False, micro_batches))
        output: Any = None
        if self.is_last_stage():
            output = self._reduce_outputs(executor.losses, reduce_output, micro_batches)
        if compute_loss and bcast_loss and reduce_output is not None:
            output = self._broadcast_from_last(output)
        if self.global_rank == 0 and self.monitoring.monitor is not None and self.monitoring.monitor.enabled \
                and torch.is_tensor(output):
            self.monitoring.monitor.write_events([("Train/Samples/eval_loss", float(output.mean()),
                                                   self.global_samples)])
        self.eval_return_logits = False
        if return_logits:
            return output, (executor.logits[-1] if executor.logits else None)
        return output

    def _reduce_outputs(self, outputs: list[Any], reduce: str | None, micro_batches: int) -> Any:
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

    def _broadcast_from_last(self, value: torch.Tensor | None) -> torch.Tensor:
        if self.num_stages == 1:
            assert value is not None, "a single stage is the last stage"
            return value
        src = self.grid.stage_to_global(self.num_stages - 1)
        result = value.detach().float().reshape(1).clone() if value is not None and self.is_last_stage() \
            else torch.zeros(1, dtype=torch.float32, device=self.device)
        comm.broadcast(result, src=src, group=self.grid.get_pipe_parallel_group())
        return result.reshape(())


def _repeat(loader: Any) -> Iterator[Any]:
    """DeepSpeed's RepeatingLoader: restart the loader when it runs out."""
    while True:
        yielded = False
        for batch in loader:
            yielded = True
            yield batch
        if not yielded:
            raise ValueError("the training data loader is empty")
