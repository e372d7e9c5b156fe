"""`DeepSpeedEngine`: the sequencing of forward / backward / step / save / load.

The engine decides *when* things happen — micro-steps, accumulation boundaries, skipped steps,
the scheduler, logging — and delegates *how* to the optimizer wrapper chosen once by
`build_optimizer_wrapper` (see [Note: engine / optimizer contract] in base_optimizer.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from zerospeed import comm
from zerospeed.accelerator import get_accelerator
from zerospeed.runtime.config import DeepSpeedConfig, load_ds_config
from zerospeed.runtime.dataloader import DeepSpeedDataLoader
from zerospeed.runtime.engine_accessors import EngineAccessors
from zerospeed.runtime.engine_checkpointer import CheckpointSite, EngineCheckpointer, plain_checkpoint_site
from zerospeed.runtime.engine_client_api import EngineClientAPI
from zerospeed.runtime.engine_groups import build_run_groups
from zerospeed.runtime.engine_moe import EngineMoE
from zerospeed.runtime.engine_setup import (
    broadcast_module_from_rank0,
    build_parallel_layout,
    build_lr_scheduler,
    cast_inputs,
    configure_basic_optimizer,
)
from zerospeed.runtime.optimizer_factory import build_optimizer_wrapper, build_parameter_offload
from zerospeed.runtime.precision import PrecisionSettings
from zerospeed.runtime.tensor_parallel.engine_component import EngineTensorParallel
from zerospeed.utils.host_allocator import settle_mmap_threshold
from zerospeed.utils.logging import log_dist, logger


# [Note: engine without an optimizer]
# `deepspeed.initialize(model=m, config=cfg)` with no optimizer argument and no `optimizer` block is
# how TRL prepares a frozen reference model and how ZeRO-Inference runs. At stage 3 the parameters
# still have to be gathered around every forward: the engine then holds the hooks alone
# (`DeepSpeedZeRoOffload`, the same coordinator and prefetch an engine with an optimizer gets) as
# `engine.optimizer`, as DeepSpeed does, because TRL's `remove_hooks` / `add_hooks` look for them
# there. `_training_optimizer` is the optimizer wrapper when there is one and None otherwise;
# `backward` and `step` refuse without one. Below stage 3 there is nothing to gather.
NO_OPTIMIZER = ("this engine has no optimizer: deepspeed.initialize got no `optimizer` argument and the config "
                "has no 'optimizer' block, so it can run forward (inference, a frozen reference model) but "
                "not {}(); pass an optimizer to train")


class DeepSpeedEngine(EngineClientAPI, EngineAccessors, torch.nn.Module):
    def __init__(self, args: Any = None, model: torch.nn.Module | None = None, optimizer: Any = None,
                 model_parameters: Any = None, training_data: Any = None, lr_scheduler: Any = None,
                 mpu: Any = None, dist_init_required: bool | None = None, collate_fn: Any = None,
                 config: Any = None, config_class: DeepSpeedConfig | None = None, **_: Any) -> None:
        super().__init__()
        assert model is not None, "deepspeed.initialize requires a model"
        settle_mmap_threshold()   # opt-in; before any training state exists ([Note: glibc mmap threshold])
        self._init_counters()
        raw_config = config_class._param_dict if config_class is not None else load_ds_config(config)
        self.parallel_layout = build_parallel_layout(raw_config, model, mpu, self._pipe_stages(model))
        self.parallel_layout.validate()
        # Every group of the run, once, frozen ([Note: run groups] in comm/run_groups.py).
        self.run_groups = build_run_groups(self.parallel_layout, model, mpu, use_data_before_expert_parallel=bool(
            raw_config.get("use_data_before_expert_parallelism", False)))
        # AutoTP shards the model over the run's tp group (tensor_parallel/setup.py).
        self.tensor_parallel = EngineTensorParallel.build(model, raw_config, mpu, self.run_groups)
        self._init_parallel_groups()
        self.global_rank = comm.get_rank()
        self.config = config  # DeepSpeed's attribute: the config as given (dict or path); clients read it
        batch_config = self.tensor_parallel.batch_config(raw_config, self.dp_world_size)   # the given config unless restated
        self._config = config_class or DeepSpeedConfig(config if batch_config is raw_config else batch_config, mpu,
                                                       world_size=self.dp_world_size)
        self._apply_log_level()
        self.precision = PrecisionSettings.from_config(self._config)
        self.communication_data_type = self.precision.communication_dtype
        self.local_rank = comm.get_local_rank()
        self.device = self._init_device()
        comm.configure(self._config.comms_config)
        self._init_module(model)
        self.training_dataloader = self._init_dataloader(training_data, collate_fn)
        self.optimizer: Any = None
        self.client_optimizer = optimizer   # DeepSpeed's attribute: the optimizer or callable as given
        self.basic_optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: Any = None
        self._has_optimizer = optimizer is not None or self._config.optimizer_name is not None
        if self._has_optimizer:
            self._init_optimizer(optimizer, model_parameters)
            self._link_fragment_owner()
            self.lr_scheduler = build_lr_scheduler(self._config, self.basic_optimizer, lr_scheduler)
            self._report_progress(0)
        else:   # [Note: engine without an optimizer]
            self.optimizer = build_parameter_offload(self._config, self.precision, self.dp_group,
                                                     self.param_names, self.module, self.run_groups)
        self._init_monitoring()
        self.checkpointer = EngineCheckpointer(self, self._checkpoint_site)

    # --- setup ------------------------------------------------------------------------------------
    def _init_parallel_groups(self) -> None:
        """`dp_group` reduces gradients and partitions ZeRO state; `dp_world_size` sizes the batch.

        With sequence parallelism they differ: the reduction spans data x sequence ranks while the
        batch counts data-parallel replicas only (DeepSpeed's `seq_data_parallel_group` and
        `dp_world_size`; sequence_parallel/groups_setup.py explains the layout and the averaging).
        """
        run = self.run_groups
        self.dp_group = self.seq_data_parallel_group = run.sequence_data_parallel.group
        self.data_parallel_group = run.data_parallel.group
        self.sequence_parallel_size = 1 if run.sequence_parallel is None else run.sequence_parallel.size
        self.dp_world_size = run.sequence_data_parallel.size // self.sequence_parallel_size
        if run.sequence_parallel is not None:
            self.seq_parallel_group = run.sequence_parallel.group
        self.seq_dp_world_size = run.sequence_data_parallel.size

    def _pipe_stages(self, model: torch.nn.Module) -> int:
        """Pipeline stages of this run's model: 1 here; `PipelineEngine` answers for its module."""
        return 1

    def _init_counters(self) -> None:
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self.gas_boundary_ctr = 0
        self._step_applied = False
        self._global_grad_norm: float | None = None
        self._inside_no_sync = False
        self._boundary_override: bool | None = None

    def _apply_log_level(self) -> None:
        if self._config.log_level:
            logger.setLevel(getattr(logging, str(self._config.log_level).upper()))

    def _init_device(self) -> torch.device:
        accelerator = get_accelerator()
        if accelerator.device_name() != "cpu":
            accelerator.set_device(self.local_rank)
            return accelerator.device(self.local_rank)
        return torch.device("cpu")

    def _init_module(self, model: torch.nn.Module) -> None:
        self.module = model
        # Params partitioned by zero.Init (they have a ds_id) were broadcast and cast at construction.
        if self.precision.low_precision:
            for param in model.parameters():
                if param.is_floating_point() and not hasattr(param, "ds_id"):
                    param.data = param.data.to(self.precision.param_dtype)
        model.to(self.device)
        # MoE layers get their groups (engine_moe.py); inactive without MoE layers.
        self.moe = EngineMoE(model, self.run_groups, self._config.use_data_before_expert_parallel_)
        broadcast_module_from_rank0(model, self.dp_group)
        self.moe.broadcast_expert_params()
        self.param_names = {param: name for name, param in model.named_parameters()}

    def _init_dataloader(self, training_data: Any, collate_fn: Any) -> DeepSpeedDataLoader | None:
        if training_data is None:
            return None
        return DeepSpeedDataLoader(
            training_data, batch_size=self.train_micro_batch_size_per_gpu(), pin_memory=True,
            local_rank=self.local_rank, collate_fn=collate_fn,
            data_parallel_world_size=self.dp_world_size,
            data_parallel_rank=comm.get_rank(self.data_parallel_group), dataloader_drop_last=self._config.dataloader_drop_last)

    def deepspeed_io(self, dataset: Any, batch_size: int | None = None, collate_fn: Any = None,
                     **kwargs: Any) -> DeepSpeedDataLoader:
        return DeepSpeedDataLoader(
            dataset, batch_size=batch_size or self.train_micro_batch_size_per_gpu(), pin_memory=True,
            local_rank=self.local_rank, collate_fn=collate_fn, data_parallel_world_size=self.dp_world_size,
            data_parallel_rank=comm.get_rank(self.data_parallel_group),
            dataloader_drop_last=self._config.dataloader_drop_last)

    def _init_optimizer(self, client_optimizer: Any, model_parameters: Any) -> None:
        # Every ZeRO stage trains MoE layers (stage 3: [Note: MoE at stage 3] in stage3_gradients.py).
        model_parameters = self.moe.optimizer_parameters(model_parameters, client_optimizer)
        self.basic_optimizer = configure_basic_optimizer(self._config, self.module, client_optimizer,
                                                         model_parameters)
        self.optimizer = build_optimizer_wrapper(self.basic_optimizer, self._config, self.precision,
                                                 self.dp_group, self.param_names, self.module, self.run_groups)

    def _init_monitoring(self) -> None:
        from zerospeed.runtime.engine_monitoring import EngineMonitoring

        self.monitoring = EngineMonitoring(self._config, self.train_batch_size(), self.global_rank)
        if self.training_dataloader is not None:
            self.training_dataloader.tput_timer = self.monitoring.tput_timer

    # --- forward / backward / step ------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        self.monitoring.on_forward(inputs, kwargs)
        profiling = self.monitoring.profiling_this_step(self)
        if profiling:
            self.monitoring.start_flops_profile(self)
        self.monitoring.start("fwd")
        if self._config.fp16_enabled and self._config.fp16.auto_cast:
            # only with fp16 on: DeepSpeed casts even when fp16 is off, which breaks an fp32 model
            inputs = cast_inputs(inputs, torch.float16)
        output = self.module(*inputs, **kwargs)
        self.monitoring.stop("fwd")
        if profiling:
            self.monitoring.stop_flops_profile()
        return output

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        if self._training_optimizer is None:
            raise RuntimeError(NO_OPTIMIZER.format("backward"))
        assert loss.dim() == 0 and loss.requires_grad, "backward expects a scalar loss with a grad_fn"
        self.monitoring.start("bwd")
        if scale_wrt_gas and self.gradient_accumulation_steps() > 1:
            loss = loss / self.gradient_accumulation_steps()
        self.monitoring.record_loss(loss.detach())
        self.optimizer.prepare_backward(self.is_gradient_accumulation_boundary() and not self._inside_no_sync)
        self.monitoring.start("bwd_inner")
        self.optimizer.scale_loss(loss).backward(retain_graph=retain_graph)
        self.monitoring.stop("bwd_inner")
        if not self._inside_no_sync:
            self.monitoring.start("bwd_allreduce")
            self.optimizer.backward_epilogue(self.is_gradient_accumulation_boundary())
            self.monitoring.stop("bwd_allreduce")
        self.monitoring.stop("bwd")
        return loss

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        self._boundary_override = is_boundary

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        assert not self._inside_no_sync, "It is illegal to call Engine.step() inside no_sync context manager"
        if self._training_optimizer is None:
            raise RuntimeError(NO_OPTIMIZER.format("step"))
        is_boundary = self.is_gradient_accumulation_boundary()
        if is_boundary:
            self.monitoring.start("step")
            self.gas_boundary_ctr += 1
            self._take_model_step(lr_kwargs)
            self.monitoring.stop("step")
        self.monitoring.on_micro_step_end(is_boundary)
        if is_boundary:
            self.monitoring.on_boundary(self)
        self.micro_steps += 1

    def _take_model_step(self, lr_kwargs: dict[str, Any] | None) -> None:
        self.optimizer.step()
        self._global_grad_norm = self.optimizer.get_global_grad_norm()
        self.optimizer.zero_grad()
        overflow = bool(self.optimizer.overflow)
        self._step_applied = not overflow
        if overflow:
            self.skipped_steps += 1
            logger.warning("[Rank %d] step %d skipped: gradients overflowed; loss scale now %s "
                           "(%d steps skipped so far)", self.global_rank, self.global_steps + 1,
                           self.optimizer.cur_scale, self.skipped_steps)
        elif self.lr_scheduler is not None:
            self._step_scheduler(lr_kwargs or {})
        steps_per_print = self.steps_per_print()
        if steps_per_print and (self.global_steps + 1) % steps_per_print == 0:
            self._report_progress(self.global_steps + 1)
        self.global_steps += 1
        self.global_samples += self.train_batch_size()

    def _step_scheduler(self, lr_kwargs: dict[str, Any]) -> None:
        try:
            self.lr_scheduler.step(**lr_kwargs)
        except TypeError:
            self.lr_scheduler.step(self.train_batch_size())  # Megatron's scheduler signature

    def _report_progress(self, step: int) -> None:
        log_dist(f"step={step}, skipped={self.skipped_steps}, lr={self.get_lr()}, mom={self.get_mom()}", ranks=[0])

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        assert self._training_optimizer is None or self.optimizer.supports_no_sync, \
            f"no_sync context manager is incompatible with gradient partitioning logic of ZeRO stage {self._config.zero_optimization_stage}"
        assert not self._inside_no_sync, "no_sync context manager reentry is unsupported"
        self._inside_no_sync = True
        try:
            yield
        finally:
            self._inside_no_sync = False

    @property
    def _training_optimizer(self) -> Any:
        """The optimizer wrapper, None without an optimizer ([Note: engine without an optimizer])."""
        return self.optimizer if self.__dict__.get("_has_optimizer", False) else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.module.parameters():
            if set_to_none or param.grad is None:
                param.grad = None
            else:
                param.grad.zero_()

    def train(self, mode: bool = True) -> DeepSpeedEngine:
        self.module.train(mode)
        return self

    def eval(self) -> DeepSpeedEngine:
        self.module.eval()
        return self

    # --- checkpoints (runtime/engine_checkpointer.py) ------------------------------------------------
    def save_checkpoint(self, save_dir: str, tag: Any = None, client_state: dict[str, Any] = {},  # noqa: B006
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        return self.checkpointer.save(save_dir, tag, client_state, save_latest, exclude_frozen_parameters)

    def load_checkpoint(self, load_dir: str, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None) -> tuple[Any, Any]:
        return self.checkpointer.load(load_dir, tag, load_module_strict, load_optimizer_states,
                                      load_lr_scheduler_states, load_module_only, custom_load_fn)

    def _checkpoint_site(self) -> CheckpointSite:
        """Where this rank's checkpoint files go (the pipeline engine has its own)."""
        return plain_checkpoint_site(self.module, self.tensor_parallel.setup, self.dp_group, self.bfloat16_enabled())

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes this rank holds for lp params, grads, fp32 masters and optimizer states (ours)."""
        if self._training_optimizer is None:
            raise RuntimeError(NO_OPTIMIZER.format("memory_breakdown"))
        return self.optimizer.memory_breakdown()

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Rank 0 writes the full 16-bit (model dtype) state_dict; at stage 3 only when
        `stage3_gather_16bit_weights_on_model_save` is on (else it logs and returns False)."""
        import os

        if not self._saves_16bit_model():
            logger.info("Did not save the model %s because stage3_gather_16bit_weights_on_model_save is "
                        "False", os.path.join(save_dir, save_filename))
            return False
        state_dict = self._module_state_dict_16bit(exclude_frozen_parameters)
        state_dict = self.tensor_parallel.full_weights(state_dict)  # AutoTP: every tp rank takes part
        if self.global_rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            torch.save(state_dict, os.path.join(save_dir, save_filename))
        comm.barrier()
        return True

    save_fp16_model = save_16bit_model

    def _saves_16bit_model(self) -> bool:
        if self._training_optimizer is not None:
            return bool(self.optimizer.saves_16bit_model())
        return self.optimizer is None or self.zero_gather_16bit_weights_on_model_save()

    def _module_state_dict_16bit(self, exclude_frozen_parameters: bool) -> dict[str, Any] | None:
        """The whole model's weights in the model dtype (None off dp rank 0 at stage 3)."""
        if self._training_optimizer is not None:
            return self.optimizer.module_state_dict_16bit(self.module, exclude_frozen_parameters)
        if self.optimizer is None:
            return self.module.state_dict()
        return self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, Any] | None:
        from zerospeed.runtime.zero.partition_parameters import consolidated_16bit_state_dict

        return consolidated_16bit_state_dict(self.module, exclude_frozen_parameters, self.dp_group)

    def set_train_batch_size(self, train_batch_size: int) -> None:
        per_step = self.train_micro_batch_size_per_gpu() * self.dp_world_size
        if train_batch_size % per_step != 0:
            raise ValueError("Train batch size must be divisible by micro-batch data parallelism")
        self._config.gradient_accumulation_steps = train_batch_size // per_step
        self._config.train_batch_size = train_batch_size

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        self._config.train_micro_batch_size_per_gpu = micro_batch_size
        self._config.train_batch_size = micro_batch_size * self.gradient_accumulation_steps() * self.dp_world_size

    def __getattr__(self, name: str) -> Any:
        # nn.Module keeps submodules in _modules; after that, fall back to the wrapped module.
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = super().__getattr__("module")
            return getattr(module, name)

