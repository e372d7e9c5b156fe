"""zerospeed: DeepSpeed's interface, a lean runtime. `import zerospeed as deepspeed` and go."""

from __future__ import annotations

import argparse
from typing import Any

from zerospeed.utils import heartbeat as _heartbeat
from zerospeed.utils.logging import log_dist, logger
from zerospeed.version import (
    __git_branch__,
    __git_hash__,
    __version__,
    __version_major__,
    __version_minor__,
    __version_patch__,
)

_heartbeat.install()  # under the launcher: the hang report's heartbeat and stack dump
dist = None  # DeepSpeed's module global: `zerospeed.comm` once initialize() has run


def initialize(args: Any = None, model: Any = None, optimizer: Any = None, model_parameters: Any = None,
               training_data: Any = None, lr_scheduler: Any = None, distributed_port: int = 29500,
               mpu: Any = None, dist_init_required: bool | None = None, collate_fn: Any = None,
               config: Any = None, mesh_param: Any = None, config_params: Any = None) -> tuple[Any, Any, Any, Any]:
    """Build the training engine; returns `(engine, optimizer, training_dataloader, lr_scheduler)`."""
    global dist
    from zerospeed import comm
    from zerospeed.accelerator import get_accelerator
    from zerospeed.comm import init_distributed
    from zerospeed.runtime.engine import DeepSpeedEngine

    log_dist(f"zerospeed info: version={__version__}", ranks=[0])
    assert model is not None, "deepspeed.initialize requires a model"
    init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                     distributed_port=distributed_port, dist_init_required=dist_init_required)
    dist = comm
    config = _resolve_config_source(args, config if config is not None else config_params)
    engine_class = DeepSpeedEngine
    from zerospeed.runtime.pipe.module import PipelineModule

    if isinstance(model, PipelineModule):  # DeepSpeed's rule: a PipelineModule gets the pipelined engine
        from zerospeed.runtime.pipe.engine import PipelineEngine

        engine_class, mpu = PipelineEngine, model.mpu()
    engine = engine_class(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                          training_data=training_data, lr_scheduler=lr_scheduler, mpu=mpu,
                          dist_init_required=dist_init_required, collate_fn=collate_fn, config=config)
    from zerospeed.runtime.activation_checkpointing.checkpointing import configure_from_ds_config

    configure_from_ds_config(engine._config, mpu)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _resolve_config_source(args: Any, config: Any) -> Any:
    if args is not None and getattr(args, "deepscale_config", None) is not None:
        logger.warning("--deepscale_config is deprecated, use --deepspeed_config")
        args.deepspeed_config = args.deepscale_config
    if args is not None and getattr(args, "deepspeed_config", None) is not None:
        assert config is None, "Not sure how to proceed, we were given deepspeed configs in the deepspeed " \
                               "arguments and deepspeed.initialize() function call"
        config = args.deepspeed_config
    assert config is not None, "DeepSpeed requires --deepspeed_config to specify configuration file"
    return config


def tp_model_init(model: Any, tp_size: int, dtype: Any, config: Any = None, **kwargs: Any) -> Any:
    """DeepSpeed's AutoTP entry point (transformers calls it when `tensor_parallel.autotp_size > 1`).

    As in DeepSpeed 0.19.8 it records ``tp_size``, ``dtype`` (and ``tp_group=``) and returns the model
    unchanged; `initialize` merges the record with the ds_config's ``tensor_parallel`` section and
    shards the model (docs/tensor_parallel.md). The record lives on the model, not in a global."""
    import torch

    from zerospeed.runtime.tensor_parallel.setup import record_tp_model_init

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"tp_model_init: model must be a torch.nn.Module, got {type(model).__name__}")
    record_tp_model_init(model, tp_size, dtype, kwargs.get("tp_group"))
    return model


def init_inference(model: Any, config: Any = None, **kwargs: Any) -> Any:
    """DeepSpeed's inference entry point: ``config`` (a dict or a JSON path) merged with the keyword
    arguments (a key given both ways must agree); returns an `InferenceEngine` whose module is cut
    by AutoTP when ``tensor_parallel={"tp_size": N}`` > 1 (docs/inference.md)."""
    from zerospeed.inference.config import resolve_inference_config
    from zerospeed.inference.engine import InferenceEngine

    log_dist(f"zerospeed info: version={__version__}", ranks=[0])
    return InferenceEngine(model, config=resolve_inference_config(config, kwargs))


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's argparse group: --deepspeed, --deepspeed_config (and the deprecated deepscale)."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def __getattr__(name: str) -> Any:
    # Heavy pieces load on first use, so `import zerospeed` (and every launch, and every client
    # library's `find_spec("deepspeed")` check) stays cheap. Any submodule is reachable as an
    # attribute after a bare import, as in DeepSpeed (`deepspeed.runtime.lr_schedules...`).
    import importlib

    from zerospeed.utils.lazy_modules import find_submodule

    if find_submodule(__name__, name):
        return importlib.import_module(f"zerospeed.{name}")
    if name == "init_distributed":
        from zerospeed.comm import init_distributed

        return init_distributed
    if name == "get_accelerator":
        from zerospeed.accelerator import get_accelerator

        return get_accelerator
    if name == "InferenceEngine":
        from zerospeed.inference.engine import InferenceEngine

        return InferenceEngine
    if name == "DeepSpeedEngine":
        from zerospeed.runtime.engine import DeepSpeedEngine

        return DeepSpeedEngine
    if name in ("DeepSpeedConfig", "DeepSpeedConfigError"):
        from zerospeed.runtime import config as config_module

        return getattr(config_module, name)
    if name == "DeepSpeedOptimizer":
        from zerospeed.runtime.base_optimizer import DeepSpeedOptimizer

        return DeepSpeedOptimizer
    if name == "DeepSpeedDataLoader":
        from zerospeed.runtime.dataloader import DeepSpeedDataLoader

        return DeepSpeedDataLoader
    raise AttributeError(f"module 'zerospeed' has no attribute {name!r}")


__all__ = [
    "DeepSpeedConfig", "DeepSpeedConfigError", "DeepSpeedDataLoader", "DeepSpeedEngine", "DeepSpeedOptimizer",
    "__git_branch__", "__git_hash__", "__version__", "__version_major__", "__version_minor__",
    "__version_patch__", "add_config_arguments", "comm", "dist", "get_accelerator", "init_distributed",
    "init_inference", "initialize", "InferenceEngine", "log_dist", "logger", "tp_model_init",
]
