"""The reentrant checkpoint: an autograd Function that runs `function` without keeping its
activations and runs it again, with the forward's random state, when the gradient arrives.

[Note: what crosses the Function boundary]
`torch.autograd.Function.apply` only tracks tensors given as positional arguments. The caller's
arguments (positional and keyword, nested in lists/tuples/dicts, with None and other non-tensor
values) are flattened with pytree; the tensor leaves go through `apply`, everything else rides in
a `CallSpec`. The outputs are flattened the same way: tensor leaves are the Function's outputs,
the rest is put back by the caller. Integer outputs are marked non-differentiable.

[Note: inputs that do not require grad]
A reentrant Function whose inputs all lack `requires_grad` (an embedding fed token ids, a frozen
trunk's output) returns outputs without a grad_fn, so the parameters inside `function` silently
get no gradient (DeepSpeed 0.19.8 and torch's reentrant mode both do this). When grad is enabled
and no input requires grad, an empty `anchor` tensor that requires grad is passed too: the
outputs then hang off this Function, and its backward reaches the parameters through the
recompute. The anchor gets no gradient.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from zerospeed.runtime.activation_checkpointing.rng import RngSnapshot
from zerospeed.runtime.activation_checkpointing.saved_inputs import PartitionGroup, StoredInput
from zerospeed.utils.logging import logger

__all__ = ["CallSpec", "CheckpointFunction", "OutputSpec", "run_checkpointed"]


@dataclasses.dataclass
class CallSpec:
    """The caller's arguments with the tensor leaves taken out (see the Note above)."""

    treespec: Any
    leaves: list[Any]  # tensor positions hold None
    tensor_positions: list[int]
    partition: PartitionGroup | None
    to_cpu: bool
    synchronize: bool
    profile: bool

    def call(self, function: Callable[..., Any], tensors: tuple[torch.Tensor, ...]) -> Any:
        leaves = list(self.leaves)
        for position, tensor in zip(self.tensor_positions, tensors):
            leaves[position] = tensor
        args, kwargs = pytree.tree_unflatten(leaves, self.treespec)
        return function(*args, **kwargs)


@dataclasses.dataclass
class OutputSpec:
    """Filled by the Function's forward: how to rebuild the function's output from its tensors."""

    treespec: Any = None
    leaves: list[Any] = dataclasses.field(default_factory=list)
    tensor_positions: list[int] = dataclasses.field(default_factory=list)

    def rebuild(self, tensors: tuple[torch.Tensor, ...]) -> Any:
        leaves = list(self.leaves)
        for position, tensor in zip(self.tensor_positions, tensors):
            leaves[position] = tensor
        return pytree.tree_unflatten(leaves, self.treespec)


def _synchronize(enabled: bool) -> None:
    if enabled:
        from zerospeed.accelerator import get_accelerator

        get_accelerator().synchronize()


class CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, function: Callable[..., Any], spec: CallSpec, out_spec: OutputSpec,
                anchor: torch.Tensor | None, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        _synchronize(spec.synchronize)
        start = time.perf_counter()
        ctx.function, ctx.spec = function, spec
        ctx.rng = RngSnapshot.capture()
        saved: list[torch.Tensor] = []
        ctx.stored = [StoredInput.keep(t, saved, spec.partition, spec.to_cpu) for t in tensors]
        ctx.save_for_backward(*saved)
        outputs = spec.call(function, tensors)  # grad is off inside Function.forward
        leaves, out_spec.treespec = pytree.tree_flatten(outputs)
        out_spec.tensor_positions = [i for i, leaf in enumerate(leaves) if torch.is_tensor(leaf)]
        out_spec.leaves = [None if torch.is_tensor(leaf) else leaf for leaf in leaves]
        output_tensors = tuple(leaves[i] for i in out_spec.tensor_positions)
        ctx.mark_non_differentiable(*[t for t in output_tensors if not t.is_floating_point()])
        _synchronize(spec.synchronize)
        if spec.profile:
            logger.info("activation checkpoint forward: %.3f ms", (time.perf_counter() - start) * 1e3)
        return output_tensors

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("deepspeed.checkpointing.checkpoint is not compatible with torch.autograd.grad(); "
                               "use .backward(), or torch.utils.checkpoint with use_reentrant=False")
        spec: CallSpec = ctx.spec
        _synchronize(spec.synchronize)
        start = time.perf_counter()
        first_tensor = 4  # function, spec, out_spec, anchor come before the tensors
        restored = [s.restore(ctx.saved_tensors, spec.partition) for s in ctx.stored]
        inputs = tuple(t.detach().requires_grad_(ctx.needs_input_grad[first_tensor + i] and t.is_floating_point())
                       for i, t in enumerate(restored))
        with ctx.rng.replayed(), torch.enable_grad():
            outputs = spec.call(ctx.function, inputs)
        output_tensors = [leaf for leaf in pytree.tree_leaves(outputs) if torch.is_tensor(leaf)]
        pairs = [(out, grad) for out, grad in zip(output_tensors, grads) if out.requires_grad and grad is not None]
        if pairs:
            torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
        ctx.function = ctx.spec = ctx.stored = ctx.rng = None  # free the recompute's references early
        _synchronize(spec.synchronize)
        if spec.profile:
            logger.info("activation checkpoint backward: %.3f ms", (time.perf_counter() - start) * 1e3)
        return (None, None, None, None, *(t.grad if t.requires_grad else None for t in inputs))


def run_checkpointed(function: Callable[..., Any], args: tuple, kwargs: dict, partition: PartitionGroup | None,
                     to_cpu: bool, synchronize: bool, profile: bool) -> Any:
    """Flatten the call, run it through `CheckpointFunction`, rebuild the output structure."""
    leaves, treespec = pytree.tree_flatten((args, kwargs))
    positions = [i for i, leaf in enumerate(leaves) if torch.is_tensor(leaf)]
    tensors = tuple(leaves[i] for i in positions)
    spec = CallSpec(treespec, [None if torch.is_tensor(leaf) else leaf for leaf in leaves], positions,
                    partition, to_cpu, synchronize, profile)
    anchor = None
    if torch.is_grad_enabled() and not any(t.requires_grad for t in tensors):
        anchor = torch.empty(0, requires_grad=True)  # see [Note: inputs that do not require grad]
    out_spec = OutputSpec()
    output_tensors = CheckpointFunction.apply(function, spec, out_spec, anchor, *tensors)
    return out_spec.rebuild(output_tensors)
