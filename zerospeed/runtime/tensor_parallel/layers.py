"""Column- and row-parallel linear layers and the three collectives between them.

[Note: tensor-parallel autograd]
With X replicated on the tp ranks and W split by output features (column-parallel), rank r
computes Y_r = X W_r^T; the gradient of X is the *sum* over ranks of dY_r W_r, so the layer's
input passes through `copy_to_tensor_parallel_region` (identity forward, all-reduce backward).
A row-parallel layer gets its input already sharded by features (the column layer's output) and
its partial products are summed by `reduce_from_tensor_parallel_region` (all-reduce forward,
identity backward). `gather_from_tensor_parallel_region` concatenates a column layer's shards
(output head) and hands each rank its slice of the gradient. With these three, every replicated
parameter (norms, embeddings, row-parallel biases) receives the same gradient on every tp rank,
so gradients need only the data-parallel reduction, as in Megatron-LM.

The layers keep the replaced module's parameter names (``weight``, ``bias``) and layout — a
Hugging Face ``Conv1D`` keeps its [in, out] weight — so state-dict keys do not change. Each
sharded parameter carries one `TPShard` (``param.ds_tp_shard``) saying how to reassemble it, and
DeepSpeed's flag ``param.tensor_model_parallel = True``.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
import torch.nn.functional as F

from zerospeed import comm

__all__ = ["LinearAllreduce", "LinearLayer", "SharedInputCopy", "TPShard", "all_gather_pieces", "copy_to_tensor_parallel_region",
           "gather_from_tensor_parallel_region", "reduce_from_tensor_parallel_region", "shard_of"]


@dataclasses.dataclass(frozen=True)
class TPShard:
    """How a parameter was split: along ``dim``, each of its ``fused_parts`` equal parts into
    ``tp_size`` equal pieces, this rank holding piece ``tp_rank`` of every part."""

    dim: int
    fused_parts: int
    tp_size: int
    tp_rank: int


def shard_of(full: torch.Tensor, shard: TPShard) -> torch.Tensor:
    """This rank's piece of the full tensor ``full`` (a copy); the inverse of `gather_shards`."""
    parts = full.chunk(shard.fused_parts, dim=shard.dim)
    return torch.cat([part.chunk(shard.tp_size, dim=shard.dim)[shard.tp_rank] for part in parts],
                     dim=shard.dim).clone()


