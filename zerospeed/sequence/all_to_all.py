"""The Ulysses exchange: heads scattered for sequence gathered, and back (an autograd function).

Each rank of a sequence-parallel group of size P holds a slice of the sequence with every head:
``[.., s/P, .., H, d]`` (sequence at ``seq_dim``, heads at dim 2). ``heads_to_sequence`` sends
head block ``j`` to rank ``j`` and concatenates the sequence slices it receives in rank order, so
every rank ends with the whole sequence for its own head block: ``[.., s, .., H_j, d]``.
``sequence_to_heads`` is its exact inverse. Each is the other's adjoint (a permutation of
elements across ranks), so the backward of one is the other with the same head split.

Head blocks follow the KV heads so that a query head stays on the rank that holds its KV head
under grouped-query attention: with ``K`` KV heads the first ``K % P`` ranks get one extra KV head
(DeepSpeed's uneven split), and a tensor with ``H`` heads gets ``H / K`` times the KV block.
An even split is one ``all_to_all_single`` over a ``[P, ...]`` buffer built with a single copy;
an uneven split sends flat blocks with per-rank element counts.
"""

from __future__ import annotations

from typing import Any

import torch

from zerospeed import comm

__all__ = ["head_split", "heads_to_sequence", "sequence_to_heads", "SeqAllToAll"]


def head_split(num_heads: int, num_kv_heads: int, sp_size: int) -> list[int]:
    """Heads per sp rank for a tensor with ``num_heads`` heads, following the KV-head partition."""
    if num_kv_heads < sp_size:
        raise ValueError(f"the number of key/value heads ({num_kv_heads}) must be at least the sequence "
                         f"parallel size ({sp_size}): a rank would get no head to attend over")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"the head count {num_heads} is not a multiple of the key/value head count "
                         f"{num_kv_heads}")
    base, extra = divmod(num_kv_heads, sp_size)
    per_kv = num_heads // num_kv_heads
    return [(base + (1 if rank < extra else 0)) * per_kv for rank in range(sp_size)]


def _exchange(blocks: list[torch.Tensor], recv_shapes: list[list[int]], group: Any) -> list[torch.Tensor]:
    """Send ``blocks[j]`` to rank j; return what each rank sent here, shaped ``recv_shapes[i]``."""
    send = torch.cat([b.reshape(-1) for b in blocks])
    recv_numels = [int(torch.Size(s).numel()) for s in recv_shapes]
    recv = send.new_empty(sum(recv_numels))
    comm.all_to_all_single(recv, send, output_split_sizes=recv_numels,
                           input_split_sizes=[b.numel() for b in blocks], group=group)
    return [piece.view(shape) for piece, shape in zip(recv.split(recv_numels), recv_shapes)]


def _even_exchange(send: torch.Tensor, group: Any) -> torch.Tensor:
    recv = torch.empty_like(send)
    comm.all_to_all_single(recv, send, group=group)
    return recv


def heads_to_sequence(x: torch.Tensor, seq_dim: int, split: list[int], group: Any) -> torch.Tensor:
    """``[.., s/P, .., H, d]`` -> ``[.., s, .., split[rank], d]`` (heads at dim 2)."""
    sp_size = len(split)
    if len(set(split)) == 1:
        # Even split: one copy into [P, .., s/P, .., H/P, d] to send, one out of the receive
        # buffer (none for sequence-first tensors), so at most two copies are alive at once.
        recv = _even_exchange(x.unflatten(2, (sp_size, split[0])).movedim(2, 0).contiguous(), group)
        return recv.movedim(0, seq_dim).flatten(seq_dim, seq_dim + 1)
    rank = comm.get_rank(group)
    blocks = [b.contiguous() for b in x.split(split, dim=2)]
    shape = list(x.shape)
    shape[2] = split[rank]
    pieces = _exchange(blocks, [shape] * len(split), group)
    return torch.cat(pieces, dim=seq_dim)


def sequence_to_heads(x: torch.Tensor, seq_dim: int, split: list[int], group: Any) -> torch.Tensor:
    """``[.., s, .., H_rank, d]`` -> ``[.., s/P, .., H, d]``: the inverse of `heads_to_sequence`."""
    sp_size = len(split)
    if x.shape[seq_dim] % sp_size != 0:
        raise ValueError(f"sequence length {x.shape[seq_dim]} is not divisible by the sequence parallel "
                         f"size {sp_size}")
    if len(set(split)) == 1:
        send = x.unflatten(seq_dim, (sp_size, x.shape[seq_dim] // sp_size)).movedim(seq_dim, 0).contiguous()
        return _even_exchange(send, group).movedim(0, 2).flatten(2, 3)
    blocks = [b.contiguous() for b in x.chunk(sp_size, dim=seq_dim)]
    shapes = []
    for heads in split:
        shape = list(blocks[0].shape)
        shape[2] = heads
        shapes.append(shape)
    return torch.cat(_exchange(blocks, shapes, group), dim=2)


class SeqAllToAll(torch.autograd.Function):
    """Differentiable exchange; ``to_sequence`` picks the direction, backward runs the other one."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, seq_dim: int, split: list[int],
                to_sequence: bool) -> torch.Tensor:
        ctx.group, ctx.seq_dim, ctx.split, ctx.to_sequence = group, seq_dim, split, to_sequence
        fn = heads_to_sequence if to_sequence else sequence_to_heads
        return fn(x, seq_dim, split, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        fn = sequence_to_heads if ctx.to_sequence else heads_to_sequence
        return fn(grad.contiguous(), ctx.seq_dim, ctx.split, ctx.group), None, None, None, None
