"""`EngineMoE` (runtime/engine_moe.py), the engine's MoE component, on its own: what it finds and
hands out, and the optimizer's parameters, without processes (groups are stand-ins: nothing here
communicates); the expert broadcast on 2 gloo ranks against a formula (each expert parameter equals
the first rank's of its expert-data-parallel group, every other parameter stays this rank's)."""

from __future__ import annotations

import torch
from distributed import run_on_ranks

from zerospeed.comm.layout import ParallelLayout
from zerospeed.comm.run_groups import AxisGroup, ExpertGroups, RunGroups
from zerospeed.moe.layer import MoE
from zerospeed.moe.sharded_moe import MOELayer, TopKGate
from zerospeed.runtime.engine_moe import EngineMoE

_ME = AxisGroup("group-0", (0,))


class _Model(torch.nn.Module):
    def __init__(self, wide_ep: int = 1) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(4, 4)
        self.wide = MoE(4, torch.nn.Linear(4, 4), num_experts=2, ep_size=wide_ep)
        self.narrow = MoE(4, torch.nn.Linear(4, 4), num_experts=4, ep_size=1)


def _stand_in_groups() -> RunGroups:
    """A one-rank run's groups with one distinct (fake) group object per ep size."""
    experts = {"ep_size_1": ExpertGroups(1, AxisGroup("ep-1", (0,)), _ME)}
    return RunGroups(ParallelLayout(1, expert=1, has_moe=True), _ME, _ME, experts=experts)


def test_inactive_without_moe_layers():
    model = torch.nn.Linear(4, 4)
    moe = EngineMoE(model, RunGroups(ParallelLayout(1), _ME, _ME))
    params = list(model.parameters())
    assert not moe.has_moe_layers
    assert (moe.num_experts, moe.moe_layers, moe.gate_modules, moe.expert_groups) == ([], [], [], {})
    assert moe.optimizer_parameters(params, None) is params and moe.optimizer_parameters(None, None) is None
    moe.broadcast_expert_params()   # nothing to broadcast, and no process group to do it with


def test_finds_layers_and_hands_each_its_groups():
    model, run = _Model(), _stand_in_groups()
    moe = EngineMoE(model, run)
    assert moe.has_moe_layers and moe.num_experts == [2, 4]
    assert moe.moe_layers == [model.wide.deepspeed_moe, model.narrow.deepspeed_moe]
    assert all(isinstance(m, MOELayer) for m in moe.moe_layers)
    assert moe.gate_modules == [model.wide.deepspeed_moe.gate, model.narrow.deepspeed_moe.gate]
    assert all(isinstance(m, TopKGate) for m in moe.gate_modules)
    assert model.wide.deepspeed_moe.ep_group == "ep-1" and model.narrow.deepspeed_moe.ep_group == "ep-1"
    assert moe.expert_groups == {"ep_size_1": run.expert("ep_size_1")}
    assert [m.deepspeed_moe.comm_log_name for m in (model.wide, model.narrow)] == ["moe_layer_0", "moe_layer_1"]


def test_optimizer_parameters_split_the_experts_unless_the_client_brings_an_optimizer():
    model = _Model()
    moe = EngineMoE(model, _stand_in_groups())
    expert_ids = {id(p) for layer in (model.wide, model.narrow) for p in layer.deepspeed_moe.experts.parameters()}
    groups = moe.optimizer_parameters(None, None)   # None: the module's parameters, as initialize passes
    by_kind = {bool(g.get("moe")): {id(p) for p in g["params"]} for g in groups}
    assert by_kind == {True: expert_ids, False: {id(p) for p in model.parameters()} - expert_ids}
    given = list(model.parameters())
    assert moe.optimizer_parameters(given, torch.optim.SGD(given, lr=0.1)) is given


def _broadcast(wide_ep: int) -> dict[str, list[float]]:
    from zerospeed.comm import groups
    from zerospeed.runtime.engine_groups import build_run_groups

    groups.reset()
    torch.manual_seed(torch.distributed.get_rank())   # every parameter differs between the ranks
    model = _Model(wide_ep)
    layout = ParallelLayout(2, expert=wide_ep, has_moe=True, expert_sizes=(wide_ep, 1) if wide_ep > 1 else (1,))
    EngineMoE(model, build_run_groups(layout, model, None)).broadcast_expert_params()
    sums = {name: [float(p.double().sum())] for name, p in model.named_parameters()}
    gathered: list[dict[str, list[float]]] = [{}, {}]
    torch.distributed.all_gather_object(gathered, sums)
    groups.reset()
    return {name: gathered[0][name] + gathered[1][name] for name in sums}


def test_broadcast_from_the_first_rank_of_each_expert_data_group():
    for wide_ep in (1, 2):
        per_rank = run_on_ranks(_broadcast, 2, wide_ep)
        for name, (rank0, rank1) in per_rank[0].items():
            # ep 1: both ranks hold every expert, their expert-data group is both ranks, rank 0 sends;
            # ep 2: each rank holds other experts (its expert-data group is itself): left as they are;
            # dense parameters are the engine's data-parallel broadcast, not the component's.
            replicated = ".deepspeed_experts." in name and (name.startswith("narrow") or wide_ep == 1)
            assert (rank0 == rank1) == replicated, (wide_ep, name)
