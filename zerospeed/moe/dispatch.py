"""Moving tokens to their experts' buffers and back, and the all-to-all between expert-parallel ranks.

[Note: MoE dispatch]
Each rank holds S tokens and routes them (routing.py) to E = ep_size * num_local_experts experts,
each with `capacity` (C) slots. `encode` copies every kept route's token into an [E, C, d] buffer
(unused slots are zero); the first all-to-all sends expert block e to the rank that owns expert e,
so afterwards a rank holds [ep_size, num_local_experts, C, d]: C slots from every rank for each of
its own experts. The experts run, the second all-to-all returns each block to the rank that sent
it, and `decode` sums every token's routes weighted by their gate values.
Both all-to-alls move E * C * d elements per rank. Copies are gathers and scatters over index
tensors, O(S * k * d), not the dense one-hot einsums (O(S * E * C * d)) of the GShard paper.
"""

from __future__ import annotations

from typing import Any

import torch

from zerospeed import comm

__all__ = ["all_to_all", "decode", "encode", "flat_slots"]


class _AllToAll(torch.autograd.Function):
    """all_to_all_single whose backward is the same exchange of the gradients, in reverse."""

    @staticmethod
    def forward(ctx: Any, group: Any, input: torch.Tensor, log_name: str | None) -> torch.Tensor:
        ctx.group, ctx.log_name = group, log_name
        input = input.contiguous()
        output = torch.empty_like(input)
        comm.all_to_all_single(output, input, group=group, log_name=log_name)
        return output

    @staticmethod
    def backward(ctx: Any, *grad_output: torch.Tensor) -> tuple[None, torch.Tensor, None]:
        name = None if ctx.log_name is None else f"{ctx.log_name}.backward"
        return None, _AllToAll.apply(ctx.group, *grad_output, name), None


def all_to_all(group: Any, tensor: torch.Tensor, log_name: str | None = None) -> torch.Tensor:
    """Split dim 0 into world-size equal blocks; block j goes to rank j of `group`. `log_name` names
    the comms-logger records (forward; the backward's gets `.backward`)."""
    return _AllToAll.apply(group, tensor, log_name)


def flat_slots(expert_index: torch.Tensor, slot: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """[k, S] -> row of the flattened [E * C] buffer for each route; dropped routes get E * C (a pad row)."""
    flat = expert_index.long() * capacity + slot.long()
    return torch.where(expert_index >= 0, flat, torch.full_like(flat, num_experts * capacity))


def encode(tokens: torch.Tensor, slots: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """[S, d] tokens -> [E, C, d] expert buffers; slots come from `flat_slots` ([k, S]).

    The copy is one gather: first invert the routes into "which token fills slot j" (S, a zero pad
    row, for empty slots), then index. Its backward then sums each token's gradient over its slots
    in slot order, as DeepSpeed's does, so input gradients agree with DeepSpeed bit for bit."""
    num_tokens, d_model = tokens.shape
    num_slots = num_experts * capacity
    token_of_slot = torch.full((num_slots + 1,), num_tokens, dtype=torch.long, device=tokens.device)
    route_tokens = torch.arange(num_tokens, device=tokens.device).expand_as(slots)
    # Kept routes own distinct slots; dropped routes all write the extra entry, which is cut off.
    token_of_slot.scatter_(0, slots.reshape(-1), route_tokens.reshape(-1))
    padded = torch.cat([tokens, tokens.new_zeros(1, d_model)])
    return padded.index_select(0, token_of_slot[:num_slots]).view(num_experts, capacity, d_model)


def decode(expert_output: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[E, C, d] expert outputs -> [S, d]: each token's routes weighted by `weights` ([k, S], fp32) and
    summed in fp32 (summing k low-precision products in bf16 loses precision), then cast back."""
    num_experts, capacity, d_model = expert_output.shape
    pad_row = num_experts * capacity
    padded = torch.cat([expert_output.reshape(pad_row, d_model), expert_output.new_zeros(1, d_model)])
    routed = padded.index_select(0, slots.reshape(-1)).view(*slots.shape, d_model)
    return (routed * weights.unsqueeze(-1)).sum(dim=0).to(expert_output.dtype)
