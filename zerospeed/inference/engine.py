"""`InferenceEngine`: the module `init_inference` returns (DeepSpeed's ``deepspeed.inference.engine``).

Construction, in order (DeepSpeed 0.19.8's, minus the kernels):

1. the model is converted to ``config.dtype`` (DeepSpeed's default fp16: pass ``dtype=`` for
   another);
2. with ``tensor_parallel.tp_size`` > 1 the process group is initialized if it is not, and the
   model is cut by AutoTP over the tensor-parallel group (sharding.py);
3. ``checkpoint=`` fills the shards, each rank reading only its slices (checkpoint_loading.py);
4. the module moves to the accelerator's device unless ``keep_module_on_host``;
5. the tp ranks share one RNG state, so sampling in `generate` picks the same tokens on every
   rank of a replica.

`forward` calls the module; `generate` (set when the module has one) checks the prompt length
against ``max_out_tokens`` and calls the module's. Kernel-only options are refused when the
config is validated ([Note: what inference refuses] in config.py).
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

import torch

from zerospeed import comm
from zerospeed.inference.checkpoint_loading import checkpoint_files, load_into_shards
from zerospeed.inference.config import DeepSpeedInferenceConfig
from zerospeed.inference.sharding import shard_for_inference, tensor_parallel_group
from zerospeed.runtime.tensor_parallel.plan import Partition

__all__ = ["InferenceEngine"]


class InferenceEngine(torch.nn.Module):
    """A model prepared for inference: ``engine(...)`` runs ``engine.module(...)``."""

    inference_mp_group: ClassVar[Any] = None   # DeepSpeed's class attribute: the last tp group built
    module: torch.nn.Module

    def __init__(self, model: torch.nn.Module, config: DeepSpeedInferenceConfig) -> None:
        super().__init__()
        self.module = model
        self._config = config
        self._get_model_config_generate(config)
        if hasattr(self.module, "generate"):
            self.generate = self._generate
        self.injection_dict = config.injection_policy
        self.mpu = config.tensor_parallel.mpu
        self.quantize_merge_count, self.quantization_scales = 1, None
        self.ep_group = self.expert_mp_group = None
        self.cuda_graph_created = self.local_cuda_graph = self._is_compiled = False
        self.model_profile_enabled = False
        self._model_times: list[float] = []
        self._refuse_moe()
        self._convert_to_dtype(config)
        self._tie_empty_weights()
        self.mp_group = self._init_tensor_parallel(config)
        self.tp_plan: dict[str, Partition] = {}
        if self.mp_group is not None:
            self.tp_plan = shard_for_inference(self.module, config, self.mp_group)
        if config.checkpoint is not None:
            load_into_shards(self.module, checkpoint_files(config.checkpoint, config.base_dir))
        self._place_module(config)
        self._share_rng_state()

    # --- construction -----------------------------------------------------------------------

    def _get_model_config_generate(self, config: DeepSpeedInferenceConfig) -> None:
        # DeepSpeed keeps this for "weird backward compatibility": the HF config, or `config=`.
        self.config = getattr(self.module, "config", None) if config.config is None else config.config

    def _refuse_moe(self) -> None:
        from zerospeed.moe.utils import has_moe_layers

        if has_moe_layers(self.module)[0]:
            raise ValueError("init_inference on a model with DeepSpeed MoE layers (DeepSpeed-MoE inference kernels) "
                             "is not supported by zerospeed")

    def _convert_to_dtype(self, config: DeepSpeedInferenceConfig) -> None:
        if config.dtype in (torch.float16, torch.bfloat16, torch.float32):
            self.module.to(config.dtype)

    def _tie_empty_weights(self) -> None:
        # A model built on the meta device (accelerate's init_empty_weights) lost its tied output
        # head: re-tie it before the cut, so the plan sees it tied (replicated) and the checkpoint's
        # one embedding fills both (HF's from_pretrained ties after loading; DeepSpeed re-ties too).
        if hasattr(self.module, "tie_weights") and any(p.is_meta for p in self.module.parameters()):
            getattr(self.module, "tie_weights")()  # noqa: B009 - an HF method, not typed on nn.Module

    def _init_tensor_parallel(self, config: DeepSpeedInferenceConfig) -> Any:
        tp = config.tensor_parallel
        if tp.tp_size <= 1 and tp.mpu is None:
            return None
        comm.init_distributed()
        group = tensor_parallel_group(config)
        if group is not None:
            tp.tp_size = comm.get_world_size(group)
            tp.tp_group = InferenceEngine.inference_mp_group = group
        return group

    def _place_module(self, config: DeepSpeedInferenceConfig) -> None:
        from zerospeed.accelerator import get_accelerator

        meta = [name for name, p in self.module.named_parameters() if p.is_meta]
        if meta:
            raise ValueError(f"init_inference: parameter {meta[0]} is on the meta device and no checkpoint= filled "
                             "it; pass checkpoint= (a description JSON or a safetensors directory)")
        if not config.keep_module_on_host:
            self.module.to(get_accelerator().current_device_name())

    def _share_rng_state(self) -> None:
        if self.mp_group is None:
            return
        state = torch.get_rng_state()
        comm.broadcast(state, src=comm.get_global_rank(self.mp_group, 0), group=self.mp_group)
        torch.set_rng_state(state)

    # --- DeepSpeed's surface ----------------------------------------------------------------

    @property
    def mp_world_size(self) -> int:
        """Ranks the model is split over (1 without tensor parallelism)."""
        return 1 if self.mp_group is None else comm.get_world_size(self.mp_group)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        start = time.perf_counter() if self.model_profile_enabled else 0.0
        outputs = self.module(*inputs, **kwargs)
        if self.model_profile_enabled:
            self._model_times.append((time.perf_counter() - start) * 1e3)
        return outputs

    def _generate(self, *inputs: Any, **kwargs: Any) -> Any:
        if hasattr(self.module, "reset_cache"):
            getattr(self.module, "reset_cache")()  # noqa: B009
        ids = kwargs.get("input_ids", inputs[0] if inputs and torch.is_tensor(inputs[0]) else None)
        if ids is not None and ids.dim() == 2 and ids.shape[-1] > self._config.max_out_tokens:
            raise RuntimeError(f"Input with size {ids.shape[-1]} exceeds maximum length of "
                               f"{self._config.max_out_tokens}. Please increase max_tokens in the DeepSpeed "
                               "Inference Config.")
        return getattr(self.module, "generate")(*inputs, **kwargs)  # noqa: B009

    def profile_model_time(self, use_cuda_events: bool = True) -> None:
        """Record each forward's wall time in milliseconds (`model_times`)."""
        self.model_profile_enabled = True

    def model_times(self) -> list[float]:
        """The recorded forward times (ms), cleared on read (DeepSpeed's behaviour)."""
        if not self.model_profile_enabled:
            raise AssertionError("model profiling is not enabled; call profile_model_time() first")
        times, self._model_times = self._model_times, []
        return times

    def compile(self, backend: str | None = None, compile_kwargs: dict[str, Any] | None = None) -> None:  # type: ignore[override]
        """torch.compile the module in place (once)."""
        if self._is_compiled:
            return
        self.module.compile(backend=backend or "inductor", **(compile_kwargs or {}))
        self._is_compiled = True

    @property
    def is_compiled(self) -> bool:
        return self._is_compiled

    def destroy(self) -> None:
        """DeepSpeed frees its kernel workspace here; zerospeed has none."""
