"""Ulysses sequence parallelism: ``DistributedAttention`` (DeepSpeed's ``deepspeed.sequence.layer``).

Every rank of the sequence-parallel group holds ``s/P`` tokens of each sample with all heads.
Before attention, q, k and v each go through an all-to-all that trades heads for sequence
(``zerospeed.sequence.all_to_all``): every rank then holds the whole sequence for ``H/P`` heads,
so the unchanged local attention (causal or not, any kernel) sees full rows. The output goes
through the inverse exchange and comes back as ``s/P`` tokens with all heads. Autograd runs the
inverse exchange for each gradient.

The head split follows the KV heads read from ``key`` on every call (grouped-query attention
keeps a query head with its KV head); it is per call and per instance, never process-wide
state, so two models with different head counts in one process do not disturb each other.
Layouts: ``batch_dim_idx=0`` is ``[b, s, h, d]``, ``batch_dim_idx=1`` is ``[s, b, h, d]``.
"""

from __future__ import annotations

from typing import Any

import torch

from zerospeed import comm
from zerospeed.sequence.all_to_all import SeqAllToAll, head_split, heads_to_sequence
from zerospeed.sequence.output_layout import SingleLayoutOutput

__all__ = ["DistributedAttention", "apply_rotary_pos_emb"]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary_pos_emb(t: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on the first ``freqs_cos.shape[-1]`` channels of ``t``; the rest pass through."""
    rot_dim = freqs_cos.shape[-1]
    rotated, passed = t[..., :rot_dim], t[..., rot_dim:]
    rotated = rotated * freqs_cos + _rotate_half(rotated) * freqs_sin
    return rotated if passed.shape[-1] == 0 else torch.cat((rotated, passed), dim=-1)


class DistributedAttention(torch.nn.Module):
    """Wrap ``local_attention(q, k, v, *args, **kwargs)`` with the Ulysses head/sequence exchange.

    ``scatter_idx`` is the head dim (2 in both supported layouts); ``gather_idx`` is kept for
    DeepSpeed's signature: the sequence dim is taken from ``batch_dim_idx`` as DeepSpeed does.
    ``sp_stream`` is accepted for DeepSpeed's signature; the exchanges run on the current stream.
    """

    def __init__(self, local_attention: torch.nn.Module, sequence_process_group: Any, scatter_idx: int = 2,
                 gather_idx: int = 0, sp_stream: Any = None, num_kv_heads: int | None = None) -> None:
        super().__init__()
        if scatter_idx != 2:
            raise ValueError(f"DistributedAttention: scatter_idx must be the head dim 2 of a [b, s, h, d] or "
                             f"[s, b, h, d] tensor, got {scatter_idx}")
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx
        self.sp_stream = sp_stream
        self.num_kv_heads = num_kv_heads

    def _split(self, x: torch.Tensor, kv_heads: int, to_sequence: bool) -> list[int]:
        sp_size = comm.get_world_size(self.spg)
        heads = x.shape[2]
        if not to_sequence:  # output direction: the local head count tells the full one
            heads = heads * kv_heads // head_split(kv_heads, kv_heads, sp_size)[comm.get_rank(self.spg)]
        return head_split(heads, kv_heads, sp_size)

    def _exchange(self, x: torch.Tensor, seq_dim: int, kv_heads: int, to_sequence: bool) -> torch.Tensor:
        return SeqAllToAll.apply(x, self.spg, seq_dim, self._split(x, kv_heads, to_sequence), to_sequence)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch_dim_idx: int,
                rotary_pos_emb: Any = None, *args: Any, **kwargs: Any) -> torch.Tensor:
        if batch_dim_idx not in (0, 1):
            raise ValueError(f"DistributedAttention: batch_dim_idx must be 0 ([b, s, h, d]) or 1 ([s, b, h, d]), "
                             f"got {batch_dim_idx}")
        seq_dim = 1 - batch_dim_idx
        kv_heads = self.num_kv_heads if self.num_kv_heads is not None else key.shape[2]
        q = self._exchange(query, seq_dim, kv_heads, to_sequence=True)
        k = self._exchange(key, seq_dim, kv_heads, to_sequence=True)
        v = self._exchange(value, seq_dim, kv_heads, to_sequence=True)
        if rotary_pos_emb is not None:  # DeepSpeed's layout: (cos, sin), each [b, s, 1, d] -> [s, b, 1, d]
            cos, sin = rotary_pos_emb[0].permute(1, 0, 2, 3), rotary_pos_emb[1].permute(1, 0, 2, 3)
            q, k = apply_rotary_pos_emb(q, cos, sin), apply_rotary_pos_emb(k, cos, sin)
        with SingleLayoutOutput() as saved:   # [Note: attention output in one layout]
            context = self.local_attn(q, k, v, *args, **kwargs)
        split = self._split(context, kv_heads, to_sequence=False)
        out = SeqAllToAll.apply(context, self.spg, seq_dim, split, False)
        saved.keep_exchanged_only(context, out, lambda x: heads_to_sequence(x, seq_dim, split, self.spg))
        return out
