"""ALST's tiled compute: run a position-wise function over slices of the sequence, never
holding the whole activation (the MLP's intermediate, the logits) at once.

Each function computes its slices without autograd in forward and recomputes each slice with
autograd in backward, feeding it the matching slice of the incoming gradient: peak memory is one
slice's graph, at the price of one extra forward. Parameter gradients accumulate slice by slice
during backward. `TiledFusedLogitsLoss` follows the same rule (DeepSpeed's version runs its
backward inside forward instead; see docs/compatibility.md): so a loss multiplied before
``backward`` (gradient accumulation, fp16 loss scaling) scales the parameter gradients too.
``compute_params`` are accepted for DeepSpeed's signatures; zerospeed needs no per-slice flags.
"""

from __future__ import annotations

import math
from typing import Any, cast
from collections.abc import Callable

import torch

__all__ = ["SequenceTiledCompute", "TiledFusedLogitsLoss", "TiledMLP", "sequence_tiled_compute"]


def _recompute_backward(fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], grad: torch.Tensor,
                        needs_grad: bool, **kwargs: Any) -> torch.Tensor | None:
    """Run ``fn`` on detached ``inputs[0]`` (and the rest as given) with autograd; backprop ``grad``."""
    x = inputs[0].detach().requires_grad_(needs_grad)
    with torch.enable_grad():
        out = fn(x, *inputs[1:], **kwargs)
    torch.autograd.backward(out, grad)
    return x.grad if needs_grad else None


