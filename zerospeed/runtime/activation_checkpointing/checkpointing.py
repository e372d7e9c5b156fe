"""`deepspeed.checkpointing`: configure once, then `checkpoint(function, *args, **kwargs)`.

DeepSpeed keeps this configuration in module globals that `configure()` rewrites, and client
libraries (Lightning, Megatron, GPT-NeoX) call it that way, so the settings here are one module
level `CheckpointingSettings` that `configure()` replaces as a whole.

`configure()` order is DeepSpeed's: defaults first, then the ds_config's `activation_checkpointing`
block, then each explicit argument that is not None. Unlike DeepSpeed, option dependencies are
errors (`ValueError`) rather than asserts, `checkpoint_in_cpu` works without partitioning, and any
activation size can be partitioned (padded), not only multiples of the model-parallel size.

[Note: checkpointing's tensor-parallel rank]
The model-parallel RNG tracker's seed (`seed + 2718 + tp_rank`) and the group activations are
partitioned over need this rank's tensor-parallel rank and group. An mpu given to `configure`
(DeepSpeed's public API: Megatron's or the user's) wins, read by the getter names it has; without
one they are the run's tensor-parallel group ([Note: run groups] in comm/run_groups.py): AutoTP's
group, or none (rank 0, no partitioning) for a run without tensor parallelism.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from zerospeed import comm
from zerospeed.comm import groups
from zerospeed.comm.run_groups import AxisGroup
from zerospeed.runtime.activation_checkpointing.checkpoint_function import run_checkpointed
from zerospeed.runtime.activation_checkpointing.config import (
    DeepSpeedActivationCheckpointingConfig,
    activation_checkpointing_block,
)
from zerospeed.runtime.activation_checkpointing.rng import (
    CudaRNGStatesTracker,
    RngSnapshot,
    get_cuda_rng_tracker,
    reseed_tensor_parallel,
    seed_model_parallel,
)
from zerospeed.runtime.activation_checkpointing.saved_inputs import PartitionGroup
from zerospeed.utils.logging import log_dist, logger

__all__ = [
    "CheckpointingSettings",
    "CudaRNGStatesTracker",
    "checkpoint",
    "configure",
    "configure_from_ds_config",
    "get_cuda_rng_tracker",
    "get_mpu",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "model_parallel_reconfigure_tp_seed",
    "non_reentrant_checkpoint",
    "partition_activations_in_checkpoint",
    "reset",
    "set_num_layers",
]


@dataclasses.dataclass
class CheckpointingSettings:
    """What `configure()` decided; DeepSpeed's globals under their config-key meaning."""

    partition_activations: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    cpu_checkpointing: bool = False
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False

    def validate(self) -> None:
        if self.contiguous_memory_optimization and not self.partition_activations:
            raise ValueError("activation_checkpointing.contiguous_memory_optimization requires "
                             "partition_activations=true")
        if self.contiguous_memory_optimization and self.number_checkpoints is None:
            raise ValueError("activation_checkpointing.contiguous_memory_optimization requires "
                             "number_checkpoints (num_checkpoints=) to size its buffers")


_settings = CheckpointingSettings()
_configured = False
_mpu: Any = None
_partition = PartitionGroup()


def get_mpu() -> Any:
    """The model-parallel unit given to `configure` (None when there is none)."""
    return _mpu


def _run_tensor_parallel() -> AxisGroup | None:
    """The current run's tensor-parallel group ([Note: checkpointing's tensor-parallel rank])."""
    run = groups.get_run_groups()
    return None if run is None else run.tensor_parallel


def _tensor_parallel_rank(mpu: Any) -> int:
    """This rank's tensor-parallel rank by the configured mpu (Megatron's and DeepSpeed's getter
    names differ between versions), else by the run's groups; 0 without either."""
    if mpu is None:
        tp = _run_tensor_parallel()
        return 0 if tp is None else tp.rank_of(comm.get_rank())
    for getter in ("get_tensor_model_parallel_rank", "get_model_parallel_rank", "get_slice_parallel_rank"):
        if hasattr(mpu, getter):
            return int(getattr(mpu, getter)())
    return 0


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """DeepSpeed's name: seed the default generator with `seed` and the model-parallel tracker with
    `seed + 2718 + tp_rank`, the tp rank from the mpu given to `configure`, else from the run's groups
    ([Note: checkpointing's tensor-parallel rank])."""
    seed_model_parallel(seed, _tensor_parallel_rank(_mpu))


def model_parallel_reconfigure_tp_seed(seed: int) -> None:
    reseed_tensor_parallel(seed, _tensor_parallel_rank(_mpu))


