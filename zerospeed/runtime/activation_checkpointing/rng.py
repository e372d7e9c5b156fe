"""Random-number state for activation checkpointing: capture, restore, and the model-parallel tracker.

A checkpointed function runs twice: once in forward (without saving activations) and again in
backward to rebuild them. Dropout must draw the same numbers both times, so the forward records
every generator it may use and the recompute runs with those states restored:

* the CPU generator (`torch.get_rng_state`);
* the accelerator's default generator for the current device (absent on CPU-only runs);
* the named states of the model-parallel tracker (`get_cuda_rng_tracker()`), which Megatron-style
  tensor-parallel layers fork so each tensor-parallel rank draws different dropout masks.

`RngSnapshot.capture()` / `.restore()` is that record. The tracker is DeepSpeed's
`CudaRNGStatesTracker` under DeepSpeed's names; on a CPU-only machine it forks the CPU generator,
as DeepSpeed's does on its CPU accelerator.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from zerospeed.utils.logging import logger

__all__ = [
    "CudaRNGStatesTracker",
    "RngSnapshot",
    "get_cuda_rng_tracker",
    "reseed_tensor_parallel",
    "seed_model_parallel",
]

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
_MODEL_PARALLEL_SEED_OFFSET = 2718  # DeepSpeed's and Megatron's offset: tp ranks get seed + 2718 + tp_rank


def _device_module() -> Any | None:
    """The torch device module (torch.cuda, ...) whose default generator the accelerator uses."""
    from zerospeed.accelerator import get_accelerator

    name = get_accelerator().device_name()
    if name == "cpu":
        return None
    module = getattr(torch, name, None)
    return module if module is not None and hasattr(module, "get_rng_state") else None


def get_device_rng_state() -> torch.Tensor:
    """The generator state dropout on the accelerator draws from (the CPU one on CPU runs)."""
    module = _device_module()
    return torch.get_rng_state() if module is None else module.get_rng_state()


def set_device_rng_state(state: torch.Tensor) -> None:
    module = _device_module()
    if module is None:
        torch.set_rng_state(state)
    else:
        module.set_rng_state(state)


def _device_manual_seed(seed: int) -> None:
    module = _device_module()
    if module is None:
        torch.manual_seed(seed)
    else:
        module.manual_seed(seed)


class CudaRNGStatesTracker:
    """Named generator states that code can `fork` into and out of (DeepSpeed's class and methods)."""

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        # A shallow copy: the recorded tensors are replaced, never mutated, by fork().
        return copy.copy(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists in the RNG tracker")
        if name in self.states_:
            raise ValueError(f"cuda rng state {name} already exists")
        self.seeds_.add(seed)
        original = get_device_rng_state()
        _device_manual_seed(seed)
        self.states_[name] = get_device_rng_state()
        set_device_rng_state(original)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(f"cuda rng state {name} is not added; call "
                           "deepspeed.checkpointing.model_parallel_cuda_manual_seed(seed) first")
        original = get_device_rng_state()
        set_device_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = get_device_rng_state()
            set_device_rng_state(original)


_CUDA_RNG_STATE_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    return _CUDA_RNG_STATE_TRACKER


def seed_model_parallel(seed: int, tp_rank: int) -> None:
    """Seed the default generator with `seed` (the same on every tensor-parallel rank) and the
    tracker's `model-parallel-rng` with `seed + 2718 + tp_rank` (different per tensor-parallel rank)."""
    model_parallel_seed = seed + _MODEL_PARALLEL_SEED_OFFSET + tp_rank
    logger.debug("model parallel seeds: tp rank %d, model parallel seed %d, data parallel seed %d",
                 tp_rank, model_parallel_seed, seed)
    _CUDA_RNG_STATE_TRACKER.reset()
    _device_manual_seed(seed)
    _CUDA_RNG_STATE_TRACKER.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, model_parallel_seed)


def reseed_tensor_parallel(seed: int, tp_rank: int) -> None:
    """Reseed the tracker's current state with `seed + 2718 + tp_rank`, leaving the default generator."""
    with _CUDA_RNG_STATE_TRACKER.fork():
        _device_manual_seed(seed + _MODEL_PARALLEL_SEED_OFFSET + tp_rank)


@dataclasses.dataclass
class RngSnapshot:
    """Every generator state a checkpointed function may draw from, taken before its forward."""

    cpu: torch.Tensor
    device: torch.Tensor | None
    tracker: dict[str, torch.Tensor]

    @classmethod
    def capture(cls) -> RngSnapshot:
        device = None if _device_module() is None else get_device_rng_state()
        return cls(torch.get_rng_state(), device, _CUDA_RNG_STATE_TRACKER.get_states())

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.device is not None:
            set_device_rng_state(self.device)
        # A copy: fork() writes into the tracker's dict, and this snapshot may be replayed again.
        _CUDA_RNG_STATE_TRACKER.set_states(copy.copy(self.tracker))

    @contextlib.contextmanager
    def replayed(self) -> Iterator[None]:
        """Run a block with these states, then put back the states it found."""
        current = RngSnapshot.capture()
        self.restore()
        try:
            yield
        finally:
            current.restore()
