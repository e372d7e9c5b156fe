"""`PipelineEngine`: DeepSpeed's pipelined engine, driving a schedule runner.

It is a `DeepSpeedEngine` (config, optimizer wrapper, scheduler, monitors, counters, checkpoint
plumbing; users check `isinstance`) whose batch is `train_batch()` / `eval_batch()`: the engine
decides what a batch is and what its step does, and hands the schedule to the `ScheduleRunner` it
holds (schedule_runner.py: this stage's schedule, its execution by a `StageExecutor`, the losses
reduced). Micro-batches are the gradient accumulation steps. `forward` / `backward` / `step`
refuse, as DeepSpeed's do: in a pipeline they are instructions of the schedule.

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
from zerospeed.runtime.pipe.module import PipelineError, PipelineModule
from zerospeed.runtime.pipe.schedule_runner import ScheduleRunner
from zerospeed.utils.logging import logger

__all__ = ["PipelineEngine"]

_ONLY_TRAIN_BATCH = "Only train_batch() is accessible in pipeline mode."


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
        self.schedule_runner = ScheduleRunner(self.schedule_name, self.grid, model.num_chunks, self.dp_group,
                                              self.dp_world_size, self.device)
        self._check_batch()
        self._pipe_module.tied_comms.start_tracking()
        self.data_iterator: Iterator[Any] | None = None
        if self.training_dataloader is not None and (self.is_first_stage() or self.is_last_stage()):
            self.data_iterator = _repeat(self.training_dataloader)
        self.agg_train_loss: torch.Tensor | None = None
        self.eval_return_logits = False
        self._batch_time_s = 0.0
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

    def _check_batch(self) -> None:
        """The batch (the runner checks the schedule); combinations with other features are refused
        by the run's `ParallelLayout` (comm/layout.py) before anything is built."""
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
        executor = self.schedule_runner.run(self, self.data_iterator, True, self.micro_batches)
        with torch.no_grad():
            self.agg_train_loss = self.schedule_runner.mean_loss(executor.losses)
        self.monitoring.record_loss(self.agg_train_loss)
        self.monitoring.on_micro_step_end(True)
        self.monitoring.on_boundary(self)
        self._batch_time_s += time.perf_counter() - start
        self._print_progress()
        return self.agg_train_loss

    def _pipeline_optimizer_step(self) -> None:
        """The schedule's OptimizerStep: the batch's micro-steps counted, then the engine's step."""
        self.micro_steps += self.micro_batches
        self.gas_boundary_ctr += 1
        self._take_model_step(None)

    def _print_progress(self) -> None:
        every = self.steps_per_print()
        if not every or self.global_steps % every != 0:
            return
        iter_time = self._batch_time_s / every
        self._batch_time_s = 0.0
        if self.global_rank == 0:
            print(f"steps: {self.global_steps} loss: {float(self.agg_train_loss or 0.0):0.4f} "
                  f"iter time (s): {iter_time:0.3f} samples/sec: {self.train_batch_size() / iter_time:0.3f}")

    @property
    def last_batch_seconds(self) -> dict[str, float]:
        """Wall seconds per instruction type of this stage's last batch."""
        return self.schedule_runner.last_seconds

    @property
    def last_batch_timeline(self) -> list[tuple[str, float, float]]:
        """(instruction, start, end) of this stage's last batch (benchmarks/bench_pipeline.py)."""
        return self.schedule_runner.last_timeline

    # --- evaluation ---------------------------------------------------------------------------
    def eval_batch(self, data_iter: Iterator[Any], return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str | None = "avg", bcast_loss: bool = True,
                   num_micro_batches: int | None = None) -> Any:
        """Forward `num_micro_batches` (default: gradient_accumulation_steps) micro-batches without
        gradients; returns the mean loss (DeepSpeed's reductions and broadcast)."""
        self.module.eval()
        self.eval_return_logits = return_logits
        micro_batches = self.micro_batches if num_micro_batches is None else num_micro_batches
        comm.barrier()
        with torch.no_grad():
            executor = self.schedule_runner.run(self, data_iter, False, micro_batches, compute_loss, return_logits)
        output: Any = None
        if self.is_last_stage():
            output = self.schedule_runner.reduce_outputs(executor.losses, reduce_output, micro_batches)
        if compute_loss and bcast_loss and reduce_output is not None:
            output = self.schedule_runner.broadcast_from_last(output)
        if self.global_rank == 0 and self.monitoring.monitor is not None and self.monitoring.monitor.enabled \
                and torch.is_tensor(output):
            self.monitoring.monitor.write_events([("Train/Samples/eval_loss", float(output.mean()),
                                                   self.global_samples)])
        self.eval_return_logits = False
        if return_logits:
            return output, (executor.logits[-1] if executor.logits else None)
        return output


def _repeat(loader: Any) -> Iterator[Any]:
    """DeepSpeed's RepeatingLoader: restart the loader when it runs out."""
    while True:
        yielded = False
        for batch in loader:
            yielded = True
            yield batch
        if not yielded:
            raise ValueError("the training data loader is empty")
