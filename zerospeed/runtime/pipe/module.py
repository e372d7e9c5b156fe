"""`PipelineModule`, `LayerSpec`, `TiedLayerSpec`: a model as a flat list of layers split into stages.

The forward pass of a PipelineModule is the layers in order, each one's output the next one's
input. Each rank builds only the layers of its own stage(s) (`_build`): a `LayerSpec` defers
construction so the others are never allocated. With `num_chunks=v` (zerospeed, for interleaved
1F1B) the layers are split into stages*v parts and rank s holds parts s, s+S, s+2S, ...: its
chunks, each a virtual stage.

Tied layers ([Note: tied weights]): every stage that uses a `TiedLayerSpec` key builds one copy
of the module (under `tied_modules.<key>`); the copies start equal (broadcast from the lowest
rank at construction and load) and stay equal because each receives the same summed gradient
(see `PipelineEngine`'s ReduceTiedGrads). State-dict keys, the `parts` boundaries and the layer
file names are DeepSpeed's, so checkpoints cross between the two systems.
"""

from __future__ import annotations

import functools
import os
import random
from collections.abc import Callable, Sequence
from typing import Any

import torch

from zerospeed import comm
from zerospeed.runtime.activation_checkpointing import checkpointing
from zerospeed.runtime.pipe.layer_spec import LayerSpec, TiedLayerSpec
from zerospeed.runtime.pipe.partition import layer_type_name, partition_weights
from zerospeed.runtime.pipe.tied import TiedGroups
from zerospeed.runtime.pipe.topology import PipeDataParallelTopology, PipelineParallelGrid
from zerospeed.utils.logging import log_dist

__all__ = ["LayerSpec", "PipelineError", "PipelineModule", "TiedLayerSpec"]


class PipelineError(Exception):
    """Errors related to the use of PipelineModule / PipelineEngine (DeepSpeed's class)."""


def _set_random_seed(seed: int) -> None:
    """DeepSpeed's `set_random_seed` with a Python int (its numpy ints fail in random.seed on 3.11+)."""
    import numpy

    seed = int(seed)
    random.seed(seed)
    numpy.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed % (2 ** 63))