def _partition_group(mpu: Any) -> PartitionGroup:
    if mpu is None:
        tp = _run_tensor_parallel()
        return PartitionGroup() if tp is None else PartitionGroup(tp.rank_of(comm.get_rank()), tp.size, tp.group)
    prefix = "get_tensor_model_parallel" if hasattr(mpu, "get_tensor_model_parallel_rank") else "get_model_parallel"
    return PartitionGroup(int(getattr(mpu, f"{prefix}_rank")()), int(getattr(mpu, f"{prefix}_world_size")()),
                          getattr(mpu, f"{prefix}_group")())


def configure(mpu_: Any = None, deepspeed_config: Any = None, partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None,
              profile: bool | None = None) -> None:
    """Configure activation checkpointing (DeepSpeed's signature and precedence)."""
    global _settings, _configured, _mpu, _partition
    settings = CheckpointingSettings()
    if mpu_ is not None:
        _mpu = mpu_
    if deepspeed_config is not None:
        block: DeepSpeedActivationCheckpointingConfig = activation_checkpointing_block(deepspeed_config)
        settings = CheckpointingSettings(**block.model_dump())
    overrides: dict[str, Any] = {"partition_activations": partition_activations, "contiguous_memory_optimization":
                 contiguous_checkpointing, "number_checkpoints": num_checkpoints,
                 "cpu_checkpointing": checkpoint_in_cpu, "synchronize_checkpoint_boundary": synchronize,
                 "profile": profile}
    settings = dataclasses.replace(settings, **{k: v for k, v in overrides.items() if v is not None})
    settings.validate()
    if settings.contiguous_memory_optimization:
        logger.warning("activation_checkpointing.contiguous_memory_optimization is accepted but has no effect in "
                       "zerospeed: partitions are ordinary allocations (see docs/compatibility.md)")
    _settings, _partition, _configured = settings, _partition_group(_mpu), True
    log_dist(f"Activation Checkpointing Information: partition activations {settings.partition_activations}, "
             f"CPU checkpointing {settings.cpu_checkpointing}, contiguous memory "
             f"{settings.contiguous_memory_optimization} with {settings.number_checkpoints} total layers, "
             f"synchronize {settings.synchronize_checkpoint_boundary}, profile {settings.profile}", ranks=[0])


def is_configured() -> bool:
    """True once `configure()` has run."""
    return _configured


def current_settings() -> CheckpointingSettings:
    return _settings


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run `function(*args, **kwargs)` keeping only its inputs; recompute it in backward with the
    forward's CPU, accelerator and model-parallel-tracker random states, so dropout matches a run
    without checkpointing bit for bit. Returns whatever `function` returns."""
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)  # nothing will be recomputed: run it plainly
    partition = _partition if _settings.partition_activations else None
    return run_checkpointed(function, args, kwargs, partition, _settings.cpu_checkpointing,
                            _settings.synchronize_checkpoint_boundary, _settings.profile)


def non_reentrant_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """torch's non-reentrant checkpoint, with the model-parallel RNG tracker replayed as well
    (torch replays the CPU and device generators itself)."""
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    def contexts() -> tuple[Any, Any]:
        import contextlib

        snapshot = RngSnapshot.capture()
        return contextlib.nullcontext(), _TrackerReplay(snapshot)

    return torch_checkpoint(function, *args, use_reentrant=False, context_fn=contexts, **kwargs)


class _TrackerReplay:
    def __init__(self, snapshot: RngSnapshot) -> None:
        self._snapshot = snapshot
        self._saved: dict[str, torch.Tensor] | None = None

    def __enter__(self) -> None:
        tracker = get_cuda_rng_tracker()
        self._saved = tracker.get_states()
        tracker.set_states(dict(self._snapshot.tracker))

    def __exit__(self, *exc: Any) -> None:
        assert self._saved is not None
        get_cuda_rng_tracker().set_states(self._saved)


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    global _settings
    _settings = dataclasses.replace(_settings, partition_activations=partition_activation)
    log_dist(f"Partition Activations {partition_activation}", ranks=[0])


def set_num_layers(nlayers: int) -> None:
    global _settings
    _settings = dataclasses.replace(_settings, number_checkpoints=nlayers)


def reset() -> None:
    """DeepSpeed frees its contiguous buffers here; zerospeed keeps none, so nothing is held."""


def configure_from_ds_config(ds_config: Any, mpu: Any = None) -> bool:
    """What `initialize` does (DeepSpeed does not): apply a present `activation_checkpointing`
    block, so the block alone takes effect. Returns whether it did."""
    raw = getattr(ds_config, "_param_dict", None)
    if not isinstance(raw, dict) or "activation_checkpointing" not in raw:
        return False
    configure(mpu, deepspeed_config=ds_config)
    return True
