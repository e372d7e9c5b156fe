"""The loss of a sequence-parallel sample, aggregated for the user.

Each rank of a sequence-parallel group holds a slice of every sample, so the loss it can compute
alone is over its own tokens. `sequence_parallel_loss` turns a per-rank sum of token losses into
the sample's token-weighted mean, identical on every rank of the group, with a differentiable
all-reduce whose backward is the adjoint all-reduce. Each rank then backpropagates the whole
sample's loss; the engine averages gradients over data x sequence ranks, which yields exactly the
full-sequence gradient (groups_setup.py, [Note: gradient averaging under sequence parallelism]).
Ranks whose slice holds no valid token (padding, prompt tokens) are handled: the weights are
token counts, never per-rank means.
"""

from __future__ import annotations

from typing import Any

import torch

from zerospeed import comm

__all__ = ["sequence_parallel_cross_entropy", "sequence_parallel_loss"]


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group; the adjoint of a sum all-reduce is a sum all-reduce of the gradients."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = tensor.clone()
        comm.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        comm.all_reduce(grad, group=ctx.group)
        return grad, None


def sequence_parallel_loss(loss_sum: torch.Tensor, num_tokens: torch.Tensor | int, group: Any) -> torch.Tensor:
    """``sum over the group of loss_sum / sum over the group of num_tokens`` (at least one token)."""
    tokens = torch.as_tensor(num_tokens, dtype=torch.float32, device=loss_sum.device).detach().clone()
    comm.all_reduce(tokens, group=group)
    total = _AllReduceSum.apply(loss_sum, group)
    return total / tokens.clamp(min=1.0).to(total.dtype)


def sequence_parallel_cross_entropy(logits: torch.Tensor, shift_labels: torch.Tensor, group: Any,
                                    ignore_index: int = -100) -> torch.Tensor:
    """Mean next-token cross entropy over the whole sample from this rank's slice.

    ``shift_labels`` are the labels already shifted on the full sequence before sharding (what
    ``UlyssesSPDataLoaderAdapter`` hands out), so a slice's last token is scored against the next
    slice's first token.
    """
    flat_logits = logits.reshape(-1, logits.shape[-1]).float()
    flat_labels = shift_labels.reshape(-1)
    loss_sum = torch.nn.functional.cross_entropy(flat_logits, flat_labels, ignore_index=ignore_index,
                                                 reduction="sum")
    return sequence_parallel_loss(loss_sum, (flat_labels != ignore_index).sum(), group)