class TiledMLP(torch.autograd.Function):
    """``fn(self, x)`` over ``shards`` slices of ``x`` along the sequence dim (-2)."""

    @staticmethod
    def forward(ctx: Any, fn: Callable, self: Any, x: torch.Tensor, shards: int, compute_params: Any) -> torch.Tensor:
        ctx.fn, ctx.module, ctx.shards = fn, self, shards
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([fn(self, piece) for piece in x.chunk(shards, dim=-2)], dim=-2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        (x,) = ctx.saved_tensors
        grads = [_recompute_backward(lambda piece: ctx.fn(ctx.module, piece), [piece], piece_grad, x.requires_grad)
                 for piece, piece_grad in zip(x.chunk(ctx.shards, dim=-2), grad.chunk(ctx.shards, dim=-2))]
        return None, None, torch.cat(cast(list[torch.Tensor], grads), dim=-2) if x.requires_grad else None, None, None


def _reduce(output: torch.Tensor, reduction: str | None) -> torch.Tensor:
    if reduction is None:
        return output
    if reduction == "mean":
        return output.mean()
    if reduction == "sum":
        return output.sum()
    raise ValueError(f"unknown output_reduction {reduction!r}: valid values are None, 'mean' and 'sum'")


class SequenceTiledCompute(torch.autograd.Function):
    """The generic form behind `sequence_tiled_compute` (its docstring has the arguments)."""

    @staticmethod
    def forward(ctx: Any, fn: Callable, seqlen: int, shards: int, keys_to_shard: list[str], keys_to_pass: list[str],
                grad_requiring_tensor_key: str, compute_params: Any, output_unshard_dimension: int,
                output_reduction: str | None, *args: Any) -> torch.Tensor:
        sharded = dict(zip(keys_to_shard, args[:len(keys_to_shard)]))
        passed = dict(zip(keys_to_pass, args[len(keys_to_shard):]))
        if grad_requiring_tensor_key not in sharded:
            raise ValueError(f"grad_requiring_tensor_key {grad_requiring_tensor_key!r} must be one of the sharded "
                             f"keys {keys_to_shard}")
        step = math.ceil(seqlen / shards)
        ctx.fn, ctx.step, ctx.sharded, ctx.passed = fn, step, sharded, passed
        ctx.key, ctx.dim, ctx.reduction, ctx.num_args = grad_requiring_tensor_key, output_unshard_dimension, \
            output_reduction, len(args)
        ctx.index = (keys_to_shard + keys_to_pass).index(grad_requiring_tensor_key)
        with torch.no_grad():
            outputs = [fn(**ctx_slice, **passed) for ctx_slice in SequenceTiledCompute._slices(sharded, seqlen, step)]
        unsharded = torch.stack(outputs) if output_unshard_dimension == 0 else torch.cat(outputs, output_unshard_dimension)
        ctx.unsharded_shape = unsharded.shape
        return _reduce(unsharded, output_reduction)

    @staticmethod
    def _slices(sharded: dict[str, torch.Tensor], seqlen: int, step: int) -> list[dict[str, torch.Tensor]]:
        return [{k: v[:, start:start + step] for k, v in sharded.items()} for start in range(0, seqlen, step)]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        full = grad.expand(ctx.unsharded_shape)
        if ctx.reduction == "mean":
            full = full / math.prod(ctx.unsharded_shape)
        target = ctx.sharded[ctx.key]
        seqlen = target.shape[1]
        pieces = full.unbind(0) if ctx.dim == 0 else full.split(
            [min(ctx.step, seqlen - s) for s in range(0, seqlen, ctx.step)], dim=ctx.dim)
        grads = []
        for piece_inputs, piece_grad in zip(SequenceTiledCompute._slices(ctx.sharded, seqlen, ctx.step), pieces):
            x = piece_inputs.pop(ctx.key)
            grads.append(_recompute_backward(lambda t, **kw: ctx.fn(**{ctx.key: t}, **kw), [x], piece_grad,
                                             target.requires_grad, **piece_inputs, **ctx.passed))
        arg_grads: list[Any] = [None] * ctx.num_args
        if target.requires_grad:
            arg_grads[ctx.index] = torch.cat(cast(list[torch.Tensor], grads), dim=1)
        return (None,) * 9 + tuple(arg_grads)


def sequence_tiled_compute(fn: Callable, seqlen: int, shards: int, kwargs_to_shard: dict[str, Any],
                           kwargs_to_pass: dict[str, Any], grad_requiring_tensor_key: str, compute_params: Any = None,
                           output_unshard_dimension: int = 1, output_reduction: str | None = "mean") -> torch.Tensor:
    """``fn(**kwargs_to_shard sliced on dim 1, **kwargs_to_pass)`` over ``shards`` slices.

    Outputs are concatenated on ``output_unshard_dimension`` (0 stacks one output per slice) and
    reduced by ``output_reduction`` (None, "mean" or "sum"). Only the tensor under
    ``grad_requiring_tensor_key`` (and the parameters ``fn`` uses) receive gradients.
    """
    return SequenceTiledCompute.apply(fn, seqlen, shards, list(kwargs_to_shard), list(kwargs_to_pass),
                                      grad_requiring_tensor_key, compute_params, output_unshard_dimension,
                                      output_reduction, *kwargs_to_shard.values(), *kwargs_to_pass.values())


class TiledFusedLogitsLoss(torch.autograd.Function):
    """``fn(self, x, y[, mask])`` (a scalar loss) over ``shards`` row slices of flattened ``x``/``y``;
    the full logits tensor never exists. ``output_reduction``: "mean" of the slice losses or "sum"."""

    @staticmethod
    def forward(ctx: Any, fn: Callable, self: Any, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None,
                shards: int, compute_params: Any, output_reduction: str) -> torch.Tensor:
        if output_reduction not in ("mean", "sum"):
            raise ValueError(f"unknown output_reduction {output_reduction!r}: valid values are 'mean' and 'sum'")
        if x.dim() < 2 or y.dim() < 2 or x.shape[:2] != y.shape[:2]:
            raise ValueError(f"x {tuple(x.shape)} and y {tuple(y.shape)} must both be [batch, seq_len, ...]")
        if mask is not None and mask.shape != x.shape[:2]:
            raise ValueError(f"mask {tuple(mask.shape)} must be [batch, seq_len] = {tuple(x.shape[:2])}")
        ctx.fn, ctx.module, ctx.shards, ctx.reduction = fn, self, shards, output_reduction
        ctx.save_for_backward(x, y, mask)
        with torch.no_grad():
            losses = [fn(self, *piece) for piece in TiledFusedLogitsLoss._pieces(x, y, mask, shards)]
        return _reduce(torch.stack(losses), output_reduction)

    @staticmethod
    def _pieces(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None, shards: int) -> list[tuple]:
        flat = [x.reshape(-1, *x.shape[2:]).chunk(shards), y.reshape(-1, *y.shape[2:]).chunk(shards)]
        if mask is not None:
            flat.append(mask.reshape(-1).chunk(shards))
        return list(zip(*flat))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, y, mask = ctx.saved_tensors
        scale = grad / ctx.shards if ctx.reduction == "mean" else grad
        grads = [_recompute_backward(lambda t, *rest: ctx.fn(ctx.module, t, *rest), list(piece), scale,
                                     x.requires_grad)
                 for piece in TiledFusedLogitsLoss._pieces(x, y, mask, ctx.shards)]
        x_grad = torch.cat(cast(list[torch.Tensor], grads)).view_as(x) if x.requires_grad else None
        return None, None, x_grad, None, None, None, None, None