class PipelineModule(torch.nn.Module):
    """DeepSpeed's constructor and methods; `num_chunks` (default 1) is zerospeed's, for interleaving."""

    def __init__(self, layers: Sequence[Any], num_stages: int | None = None, topology: Any = None,
                 loss_fn: Callable[..., Any] | None = None, seed_layers: bool = False,
                 seed_fn: Callable[[int], None] | None = None, base_seed: int = 1234,
                 partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable[..., Any] = checkpointing.checkpoint,
                 checkpointable_layers: list[str] | None = None, dynamic_shape: bool = False,
                 num_chunks: int = 1) -> None:
        super().__init__()
        if num_stages is None and topology is None:
            raise RuntimeError("must provide num_stages or topology")
        if checkpointable_layers is not None and not isinstance(checkpointable_layers, list):
            raise TypeError("param `checkpointable_layers` must be type of list.")
        self.loss_fn = loss_fn
        self.checkpointable_layers = checkpointable_layers
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.dynamic_shape = dynamic_shape  # accepted: shapes are exchanged on every send anyway
        self.num_chunks = num_chunks
        self.micro_offset = 0
        self.global_rank, self.world_size = comm.get_rank(), comm.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self._topo = topology if topology is not None else self._default_topology(num_stages)
        self.num_stages = self._topo.get_dim("pipe")
        self._grid = PipelineParallelGrid(topology=self._topo)
        self.stage_id = self._grid.get_stage_id()
        self._layer_specs = list(layers)
        self._num_layers = len(self._layer_specs)
        log_dist(f"Partitioning pipeline stages with method {partition_method}", ranks=[0])
        self.parts = partition_weights(partition_method, self._layer_specs, self.num_stages * num_chunks)
        self._local_start, self._local_stop = self.parts[self.stage_id], self.parts[self.stage_id + 1]
        self.tied_modules = torch.nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self.chunk_funcs: list[list[Any]] = [self._build(chunk) for chunk in range(num_chunks)]
        self.forward_funcs = [f for funcs in self.chunk_funcs for f in funcs]
        self._log_partitions()
        from zerospeed.accelerator import get_accelerator

        if get_accelerator().device_name() != "cpu":
            self.to(get_accelerator().device_name(self.local_rank))
        self.tied_comms = TiedGroups.build(self)
        self.tied_comms.synchronize_weights()

    def _default_topology(self, num_stages: int | None) -> Any:
        assert num_stages is not None
        if self.world_size % num_stages != 0:
            raise RuntimeError(f"num_stages ({num_stages}) must divide distributed world size ({self.world_size})")
        return PipeDataParallelTopology(num_pp=num_stages, num_dp=self.world_size // num_stages)

    # --- building -----------------------------------------------------------------------------
    def chunk_bounds(self, chunk: int) -> tuple[int, int]:
        virtual = chunk * self.num_stages + self.stage_id
        return self.parts[virtual], self.parts[virtual + 1]

    def _build(self, chunk: int) -> list[Any]:
        start, stop = self.chunk_bounds(chunk)
        funcs: list[Any] = []
        for layer_idx in range(start, stop):
            layer = self._layer_specs[layer_idx]
            if self.seed_layers:
                (self.seed_fn or _set_random_seed)(int(self.base_seed + layer_idx))
            if isinstance(layer, PipelineModule):
                raise NotImplementedError("RECURSIVE BUILD NOT YET IMPLEMENTED")
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    self.tied_modules[layer.key] = layer.build()
                    self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
                module = self.tied_modules[layer.key]
                funcs.append(module if layer.forward_fn is None else functools.partial(layer.forward_fn, module))
            elif isinstance(layer, (LayerSpec, torch.nn.Module)):
                module = layer.build() if isinstance(layer, LayerSpec) else layer
                self.add_module(str(layer_idx), module)
                funcs.append(module)
            else:
                funcs.append(layer)  # a plain callable (e.g. a lambda reshaping the activations)
        return funcs

    def _log_partitions(self) -> None:
        if self.global_rank != 0:
            return
        lines = []
        for part in range(len(self.parts) - 1):
            start, stop = self.parts[part], self.parts[part + 1]
            lines.append(f"stage={part} layers={stop - start}")
            lines += [f"    {i:2d}: {layer_type_name(self._layer_specs[i]) or self._layer_specs[i]}"
                      for i in range(start, stop)]
        if self.loss_fn is not None:
            lines.append(f"  loss: {getattr(self.loss_fn, '__name__', type(self.loss_fn).__name__)}")
        log_dist("\n".join(lines), ranks=[0])

    # --- forward ------------------------------------------------------------------------------
    def forward(self, forward_input: Any, chunk: int = 0) -> Any:
        """Run this rank's layers of `chunk` (checkpointing every `activation_checkpoint_interval`)."""
        self.micro_offset += 1
        funcs = self.chunk_funcs[chunk]
        first_layer = self.chunk_bounds(chunk)[0]
        interval = self.activation_checkpoint_interval
        if interval == 0:
            return self._range_function(funcs, first_layer, self.micro_offset + 1)(forward_input)
        x = forward_input
        for start in range(0, len(funcs), interval):
            block = funcs[start:start + interval]
            run = self._range_function(block, first_layer + start, self.micro_offset + 1)
            args = x if isinstance(x, tuple) else (x,)
            x = self.activation_checkpoint_func(run, *args) if self._is_checkpointable(block) else run(*args)
        return x

    def _range_function(self, funcs: list[Any], first_layer: int, micro_offset: int) -> Callable[..., Any]:
        def run(*inputs: Any) -> Any:
            x = inputs[0] if len(inputs) == 1 else inputs
            for offset, layer in enumerate(funcs):
                self.curr_layer = first_layer + offset
                if self.seed_layers:
                    (self.seed_fn or _set_random_seed)(int(self.base_seed * micro_offset + self.curr_layer))
                x = layer(x)
            return x

        return run

    def _is_checkpointable(self, funcs: list[Any]) -> bool:
        if self.checkpointable_layers is not None:
            return all(type(f).__name__ in self.checkpointable_layers for f in funcs)
        # Unlike DeepSpeed's reentrant rule, a block fed integer inputs (an embedding) is safe here:
        # see [Note: inputs that do not require grad] in checkpoint_function.py.
        return any(any(True for _ in f.parameters()) for f in funcs if isinstance(f, torch.nn.Module))

    def set_checkpoint_interval(self, interval: int) -> None:
        if interval < 0:
            raise ValueError(f"activation checkpoint interval must be >= 0, got {interval}")
        self.activation_checkpoint_interval = interval

    # --- tied weights -------------------------------------------------------------------------
    def allreduce_tied_weight_gradients(self) -> None:
        """Sum tied weights' `.grad` over the stages holding them (DeepSpeed's method)."""
        self.tied_comms.allreduce_grads()

    def get_tied_weights_and_groups(self) -> list[tuple[torch.Tensor, Any]]:
        return self.tied_comms.weights_and_groups()

    # --- queries ------------------------------------------------------------------------------
    def partitions(self) -> list[int]:
        return self.parts

    def stage_owner(self, layer_idx: int) -> int:
        if not 0 <= layer_idx < self._num_layers:
            raise ValueError(f"layer {layer_idx} is outside 0..{self._num_layers - 1}")
        for part in range(len(self.parts) - 1):
            if self.parts[part] <= layer_idx < self.parts[part + 1]:
                return part % self.num_stages
        raise RuntimeError(f"Layer {layer_idx} not owned? parts={self.parts}")

    def local_layer_indices(self) -> list[int]:
        """Global indices of this rank's layers, in forward_funcs order."""
        return [i for chunk in range(self.num_chunks) for i in range(*self.chunk_bounds(chunk))]

    def topology(self) -> Any:
        return self._topo

    def mpu(self) -> PipelineParallelGrid:
        return self._grid

    def num_pipeline_stages(self) -> int:
        return self._topo.get_dim("pipe")

    def get_additional_losses(self) -> dict[str, torch.Tensor] | None:
        return None

    def ckpt_layer_path(self, ckpt_dir: str, local_layer_idx: int) -> str:
        """`<dir>/layer_XX[-model_YY]-model_states.pt` for this rank's `local_layer_idx`-th layer."""
        idx = self.local_layer_indices()[local_layer_idx]
        rank_repr = self._topo.get_rank_repr(rank=self.global_rank)
        return os.path.join(ckpt_dir, f"layer_{idx:02d}" + (f"-{rank_repr}" if rank_repr else "") + "-model_states.pt")
