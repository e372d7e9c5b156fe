"""The MoE layer on 2 and 4 gloo ranks equals a float64 single-process reference (tests/moe/moe_reference.py).

Every rank builds the same layer, gives each of its local experts weights drawn from the expert's
*global* id (so a token sent to the wrong expert shows), and runs its own tokens through it. The
parent gathers all weights and rebuilds the whole expert-parallel computation in float64: each
rank's output, l_aux and exp_counts, and the gradients of its input, its gate and residual
parameters (from its own loss) and of every expert (summed over the ranks of its expert-parallel
group, since the all-to-all's backward brings those ranks' gradients to the expert's owner).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from distributed import run_on_ranks

import moe_reference as reference

D_MODEL, D_HIDDEN, NUM_EXPERTS, TOKENS = 6, 10, 4, 12
CAPACITY_FACTOR, MIN_CAPACITY, AUX_COEF = 0.5, 1, 0.37
CASES = list(itertools.product((1, 2), (True, False), (False, True)))  # k, drop_tokens, use_residual


def _run_case(k: int, drop_tokens: bool, use_residual: bool, ep_size: int) -> dict:
    import torch.distributed as dist

    from zerospeed.moe.layer import MoE
    from zerospeed.utils import groups

    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    expert = torch.nn.Sequential(torch.nn.Linear(D_MODEL, D_HIDDEN), torch.nn.Tanh(),
                                 torch.nn.Linear(D_HIDDEN, D_MODEL))
    moe = MoE(D_MODEL, expert, NUM_EXPERTS, ep_size, k, CAPACITY_FACTOR, CAPACITY_FACTOR, MIN_CAPACITY,
              use_residual=use_residual, drop_tokens=drop_tokens, use_rts=False, top2_2nd_expert_sampling=False,
              drop_policy="position" if k == 1 else None)
    moe.set_deepspeed_parallelism()
    ep_rank = groups._get_expert_parallel_rank(moe.expert_group_name)
    experts = {}
    for local, module in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
        global_id = ep_rank * moe.num_local_experts + local
        generator = torch.Generator().manual_seed(100 + global_id)
        for param in module.parameters():
            param.data = torch.randn(param.shape, generator=generator) * 0.6
        experts[global_id] = module
    data = torch.Generator().manual_seed(7)
    x_all = torch.randn(world_size, 2, TOKENS // 2, D_MODEL, generator=data)
    probe_all = torch.randn(world_size, 2, TOKENS // 2, D_MODEL, generator=data)
    x = x_all[rank].clone().requires_grad_(True)
    output, l_aux, exp_counts = moe(x)
    ((output * probe_all[rank]).sum() + AUX_COEF * l_aux).backward()
    named = dict(moe.named_parameters())
    dense = {n: (p.detach().clone(), p.grad.clone()) for n, p in named.items() if "deepspeed_experts" not in n}
    return {"output": output.detach(), "l_aux": l_aux.detach(), "exp_counts": exp_counts, "x": x.detach(),
            "x_grad": x.grad, "probe": probe_all[rank], "dense": dense,
            "ep_ranks": list(groups._get_expert_parallel_group_ranks(moe.expert_group_name)),
            "experts": {e: ({n: p.detach().clone() for n, p in m.state_dict().items()},
                            {n: p.grad.clone() for n, p in m.named_parameters()}) for e, m in experts.items()}}


def _run_all_cases(ep_size: int) -> list[dict]:
    return [_run_case(k, drop, residual, ep_size) for k, drop, residual in CASES]


def _reference(results: list[dict], k: int, drop_tokens: bool, use_residual: bool) -> list[dict]:
    """Float64 forward and backward of all ranks together; per-rank results as the ranks report them."""
    group_experts = {}  # (first rank of the ep group, global expert id) -> float64 leaves
    for result in results:
        for expert_id, (state, _) in result["experts"].items():
            group_experts[(result["ep_ranks"][0], expert_id)] = {n: reference.leaf(v) for n, v in state.items()}
    cap = reference.capacity(TOKENS, NUM_EXPERTS, k, CAPACITY_FACTOR, MIN_CAPACITY, drop_tokens)
    total, per_rank = 0.0, []
    for result in results:
        x = reference.leaf(result["x"])
        dense = {n: reference.leaf(value) for n, (value, _) in result["dense"].items()}
        experts = [reference.mlp_expert(group_experts[(result["ep_ranks"][0], e)]) for e in range(NUM_EXPERTS)]
        residual = None
        if use_residual:
            mlp = reference.mlp_expert({n[len("mlp."):]: v for n, v in dense.items() if n.startswith("mlp.")})
            residual = (mlp, dense["coefficient.weight"], dense["coefficient.bias"])
        output, l_aux, counts = reference.moe_forward(x.reshape(-1, D_MODEL), dense["deepspeed_moe.gate.wg.weight"],
                                                      experts, k, cap, residual)
        total = total + (output * result["probe"].double().reshape(-1, D_MODEL)).sum() + AUX_COEF * l_aux
        per_rank.append({"output": output.reshape(result["x"].shape), "l_aux": l_aux, "exp_counts": counts,
                         "x": x, "dense": dense})
    total.backward()
    for result, ref in zip(results, per_rank):
        ref["experts"] = {e: {n: leaf.grad for n, leaf in group_experts[(result["ep_ranks"][0], e)].items()}
                          for e in result["experts"]}
    return per_rank


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    expected = expected.detach()
    scale = max(1.0, float(expected.abs().max()))
    torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=1e-5 * scale, msg=lambda m: f"{what}: {m}")


def _check_case(results: list[dict], k: int, drop_tokens: bool, use_residual: bool) -> None:
    case = f"k={k} drop_tokens={drop_tokens} use_residual={use_residual}"
    expected = _reference(results, k, drop_tokens, use_residual)
    for rank, (result, ref) in enumerate(zip(results, expected)):
        where = f"{case} rank {rank}"
        _close(result["output"], ref["output"], f"{where} output")
        _close(result["l_aux"], ref["l_aux"], f"{where} l_aux")
        assert result["exp_counts"].tolist() == ref["exp_counts"], f"{where} exp_counts"
        _close(result["x_grad"], ref["x"].grad, f"{where} input grad")
        for name, (_, grad) in result["dense"].items():
            _close(grad, ref["dense"][name].grad, f"{where} grad of {name}")
        for expert_id, (_, grads) in result["experts"].items():
            for name, grad in grads.items():
                _close(grad, ref["experts"][expert_id][name], f"{where} grad of expert {expert_id} {name}")


@pytest.mark.parametrize("world_size,ep_size", [(2, 2), (4, 2), (4, 4)])
def test_moe_layer_matches_float64_reference(world_size: int, ep_size: int) -> None:
    all_results = run_on_ranks(_run_all_cases, world_size, ep_size)
    for index, (k, drop_tokens, use_residual) in enumerate(CASES):
        results = [per_rank[index] for per_rank in all_results]
        if drop_tokens:  # the capacity limit must actually bite, or dropping is untested
            cap = reference.capacity(TOKENS, NUM_EXPERTS, k, CAPACITY_FACTOR, MIN_CAPACITY, True)
            assert max(int(r["exp_counts"].max()) for r in results) > cap
        _check_case(results, k, drop_tokens, use_residual)


def _all_to_all_records(k: int) -> list[tuple[str, int, int]]:
    from zerospeed.comm import comms_logger
    from zerospeed.moe.layer import MoE

    from zerospeed.runtime.engine_moe import EngineMoE

    layers = torch.nn.ModuleList(MoE(D_MODEL, torch.nn.Linear(D_MODEL, D_MODEL), NUM_EXPERTS, 2, k, CAPACITY_FACTOR,
                                     min_capacity=MIN_CAPACITY, use_rts=False, top2_2nd_expert_sampling=False)
                                 for _ in range(2))
    EngineMoE(layers)   # what initialize does: groups, and each layer's comms-logger name
    comms_logger.configure(enabled=True, prof_all=True)
    comms_logger.reset()
    try:
        hidden = torch.randn(TOKENS, D_MODEL, requires_grad=True)
        for moe in layers:
            hidden = moe(hidden)[0]
        hidden.sum().backward()
        return [(r.op, r.group_size, r.msg_bytes) for r in comms_logger.records]
    finally:
        comms_logger.configure(enabled=False)
        comms_logger.reset()


@pytest.mark.parametrize("k", [1, 2])
def test_all_to_all_bytes_equal_the_theory(k: int) -> None:
    """Per layer: two all-to-alls forward and two backward, each of E x capacity x d fp32 elements, logged
    under the layer's name."""
    capacity = reference.capacity(TOKENS, NUM_EXPERTS, k, CAPACITY_FACTOR, MIN_CAPACITY, True)
    names = ["moe_layer_0.dispatch", "moe_layer_0.combine", "moe_layer_1.dispatch", "moe_layer_1.combine"]
    names += [f"{name}.backward" for name in reversed(names)]
    expected = [(name, 2, NUM_EXPERTS * capacity * D_MODEL * 4) for name in names]
    for records in run_on_ranks(_all_to_all_records, 2, k):
        assert records == expected
