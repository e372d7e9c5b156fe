"""Dropless MoE: every kept route reaches its expert through a variable-size all-to-all.

[Note: dropless dispatch]
With `drop_tokens=False` DeepSpeed drops nothing but still pads: every expert gets a buffer of the
largest per-expert count in the expert-parallel group (an all-reduce MAX), and both all-to-alls
move E x that count x d elements whatever the routing. zerospeed sends exactly the routed tokens:
1. The kept routes are sorted by global expert id (stable, so route-major, token order within an
   expert); `counts[e]` is how many go to expert e. Experts are laid out rank by rank, so the
   sorted rows are already grouped by destination rank.
2. One small all-to-all of the E counts tells every rank how many rows it receives from each rank
   for each of its local experts; the split sizes follow.
3. `all_to_all_single` with those input/output split sizes moves the rows (forward; the backward
   is the same exchange with the split sizes swapped).
4. The received rows come grouped (source rank, local expert); they are reordered to (local
   expert, source rank) so each local expert runs once, on all its rows (possibly none: it still
   runs, so ZeRO-3's gather hooks fire on every rank alike), and put back.
5. The reverse exchange returns every row to its sender, which writes it back to its route's place
   in a [k, S, d] buffer and sums the k routes weighted by their gate values in fp32, as the
   padded path's `decode` does.
Bytes per all-to-all: (kept routes on this rank) x d elements, plus E integers for the counts.
"""

from __future__ import annotations

from typing import Any

import torch

from zerospeed import comm
from zerospeed.moe.experts import Experts

__all__ = ["all_to_all_v", "dropless_forward"]


class _AllToAllV(torch.autograd.Function):
    """all_to_all_single with split sizes; the backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx: Any, group: Any, input: torch.Tensor, send_splits: list[int], recv_splits: list[int],  # type: ignore[override]
                log_name: str | None) -> torch.Tensor:
        ctx.group, ctx.send_splits, ctx.recv_splits, ctx.log_name = group, send_splits, recv_splits, log_name
        output = input.new_empty((sum(recv_splits), *input.shape[1:]))
        comm.all_to_all_single(output, input.contiguous(), recv_splits, send_splits, group=group, log_name=log_name)
        return output

    @staticmethod
    def backward(ctx: Any, *grad_output: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        name = None if ctx.log_name is None else f"{ctx.log_name}.backward"
        grad = _AllToAllV.apply(ctx.group, grad_output[0], ctx.recv_splits, ctx.send_splits, name)
        return None, grad, None, None, None


def all_to_all_v(group: Any, rows: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                 log_name: str | None = None) -> torch.Tensor:
    """Rows [sum(send_splits), ...] -> [sum(recv_splits), ...]: send_splits[j] rows go to rank j of `group`."""
    return _AllToAllV.apply(group, rows, send_splits, recv_splits, log_name)


def _name(log_name: str | None, step: str) -> str | None:
    return None if log_name is None else f"{log_name}.{step}"


def _exchange_counts(counts: torch.Tensor, ep_size: int, group: Any, log_name: str | None) -> torch.Tensor:
    """[E] rows per global expert from this rank -> [ep_size, num_local_experts]: rows this rank's
    local experts get from each rank (step 2)."""
    if ep_size == 1:
        return counts.view(1, -1)
    received = torch.empty_like(counts)
    comm.all_to_all_single(received, counts.contiguous(), group=group, log_name=log_name)
    return received.view(ep_size, -1)


def _run_experts(experts: Experts, rows: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
    """Rows grouped (source rank, local expert) -> each local expert's output, in the same order (step 4)."""
    ep_size, num_local = received.shape
    local_id = torch.arange(ep_size * num_local, device=rows.device) % num_local
    row_expert = torch.repeat_interleave(local_id, received.reshape(-1))
    order = torch.argsort(row_expert, stable=True)
    grouped = rows.index_select(0, order).split(received.sum(dim=0).tolist())
    outputs = []
    for chunk, expert in zip(grouped, experts.deepspeed_experts):
        out = expert(chunk)
        outputs.append(out[0] if isinstance(out, tuple) else out)   # (output, bias) experts: keep output
    return torch.cat(outputs).index_select(0, torch.argsort(order))


def dropless_forward(tokens: torch.Tensor, expert_index: torch.Tensor, weight: torch.Tensor,
                     experts: Experts, ep_size: int, group: Any, log_name: str | None = None) -> torch.Tensor:
    """tokens [S, d], routes ([k, S] expert ids, -1 = not routed; [k, S] fp32 weights) -> output [S, d]."""
    num_routes, num_tokens = expert_index.shape
    num_experts = ep_size * experts.num_local_experts
    flat_expert = expert_index.reshape(-1)
    kept = torch.nonzero(flat_expert >= 0).squeeze(1)
    order = kept[torch.argsort(flat_expert[kept], stable=True)]           # route ids sorted by expert (step 1)
    rows = tokens.index_select(0, order % num_tokens)
    counts = torch.bincount(flat_expert[kept], minlength=num_experts)
    received = _exchange_counts(counts, ep_size, group, _name(log_name, "counts"))
    send_splits = counts.view(ep_size, -1).sum(dim=1).tolist()
    recv_splits = received.sum(dim=1).tolist()
    if ep_size > 1:
        rows = all_to_all_v(group, rows, send_splits, recv_splits, _name(log_name, "dispatch"))
    outputs = _run_experts(experts, rows, received)
    if ep_size > 1:
        outputs = all_to_all_v(group, outputs, recv_splits, send_splits, _name(log_name, "combine"))
    d_model = outputs.shape[-1]
    routed = outputs.new_zeros(num_routes * num_tokens, d_model).index_copy(0, order, outputs)
    routed = routed.view(num_routes, num_tokens, d_model)
    return (routed * weight.unsqueeze(-1)).sum(dim=0).to(outputs.dtype)
