"""`deepspeed.checkpointing`: the public face of activation checkpointing.

DeepSpeed exposes `deepspeed.checkpointing` as its module
`deepspeed.runtime.activation_checkpointing.checkpointing`; this module re-exports that API so
`zerospeed.checkpointing.configure(...)` and `.checkpoint(...)` behave the same.
"""

from zerospeed.runtime.activation_checkpointing.checkpointing import (
    CudaRNGStatesTracker,
    checkpoint,
    configure,
    get_cuda_rng_tracker,
    is_configured,
    model_parallel_cuda_manual_seed,
    model_parallel_reconfigure_tp_seed,
    non_reentrant_checkpoint,
    partition_activations_in_checkpoint,
    reset,
    set_num_layers,
)

__all__ = [
    "CudaRNGStatesTracker",
    "checkpoint",
    "configure",
    "get_cuda_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "model_parallel_reconfigure_tp_seed",
    "non_reentrant_checkpoint",
    "partition_activations_in_checkpoint",
    "reset",
    "set_num_layers",
]
