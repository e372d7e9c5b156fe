"""`init_inference`'s config (DeepSpeed's ``deepspeed.inference.config``: keys, aliases, defaults).

One `DeepSpeedInferenceConfig` is built from ``config=`` (a dict or a JSON file) merged with the
keyword arguments (`resolve_inference_config`): a key given both ways must carry the same value,
as in DeepSpeed 0.19.8. Unknown keys are errors with a did-you-mean (DeepSpeed's model forbids
extra keys too). The deprecated flat keys (``mp_size``, ``mpu``, ``ep_size``...) move into their
sections; giving a deprecated key and its replacement together is an error naming both.

[Note: what inference refuses]
zerospeed has no inference kernels: kernel injection (``replace_with_kernel_inject`` /
``kernel_inject``), CUDA graphs (``enable_cuda_graph``), Triton kernels (``use_triton``) and
int8 weight quantization (``dtype=torch.int8``) are refused by name on every host, never ignored.
Keys that only tune those kernels (``triangular_masking``, ``return_tuple``, ``transposed_mode``,
``min_out_tokens``, ``set_empty_params``, ``quant`` without int8, ``zero``) do not change the
numbers of a plain module and are accepted. Writing a resharded copy (``save_mp_checkpoint_path``)
and Megatron checkpoints (``training_mp_size`` > 1) are not implemented and are refused.
"""

from __future__ import annotations

import json
import os
from typing import Annotated, Any

import torch
from pydantic import BeforeValidator, Field, ValidationError, model_validator

from zerospeed.runtime.config_keys import _describe
from zerospeed.runtime.config_utils import ConfigError, DeepSpeedConfigModel, parse_dtype

__all__ = ["DeepSpeedInferenceConfig", "DeepSpeedMoEConfig", "DeepSpeedTPConfig", "InferenceCheckpointConfig",
           "QuantizationConfig", "resolve_inference_config"]


def _inference_dtype(value: Any) -> Any:
    # DeepSpeed's DtypeEnum also names int8 (its MoQ weight quantization).
    if isinstance(value, str) and value.lower() in ("int8", "torch.int8"):
        return torch.int8
    return parse_dtype(value)


Dtype = Annotated[torch.dtype, BeforeValidator(_inference_dtype)]


class DeepSpeedTPConfig(DeepSpeedConfigModel):
    """``tensor_parallel`` (alias ``tp``)."""

    enabled: bool = True
    tp_size: int = Field(1, ge=1)
    """Ranks the model is split over (AutoTP)."""
    tp_grain_size: int = Field(64, ge=1)
    """DeepSpeed's granularity of uneven splits; zerospeed splits evenly (whole heads) and ignores it."""
    mpu: Any = None
    """A Megatron-style mpu: its model-parallel group becomes the tensor-parallel group."""
    tp_group: Any = None
    """A ready tensor-parallel group; must hold the ranks zerospeed's layout assigns."""


class DeepSpeedMoEConfig(DeepSpeedConfigModel):
    """``moe``: DeepSpeed-MoE inference kernels (zerospeed refuses models with MoE layers)."""

    enabled: bool = True
    ep_size: int = 1
    moe_experts: list[int] = Field([1], alias="num_experts")
    type: str = "standard"
    ep_mp_group: Any = None
    ep_group: Any = Field(None, alias="expert_group")


class _BaseQuant(DeepSpeedConfigModel):
    enabled: bool = True
    num_bits: int = 8
    q_type: str = "symmetric"
    q_groups: int = 1


class _WeightQuant(_BaseQuant):
    quantized_initialization: dict[str, Any] = {}
    post_init_quant: dict[str, Any] = {}


class _QKVQuant(DeepSpeedConfigModel):
    enabled: bool = True


class QuantizationConfig(DeepSpeedConfigModel):
    """``quant``: MoQ settings, read by DeepSpeed only with ``dtype=torch.int8`` (refused here)."""

    enabled: bool = True
    activation: _BaseQuant = Field(default_factory=_BaseQuant)
    weight: _WeightQuant = Field(default_factory=_WeightQuant)
    qkv: _QKVQuant = Field(default_factory=_QKVQuant)


class InferenceCheckpointConfig(DeepSpeedConfigModel):
    """``checkpoint_config`` (alias ``ckpt_config``)."""

    checkpoint_dir: str | None = None
    save_mp_checkpoint_path: str | None = None
    base_dir: str | None = None


