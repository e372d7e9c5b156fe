"""The tiny language model the sequence-parallel tests train: embedding -> causal self-attention
(Ulysses when given a sequence-parallel group) -> head; no positions needed."""

import torch
import torch.nn.functional as F


class UlyssesLM(torch.nn.Module):
    def __init__(self, vocab: int, hidden: int, heads: int, sp_group: object = None) -> None:
        super().__init__()
        from zerospeed.sequence.layer import DistributedAttention

        self.vocab, self.hidden, self.heads = vocab, hidden, heads
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.out = torch.nn.Linear(hidden, hidden)
        self.head = torch.nn.Linear(hidden, vocab)
        self.attention = self._sdpa if sp_group is None else DistributedAttention(self._sdpa, sp_group)

    @staticmethod
    def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *unused: object) -> torch.Tensor:  # [b, s, h, d]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return out.transpose(1, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        q, k, v = self.qkv(x).view(*tokens.shape, 3, self.heads, self.hidden // self.heads).unbind(2)
        ctx = self.attention(q, k, v, 0)  # batch_dim_idx 0: [b, s, h, d]
        return self.head(x + self.out(ctx.reshape(*tokens.shape, self.hidden)))
