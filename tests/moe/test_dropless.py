"""Dropless MoE (`drop_tokens=False`): every token reaches its top-k experts through a variable-size
all-to-all, with no capacity and no padding ([Note: dropless dispatch]).

The routing is made lopsided on purpose: one expert gets no token from any rank, and on 2 ranks one
rank sends none to an expert the other rank fills far past what `capacity_factor` would allow. Each
rank's output (training and eval), input gradient, gate gradient and every expert's gradient must
equal a dense single-process fp32 reference that runs every expert on every token and keeps the
top-k ones; the comms logger must show unpadded all-to-alls (k x S x d elements each way).
"""

from __future__ import annotations

import pytest
import torch
from distributed import run_on_ranks

D_MODEL, D_HIDDEN, NUM_EXPERTS, TOKENS, EP_SIZE = 6, 10, 4, 12, 2
TOLERANCE = 1e-6   # fp32: both sides sum the same few terms, in different orders


def _gate_weight() -> torch.Tensor:
    """Tokens have positive features (see _tokens); expert 3's row is negative, so it is never chosen
    for k <= 3, and expert 0's row favours feature 0, which is large on rank 0's tokens."""
    weight = torch.randn(NUM_EXPERTS, D_MODEL, generator=torch.Generator().manual_seed(11)) * 0.3
    weight[0, 0] += 2.0
    weight[3] = -2.0
    return weight


def _tokens(rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(world_size, TOKENS, D_MODEL, generator=generator).abs()
    x[0, :, 0] += 3.0
    probe = torch.randn(world_size, TOKENS, D_MODEL, generator=generator)
    return x[rank], probe[rank]


def _expert_weights(module: torch.nn.Module, global_id: int) -> None:
    generator = torch.Generator().manual_seed(100 + global_id)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.6)


def _run_k(k: int) -> dict:
    from zerospeed.comm import comms_logger
    from zerospeed.moe.layer import MoE
    from zerospeed.runtime.engine_moe import EngineMoE
    from zerospeed.utils import groups

    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    expert = torch.nn.Sequential(torch.nn.Linear(D_MODEL, D_HIDDEN), torch.nn.Tanh(), torch.nn.Linear(D_HIDDEN, D_MODEL))
    # capacity_factor and min_capacity would drop most of expert 0's tokens; dropless ignores them.
    moe = MoE(D_MODEL, expert, NUM_EXPERTS, EP_SIZE, k, capacity_factor=0.25, eval_capacity_factor=0.25,
              min_capacity=1, drop_tokens=False, top2_2nd_expert_sampling=False)
    EngineMoE(moe)
    ep_rank = groups._get_expert_parallel_rank(moe.expert_group_name)
    with torch.no_grad():
        moe.deepspeed_moe.gate.wg.weight.copy_(_gate_weight())
    local_ids = [ep_rank * moe.num_local_experts + i for i in range(moe.num_local_experts)]
    for global_id, module in zip(local_ids, moe.deepspeed_moe.experts.deepspeed_experts):
        _expert_weights(module, global_id)
    x, probe = _tokens(rank, world_size)
    x.requires_grad_(True)
    comms_logger.configure(enabled=True, prof_all=True)
    comms_logger.reset()
    try:
        output, _, exp_counts = moe(x)
        (output * probe).sum().backward()
        records = [(r.op, r.msg_bytes) for r in comms_logger.records]
    finally:
        comms_logger.configure(enabled=False)
        comms_logger.reset()
    moe.eval()
    with torch.no_grad():
        eval_output = moe(x)[0]
    experts = moe.deepspeed_moe.experts.deepspeed_experts
    return {"output": output.detach(), "eval_output": eval_output, "exp_counts": exp_counts.tolist(),
            "x_grad": x.grad, "gate_grad": moe.deepspeed_moe.gate.wg.weight.grad.clone(), "records": records,
            "ep_ranks": list(groups._get_expert_parallel_group_ranks(moe.expert_group_name)),
            "expert_grads": {g: {n: p.grad.clone() for n, p in m.named_parameters()}
                             for g, m in zip(local_ids, experts)}}


def _run_all() -> list[dict]:
    return [_run_k(k) for k in (1, 2, 3)]