class DeepSpeedInferenceConfig(DeepSpeedConfigModel):
    """Everything `init_inference` reads; DeepSpeed's field names, aliases and defaults."""

    replace_with_kernel_inject: bool = Field(False, alias="kernel_inject")
    """Inference kernels: refused ([Note: what inference refuses])."""
    dtype: Dtype = torch.float16
    """The model is converted to this dtype first (DeepSpeed's default: fp16)."""
    tensor_parallel: DeepSpeedTPConfig = Field(default_factory=DeepSpeedTPConfig, alias="tp")  # type: ignore[arg-type]
    enable_cuda_graph: bool = False
    use_triton: bool = False
    triton_autotune: bool = False
    zero: dict[str, Any] = {}
    """ZeRO-Inference settings; DeepSpeed's InferenceEngine does not read them (accepted)."""
    triangular_masking: bool = Field(True, alias="tm")
    moe: bool | DeepSpeedMoEConfig = Field(default_factory=DeepSpeedMoEConfig)  # type: ignore[arg-type]
    keep_module_on_host: bool = False
    """Leave the module on the host instead of moving it to the accelerator's device."""
    quant: QuantizationConfig = Field(default_factory=QuantizationConfig)
    checkpoint: str | dict[str, Any] | None = None
    """A checkpoint description (dict or JSON path: ``type``, ``checkpoints``, ``version``) or a
    directory of Hugging Face safetensors; loaded straight into the shards (checkpoint_loading.py)."""
    base_dir: str = ""
    """Directory the description's ``checkpoints`` file names are relative to."""
    set_empty_params: bool = False
    save_mp_checkpoint_path: str | None = None
    checkpoint_config: InferenceCheckpointConfig = Field(default_factory=InferenceCheckpointConfig,
                                                         alias="ckpt_config")
    return_tuple: bool = True
    training_mp_size: int = 1
    replace_method: str = "auto"
    injection_policy: dict[Any, Any] | None = Field(None, alias="injection_dict")
    """``{block class: names of its row-parallel (all-reduce) linears}``: the block's other linears
    are column-parallel, everything outside such blocks stays replicated."""
    injection_policy_tuple: tuple[Any, ...] | None = None
    config: dict[str, Any] | None = Field(None, alias="args")
    max_out_tokens: int = Field(1024, alias="max_tokens", gt=0)
    """`generate` refuses prompts longer than this (DeepSpeed's check)."""
    min_out_tokens: int = Field(1, alias="min_tokens")
    transposed_mode: bool = False

    @model_validator(mode="before")
    @classmethod
    def _move_deprecated(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.get("replace_method", "auto") != "auto":
            data["replace_method"] = "auto"   # DeepSpeed: "no longer needed"; it selects nothing
        tp, moe = _section(data, "tensor_parallel", "tp"), _section(data, "moe", None)
        sections = {"tensor_parallel": tp, "moe": moe}
        for old, home, new in _DEPRECATED:
            if old not in data:
                continue
            if new in sections[home]:
                raise ValueError(f"init_inference: the deprecated '{old}' and its replacement '{home}.{new}' are "
                                 "both given; keep only the second")
            sections[home][new] = data.pop(old)
        if tp:
            data.pop("tp", None)
            data["tensor_parallel"] = tp
        if moe and not isinstance(data.get("moe"), bool):
            data["moe"] = moe
        return data

    @model_validator(mode="after")
    def _refuse_kernels(self) -> DeepSpeedInferenceConfig:
        # [Note: what inference refuses]
        for key, on in (("replace_with_kernel_inject", self.replace_with_kernel_inject),
                        ("enable_cuda_graph", self.enable_cuda_graph), ("use_triton", self.use_triton),
                        ("triton_autotune", self.triton_autotune)):
            if on:
                raise ValueError(f"{key}=True needs DeepSpeed's CUDA/Triton inference kernels, which zerospeed does "
                                 f"not have; leave {key} False (AutoTP shards the unmodified model)")
        if self.dtype == torch.int8:
            raise ValueError("dtype=torch.int8 (MoQ weight quantization kernels) is not supported by zerospeed; "
                             "use torch.float32, torch.float16 or torch.bfloat16")
        for key, value in (("save_mp_checkpoint_path", self.save_mp_checkpoint_path),
                           ("checkpoint_config.save_mp_checkpoint_path", self.checkpoint_config.save_mp_checkpoint_path)):
            if value:
                raise ValueError(f"{key} (writing a resharded copy of the checkpoint) is not implemented in zerospeed")
        if self.training_mp_size != 1:
            raise ValueError("training_mp_size != 1 (merging Megatron model-parallel checkpoints) is not "
                             "implemented in zerospeed")
        return self


# DeepSpeed's deprecated flat keys: old key -> (section, key there).
_DEPRECATED = (("mp_size", "tensor_parallel", "tp_size"), ("mpu", "tensor_parallel", "mpu"),
               ("ep_size", "moe", "ep_size"), ("ep_group", "moe", "ep_group"), ("expert_group", "moe", "ep_group"),
               ("ep_mp_group", "moe", "ep_mp_group"), ("expert_mp_group", "moe", "ep_mp_group"),
               ("moe_experts", "moe", "moe_experts"), ("moe_type", "moe", "type"))


def _section(data: dict[str, Any], key: str, alias: str | None) -> dict[str, Any]:
    for name in (key, alias):
        value = data.get(name) if name else None
        if isinstance(value, dict):
            return dict(value)
    return {}


def _load_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ValueError(f"init_inference: config file {path!r} does not exist")
    with open(path) as handle:
        loaded = json.load(handle)
    if not isinstance(loaded, dict):
        raise ValueError(f"init_inference: config file {path!r} must hold a JSON object")
    return loaded


def resolve_inference_config(config: str | dict[str, Any] | None, kwargs: dict[str, Any]) -> DeepSpeedInferenceConfig:
    """``config`` (dict, JSON path or None) merged with the keyword arguments, validated."""
    if config is None:
        raw: dict[str, Any] = {}
    elif isinstance(config, str):
        raw = _load_json(config)
    elif isinstance(config, dict):
        raw = dict(config)
    else:
        raise ValueError(f"init_inference: 'config' must be a dict or a path to a JSON file, got {type(config).__name__}")
    for key in set(raw) & set(kwargs):
        if raw[key] != kwargs[key]:
            raise ValueError(f"Conflicting argument '{key}' in 'config':{raw[key]} and kwargs:{kwargs[key]}")
    raw.update(kwargs)
    try:
        return DeepSpeedInferenceConfig.model_validate(raw)
    except ValidationError as exc:
        lines = [_describe(DeepSpeedInferenceConfig, error, "") for error in exc.errors()]
        raise ConfigError("Invalid init_inference config:\n  " + "\n  ".join(lines)) from None