def all_gather_pieces(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Every rank's ``x`` stacked in rank order: shape ``[tp_size, *x.shape]`` (flat buffers, which
    every backend's all-gather accepts)."""
    size = comm.get_world_size(group)
    flat = torch.empty(size * x.numel(), dtype=x.dtype, device=x.device)
    comm.all_gather_into_tensor(flat, x.detach().contiguous().reshape(-1), group=group)
    return flat.view(size, *x.shape)


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, shared: SharedInputCopy | None) -> torch.Tensor:
        ctx.group = group
        ctx.shared = None if shared is None else weakref.ref(shared)   # weak: the entry holds this node's output
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        shared = None if ctx.shared is None else ctx.shared()
        if shared is not None:
            shared.clear()   # the forward is over: release the entry's reference
        grad = grad.contiguous()
        comm.all_reduce(grad, group=ctx.group)
        return grad, None, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.contiguous()
        comm.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.rank, ctx.size = comm.get_rank(group), comm.get_world_size(group)
        return torch.cat(all_gather_pieces(x, group).unbind(0), dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.chunk(ctx.size, dim=-1)[ctx.rank].contiguous(), None


def copy_to_tensor_parallel_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _CopyToRegion.apply(x, group, None)


class SharedInputCopy:
    """[Note: one all-reduce per shared input]
    Column-parallel layers that read the same tensor (q/k/v of an attention block, gate/up of a
    gated MLP) would each all-reduce their own input gradient in backward; the sum of those
    all-reduces is the all-reduce of the sum. So consecutive column layers reuse one
    `copy_to_tensor_parallel_region` node for the same input: autograd adds their gradients first
    and the node all-reduces once (5 backward all-reduces per Llama block become 2).

    The entry is valid while the input is the same object (a weak reference: it never keeps the
    input alive) and unmodified (its version counter). The copy itself must be held strongly (its
    Python object does not outlive the layer's forward); it aliases the input's storage, which
    the layer saves for backward anyway, and the entry is dropped when any copy's backward runs.
    One object per sharded model (`apply_autotp` makes it), shared by its column-parallel layers.
    """

    def __init__(self) -> None:
        self._input: weakref.ref[torch.Tensor] | None = None
        self._copy: torch.Tensor | None = None
        self._version = -1
        self._group: Any = None

    def __call__(self, x: torch.Tensor, group: Any) -> torch.Tensor:
        if not (torch.is_grad_enabled() and x.requires_grad):
            return x   # no gradient to reduce: the copy is the identity
        if (self._copy is not None and self._input is not None and self._input() is x
                and x._version == self._version and group is self._group):
            return self._copy
        self._copy = _CopyToRegion.apply(x, group, self)
        self._input, self._version, self._group = weakref.ref(x), x._version, group
        return self._copy

    def clear(self) -> None:
        self._input = self._copy = self._group = None


def reduce_from_tensor_parallel_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _ReduceFromRegion.apply(x, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _GatherFromRegion.apply(x, group)


def _mark(param: torch.nn.Parameter, shard: TPShard) -> torch.nn.Parameter:
    param.ds_tp_shard = shard  # type: ignore[attr-defined]
    param.tensor_model_parallel = True  # type: ignore[attr-defined]  # DeepSpeed's / Megatron's flag
    return param


def _shard_param(param: torch.nn.Parameter, shard: TPShard) -> torch.nn.Parameter:
    """Cut ``param`` to this rank's piece *in place*: the Parameter object stays the same, so a
    parameter list or optimizer built before `initialize` (Hugging Face's Trainer builds
    ``model_parameters`` first) still points at the trained tensors."""
    if param.shape[shard.dim] % (shard.fused_parts * shard.tp_size):
        raise ValueError(f"AutoTP: a dimension of {param.shape[shard.dim]} does not split into "
                         f"{shard.fused_parts} part(s) x {shard.tp_size} ranks")
    param.data = shard_of(param.data, shard)
    return _mark(param, shard)


def _param(module: torch.nn.Module, name: str) -> torch.nn.Parameter:
    value = getattr(module, name)
    if not isinstance(value, torch.nn.Parameter):
        raise TypeError(f"AutoTP: {type(module).__name__}.{name} is not a Parameter")
    return value


class _TensorParallelLinear(torch.nn.Module):
    """Shared setup: the replaced module's weight/bias, split; ``transposed`` for Conv1D ([in, out])."""

    weight: torch.nn.Parameter
    bias: torch.nn.Parameter | None

    def __init__(self, module: torch.nn.Module, group: Any, transposed: bool) -> None:
        super().__init__()
        self.group = group
        self.transposed = transposed
        self.tp_size, self.tp_rank = comm.get_world_size(group), comm.get_rank(group)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight if self.transposed else F.linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"weight={tuple(self.weight.shape)}, tp_size={self.tp_size}, transposed={self.transposed}"


class LinearLayer(_TensorParallelLinear):
    """Column-parallel (DeepSpeed's name): output features split, optionally gathered back. Layers
    given the same ``shared_input`` reuse one input copy ([Note: one all-reduce per shared input])."""

    def __init__(self, module: torch.nn.Module, group: Any, transposed: bool = False, fused_parts: int = 1,
                 gather_output: bool = False, shared_input: SharedInputCopy | None = None) -> None:
        super().__init__(module, group, transposed)
        self.gather_output = gather_output
        self.shared_input = shared_input if shared_input is not None else SharedInputCopy()
        out_dim = 1 if transposed else 0
        shard = TPShard(out_dim, fused_parts, self.tp_size, self.tp_rank)
        self.weight = _shard_param(_param(module, "weight"), shard)
        bias = getattr(module, "bias", None)
        self.bias = None if bias is None else _shard_param(bias, TPShard(0, fused_parts, self.tp_size, self.tp_rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._matmul(self.shared_input(x, self.group))  # [Note: one all-reduce per shared input]
        if self.bias is not None:
            out = out + self.bias
        return gather_from_tensor_parallel_region(out, self.group) if self.gather_output else out


class LinearAllreduce(_TensorParallelLinear):
    """Row-parallel (DeepSpeed's name): input features split, partial outputs summed; the bias is
    replicated and added once, after the sum."""

    def __init__(self, module: torch.nn.Module, group: Any, transposed: bool = False) -> None:
        super().__init__(module, group, transposed)
        in_dim = 0 if transposed else 1
        self.weight = _shard_param(_param(module, "weight"), TPShard(in_dim, 1, self.tp_size, self.tp_rank))
        self.bias = getattr(module, "bias", None)   # replicated: the same Parameter, whole

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = reduce_from_tensor_parallel_region(self._matmul(x), self.group)
        return out if self.bias is None else out + self.bias