def _reference(k: int, world_size: int) -> list[dict]:
    """Dense fp32: every expert on every token, the top-k kept; one set of expert copies per ep group."""
    expert = torch.nn.Sequential(torch.nn.Linear(D_MODEL, D_HIDDEN), torch.nn.Tanh(), torch.nn.Linear(D_HIDDEN, D_MODEL))
    copies = {}
    for first in range(0, world_size, EP_SIZE):
        for global_id in range(NUM_EXPERTS):
            module = copies[(first, global_id)] = torch.nn.Sequential(*(type(m)(*_dims(m)) for m in expert))
            _expert_weights(module, global_id)
    gate = _gate_weight().requires_grad_(True)
    results = []
    for rank in range(world_size):
        x, probe = _tokens(rank, world_size)
        x.requires_grad_(True)
        gates = torch.softmax(x @ gate.t(), dim=1)
        top_gate, top_expert = torch.topk(gates, k, dim=1)
        weights = top_gate if k == 1 else top_gate / top_gate.sum(dim=1, keepdim=True)
        every = torch.stack([copies[(rank // EP_SIZE * EP_SIZE, e)](x) for e in range(NUM_EXPERTS)], dim=1)
        chosen = every.gather(1, top_expert.unsqueeze(-1).expand(-1, -1, D_MODEL))
        output = (chosen * weights.unsqueeze(-1)).sum(dim=1)
        (output * probe).sum().backward()
        results.append({"output": output.detach(), "x_grad": x.grad,
                        "exp_counts": torch.bincount(top_expert.reshape(-1), minlength=NUM_EXPERTS).tolist()})
    for rank, result in enumerate(results):
        first = rank // EP_SIZE * EP_SIZE
        result["gate_grad"] = gate.grad
        result["expert_grads"] = {e: {n: p.grad if p.grad is not None else torch.zeros_like(p)
                                      for n, p in copies[(first, e)].named_parameters()} for e in range(NUM_EXPERTS)}
    return results


def _dims(module: torch.nn.Module) -> tuple:
    return (module.in_features, module.out_features) if isinstance(module, torch.nn.Linear) else ()


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    scale = max(1.0, float(expected.abs().max()))
    torch.testing.assert_close(actual, expected, rtol=TOLERANCE, atol=TOLERANCE * scale, msg=lambda m: f"{what}: {m}")


def _check(results: list[dict], k: int, world_size: int) -> None:
    expected = _reference(k, world_size)
    counts = [r["exp_counts"] for r in results]
    assert all(c[3] == 0 for c in counts), f"k={k}: expert 3 must get no token: {counts}"
    assert max(max(c) for c in counts) > 2 * TOKENS * k / NUM_EXPERTS * 0.25, "capacity_factor would have dropped"
    gate_grad = sum(r["gate_grad"] for r in results)   # no engine here: each rank holds its own loss's gradient
    _close(gate_grad, expected[0]["gate_grad"], f"k={k} gate grad")
    for rank, (result, ref) in enumerate(zip(results, expected)):
        where = f"k={k} rank {rank}"
        assert result["exp_counts"] == ref["exp_counts"], where
        _close(result["output"], ref["output"], f"{where} output")
        _close(result["eval_output"], ref["output"], f"{where} eval output")
        _close(result["x_grad"], ref["x_grad"], f"{where} input grad")
        for expert_id, grads in result["expert_grads"].items():
            for name, grad in grads.items():
                _close(grad, ref["expert_grads"][expert_id][name], f"{where} expert {expert_id} {name}")
        # Unpadded: a rank sends its k x S routes and gets back the rows its own experts were sent.
        local = range(result["ep_ranks"].index(rank) * 2, result["ep_ranks"].index(rank) * 2 + 2)
        received = sum(counts[q][e] for q in result["ep_ranks"] for e in local)
        sent_bytes, received_bytes = k * TOKENS * D_MODEL * 4, received * D_MODEL * 4
        assert result["records"] == [("moe_layer_0.counts", NUM_EXPERTS * 8), ("moe_layer_0.dispatch", sent_bytes),
                                     ("moe_layer_0.combine", received_bytes),
                                     ("moe_layer_0.combine.backward", sent_bytes),
                                     ("moe_layer_0.dispatch.backward", received_bytes)], where


@pytest.mark.parametrize("world_size", [2, 4])   # ep 2; ep 2 x dp 2
def test_dropless_equals_dense_reference(world_size: int) -> None:
    all_results = run_on_ranks(_run_all, world_size)
    counts = [r["exp_counts"] for r in all_results[0]] if world_size == 2 else []
    assert world_size == 4 or (0 in counts[0][:3] and max(counts[1][:3]) > 0), "a rank sends an expert nothing"
    for index, k in enumerate((1, 2, 3)):
        _check([per_rank[index] for per_rank in all_results], k, world_size)
