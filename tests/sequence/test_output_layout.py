"""[Note: attention output in one layout]: autograd does not keep the attention's own output (head
layout) after a Ulysses forward; backward rebuilds it with one more exchange (5 all-to-alls in
backward, not 4) and still gives the gradients of the plain computation (2 gloo ranks)."""

from unittest import mock

import pytest
import torch
import torch.utils.checkpoint
import torch.nn.functional as F

from distributed import run_on_ranks
from zerospeed import comm

SEQ, HEADS, DIM = 8, 4, 8


def _sdpa(q, k, v, *unused):   # [b, s, h, d] -> [b, s, h, d]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return out.transpose(1, 2).contiguous()


def _run(checkpointed):
    from zerospeed.sequence.layer import DistributedAttention

    world, rank = comm.get_world_size(), comm.get_rank()
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, SEQ, HEADS, DIM) for _ in range(3))
    proj = torch.nn.Linear(HEADS * DIM, 3)
    cols = slice(rank * SEQ // world, (rank + 1) * SEQ // world)
    mine = [t[:, cols].clone().requires_grad_() for t in (q, k, v)]
    attention = DistributedAttention(_sdpa, torch.distributed.group.WORLD)
    if checkpointed:   # non-reentrant checkpointing holds nothing and recomputes: ours steps aside
        out = torch.utils.checkpoint.checkpoint(attention, *mine, 0, use_reentrant=False)
    else:
        out = attention(*mine, 0)
    loss = proj(out.reshape(1, -1, HEADS * DIM)).square().sum()
    with mock.patch.object(comm, "all_to_all_single", wraps=comm.all_to_all_single) as exchange:
        loss.backward()
    # Backward through every rank's slice loss is backward through the whole sequence's loss.
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    proj(_sdpa(*full).reshape(1, SEQ, HEADS * DIM)).square().sum().backward()
    worst = max(((m.grad - f.grad[:, cols]).abs().max() / f.grad.abs().max()).item() for m, f in zip(mine, full))
    return exchange.call_count, worst


@pytest.mark.parametrize("checkpointed, exchanges", [
    (False, 5),   # q, k, v and output gradients, and the output rebuilt
    (True, 7),    # 4 gradients and the recomputed q, k, v exchanges (recomputation stops once the
                  # attention's saved tensors exist); nothing rebuilt
])
def test_attention_output_is_kept_in_one_layout(checkpointed, exchanges):
    for backward_exchanges, worst in run_on_ranks(_run, 2, checkpointed):
        assert backward_exchanges == exchanges
        assert worst < 1e-5
