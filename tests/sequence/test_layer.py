"""`DistributedAttention` on 2 gloo ranks equals full-sequence attention in one process: output and
q/k/v gradients, batch-first and sequence-first, causal and not, MHA, GQA and an uneven KV split."""

import pytest
import torch
import torch.nn.functional as F

from distributed import run_on_ranks
from zerospeed import comm
from zerospeed.sequence.all_to_all import head_split
from zerospeed.sequence.layer import DistributedAttention

# (batch_dim_idx, causal, query heads, kv heads)
CASES = [(0, False, 4, 4), (1, False, 4, 4), (0, True, 4, 2), (1, True, 4, 2), (0, True, 6, 3), (1, False, 6, 3)]


def _local_attention(q, k, v, batch_dim_idx, causal):
    """Plain SDPA over full rows; KV heads repeated for GQA."""
    to_bhsd = (lambda t: t.permute(0, 2, 1, 3)) if batch_dim_idx == 0 else (lambda t: t.permute(1, 2, 0, 3))
    q, k, v = to_bhsd(q), to_bhsd(k), to_bhsd(v)
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return out.permute(0, 2, 1, 3) if batch_dim_idx == 0 else out.permute(2, 0, 1, 3)


def _one_case(batch_dim_idx, causal, heads, kv_heads, seq=8, batch=2, dim=4):
    rank, world = comm.get_rank(), comm.get_world_size()
    gen = torch.Generator().manual_seed(100 + heads + batch_dim_idx)
    shape = lambda h: (batch, seq, h, dim) if batch_dim_idx == 0 else (seq, batch, h, dim)  # noqa: E731
    full = [torch.randn(shape(h), generator=gen) for h in (heads, kv_heads, kv_heads)]
    weight = torch.randn(shape(heads), generator=gen)
    ref_in = [t.clone().requires_grad_(True) for t in full]
    ref_out = _local_attention(*ref_in, batch_dim_idx, causal)
    (ref_out * weight).sum().backward()

    seq_dim = 1 - batch_dim_idx
    mine = lambda t: t.chunk(world, dim=seq_dim)[rank]  # noqa: E731
    local_in = [mine(t).clone().requires_grad_(True) for t in full]
    attention = DistributedAttention(lambda q, k, v, c: _local_attention(q, k, v, batch_dim_idx, c),
                                     comm.get_world_group())
    out = attention(*local_in, batch_dim_idx, None, causal)
    (out * mine(weight)).sum().backward()

    def rel(a, b):
        return ((a - b).abs().max() / b.abs().max()).item()

    errors = [rel(out, mine(ref_out.detach()))]
    errors += [rel(t.grad, mine(r.grad)) for t, r in zip(local_in, ref_in)]
    return max(errors)


def _all_cases():
    return [_one_case(*case) for case in CASES]


def test_distributed_attention_matches_full_sequence():
    results = run_on_ranks(_all_cases, 2)
    for rank_errors in results:
        for case, error in zip(CASES, rank_errors):
            assert error < 1e-5, (case, error)


def test_head_split_follows_kv_heads():
    assert head_split(8, 4, 2) == [4, 4]
    assert head_split(6, 3, 2) == [4, 2]  # KV heads [2, 1], two query heads per KV head
    assert head_split(7, 7, 4) == [2, 2, 2, 1]  # DeepSpeed's uneven split
    with pytest.raises(ValueError, match="key/value heads"):
        head_split(4, 1, 2)
