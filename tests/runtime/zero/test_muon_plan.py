"""Muon's pure parts: owner plan, exchange routes, Newton-Schulz, param-group rules, refusals."""

from __future__ import annotations

import math

import pytest
import torch

from zerospeed.runtime.optimizer_factory import build_basic_optimizer
from zerospeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
from zerospeed.runtime.zero.muon.newton_schulz import orthogonalize, zeropower
from zerospeed.runtime.zero.muon.owner_exchange import OwnerOrthogonalizer
from zerospeed.runtime.zero.muon.owner_plan import (
    assign_owners,
    exchange_plan,
    flat_partition_specs,
    ns_cost,
    per_param_partition_specs,
)
from zerospeed.runtime.zero.muon.param_groups import muon_param_groups, tag_muon_params


def test_owners_balanced_by_cost_and_deterministic() -> None:
    shapes = [(64, 64), (8, 8), (64, 64), (32, 64), (8, 8), (16, 16)]
    owners = assign_owners(shapes, 2)
    assert owners == assign_owners(shapes, 2)
    loads = [sum(ns_cost(s) for s, o in zip(shapes, owners) if o == r) for r in range(2)]
    assert owners[0] != owners[2]                    # the two largest go to different ranks
    assert max(loads) - min(loads) <= max(ns_cost(s) for s in shapes)
    assert assign_owners(shapes, 1) == [0] * len(shapes)
    assert sorted(set(assign_owners(shapes, 8))) == list(range(6))   # more ranks than matrices: one each


def test_owners_prefer_the_rank_holding_the_matrix_within_an_even_share() -> None:
    """ZeRO 1/2's bench layout: blocks of a square and two 1x4 matrices, the first half of the flat
    buffer on rank 0. Each rank owns what it holds (nothing crosses), at the same cost as plain
    cost balancing, which sends half the matrices across."""
    shapes = [(8, 8), (8, 32), (32, 8)] * 4
    offsets = [sum(math.prod(s) for s in shapes[:i]) for i in range(len(shapes))]
    specs = flat_partition_specs(shapes, offsets, sum(math.prod(s) for s in shapes) // 2, 2)
    held = [[sum(p.numel for p in spec.pieces if p.rank == r) for r in range(2)] for spec in specs]
    owners = assign_owners(shapes, 2, held)
    assert owners == [0] * 6 + [1] * 6
    loads = [sum(ns_cost(s) for s, o in zip(shapes, owners) if o == r) for r in range(2)]
    assert loads[0] == loads[1]
    assert assign_owners(shapes, 2) != owners   # without `held`: cost alone
    even = [[math.prod(s) // 2] * 2 for s in shapes]   # stage 3: every matrix split evenly
    assert assign_owners(shapes, 2, even) == assign_owners(shapes, 2)


def _cover(specs, world_size, buffer_numel):  # every matrix element exactly once, buffers disjoint
    for spec in specs:
        seen = torch.zeros(spec.numel, dtype=torch.int32)
        for piece in spec.pieces:
            assert 0 <= piece.rank < world_size and piece.buffer_offset + piece.numel <= buffer_numel
            seen[piece.matrix_offset:piece.matrix_offset + piece.numel] += 1
        assert torch.equal(seen, torch.ones_like(seen))


def test_flat_partition_specs_cut_matrices_at_partition_boundaries() -> None:
    shapes, offsets = [(3, 5), (4, 4), (7, 2)], [0, 15, 31]   # 45 elements, padded to 48 for W=4 -> 12 each
    specs = flat_partition_specs(shapes, offsets, 12, 4)
    _cover(specs, 4, 12)
    assert [(p.rank, p.buffer_offset, p.matrix_offset, p.numel) for p in specs[1].pieces] == \
        [(1, 3, 0, 9), (2, 0, 9, 7)]


def test_per_param_specs_cut_each_matrix_into_w_chunks() -> None:
    specs = per_param_partition_specs([(3, 3), (2, 5)], [0, 3], 4)   # chunks of 3 and of 3
    _cover(specs, 4, 6)
    assert [(p.rank, p.buffer_offset, p.numel) for p in specs[0].pieces] == [(0, 0, 3), (1, 0, 3), (2, 0, 3)]
    assert [p.numel for p in specs[1].pieces] == [3, 3, 3, 1]


def test_exchange_plans_match_between_ranks() -> None:
    specs = flat_partition_specs([(3, 5), (4, 4), (7, 2)], [0, 15, 31], 16, 3)
    owners = assign_owners([s.shape for s in specs], 3)
    plans = [exchange_plan(specs, owners, r, 3) for r in range(3)]
    for src in range(3):
        for dst in range(3):   # what src sends to dst is exactly what dst expects from src
            assert plans[src].send[dst] == plans[dst].receive[src]
    assert sorted(i for p in plans for i in p.owned) == [0, 1, 2]


@pytest.mark.parametrize("shape", [(7, 13), (24, 24), (40, 24)])
def test_gram_and_standard_agree_with_float64(shape: tuple[int, int]) -> None:
    torch.manual_seed(0)
    g = torch.randn(shape, dtype=torch.float64)
    x = (g.T if shape[0] > shape[1] else g) / g.norm()
    for _ in range(5):
        a = x @ x.T
        x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
    expected = x.T if shape[0] > shape[1] else x
    for method in ("gram", "standard"):
        torch.testing.assert_close(zeropower(g.float(), 5, method).double(), expected, rtol=0, atol=5e-6)


@pytest.mark.parametrize("method", ["gram", "standard"])
def test_a_batch_of_matrices_is_each_matrix_alone(method: str) -> None:
    """Leading dims (here two) are a batch: the fused batched products give each matrix's own result."""
    torch.manual_seed(0)
    batch = torch.randn(2, 3, 8, 20)
    out = zeropower(batch, 5, method)
    assert out.shape == batch.shape
    for i in range(2):
        for j in range(3):
            torch.testing.assert_close(out[i, j], zeropower(batch[i, j], 5, method), rtol=0, atol=1e-6)


def test_gram_takes_the_standard_iteration_on_a_square_matrix() -> None:
    """A square Gram matrix is as large as the matrix: no saving, so "gram" runs "standard" (DeepSpeed's rule)."""
    torch.manual_seed(0)
    square = torch.randn(24, 24)
    assert torch.equal(zeropower(square, 5, "gram"), zeropower(square, 5, "standard"))


def test_conv_weights_are_one_matrix_and_3d_a_batch() -> None:
    torch.manual_seed(0)
    conv = torch.randn(6, 2, 3, 3)
    flat = orthogonalize(conv, (6, 2, 3, 3), method="standard")
    torch.testing.assert_close(flat, orthogonalize(conv.view(6, 18), (6, 18), method="standard"))
    batch = torch.randn(2, 8, 4)
    out = orthogonalize(batch, (2, 8, 4), method="standard").view(2, 8, 4)
    torch.testing.assert_close(out[1], orthogonalize(batch[1], (8, 4), method="standard").view(8, 4))
    assert math.isclose(out[1].norm().item(), math.sqrt(2) * zeropower(batch[1], 5, "standard").norm().item(),
                        rel_tol=1e-6)   # tall: scaled by sqrt(rows / cols)


def test_one_step_matches_torch_optim_muon() -> None:
    """The same formula as torch's Muon (which runs Newton-Schulz in bf16: 2e-2 relative)."""
    torch.manual_seed(0)
    start, grad = torch.randn(16, 8), torch.randn(16, 8)
    ours, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    a = MuonWithAuxAdam([{"params": [ours], "use_muon": True, "lr": 0.1, "momentum": 0.9,
                          "weight_decay": 0.05, "ns_method": "standard"}])
    b = torch.optim.Muon([theirs], lr=0.1, momentum=0.9, weight_decay=0.05)
    for _ in range(2):
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        a.step()
        b.step()
    delta_ours, delta_theirs = ours.detach() - start, theirs.detach() - start
    assert (delta_ours - delta_theirs).norm() <= 2e-2 * delta_theirs.norm()
    assert a.newton_schulz_calls == 2


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(10, 4)
        self.proj = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.lm_head = torch.nn.Linear(4, 10, bias=False)
        self.frozen = torch.nn.Linear(4, 4, bias=False)
        self.frozen.weight.requires_grad_(False)


def test_param_group_rules_and_lrs() -> None:
    net = _Net()
    net.norm.weight.use_muon = False   # a user's own tag is kept
    tag_muon_params(net)
    flags = {name: p.use_muon for name, p in net.named_parameters()}
    assert flags == {"embed_tokens.weight": False, "proj.weight": True, "proj.bias": False, "norm.weight": False,
                     "norm.bias": False, "lm_head.weight": False, "frozen.weight": True}
    block = {"lr": 0.5, "muon_lr": 0.02, "weight_decay": 0.1, "betas": [0.8, 0.9], "momentum": 0.9}
    optimizer = build_basic_optimizer("Muon", block, net.parameters())
    muon, adam = optimizer.param_groups
    assert (muon["name"], muon["use_muon"], muon["lr"], muon["momentum"], muon["weight_decay"]) == \
        ("muon-params", True, 0.02, 0.9, 0.1)
    assert [id(p) for p in muon["params"]] == [id(net.proj.weight)]   # frozen matrices left out
    assert (adam["name"], adam["lr"], adam["betas"], adam["eps"], adam["weight_decay"]) == \
        ("adam-params", 0.5, (0.8, 0.9), 1e-10, 0.1)
    assert muon["ns_method"] == "gram" and muon["ns_steps"] == 5 and muon["nesterov"] is True


def test_incoming_groups_keep_their_own_settings() -> None:
    net = _Net()
    tag_muon_params(net)
    decay = [net.proj.weight, net.lm_head.weight]
    no_decay = [net.proj.bias, net.norm.weight, net.norm.bias, net.embed_tokens.weight]
    groups = muon_param_groups([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
                               {"weight_decay": 0.1, "adam_lr": 1e-3})
    assert [(g["name"], g["weight_decay"], len(g["params"])) for g in groups] == [
        ("group0-muon-params", 0.1, 1), ("group0-adam-params", 0.1, 1), ("group1-adam-params", 0.0, 4)]
    assert all(g["lr"] == 1e-3 for g in groups if not g["use_muon"])


@pytest.mark.parametrize("block,match", [
    ({"nesterov_momentum": True}, "nesterov_momentum"),
    ({"per_head_muon": "yes"}, "per_head_muon"),
    ({"ns_method": "svd"}, "ns_method"),
])
def test_bad_blocks_are_refused_by_name(block: dict, match: str) -> None:
    net = _Net()
    tag_muon_params(net)
    with pytest.raises(ValueError, match=match):
        build_basic_optimizer("muon", block, net.parameters())


def test_mislabelled_vectors_are_refused() -> None:
    net = _Net()
    tag_muon_params(net)
    optimizer = build_basic_optimizer("Muon", {}, net.parameters(), offload=True)
    assert isinstance(optimizer, MuonWithAuxAdam)   # the same class offloaded or not
    net.norm.bias.use_muon = True
    with pytest.raises(ValueError, match="norm.bias"):
        tag_muon_params(net)


def test_a_flat_tensor_without_owner_layout_is_never_stepped_as_sgd() -> None:
    flat = torch.nn.Parameter(torch.zeros(12))
    flat.grad = torch.ones(12)
    with pytest.raises(RuntimeError, match="SGD"):
        MuonWithAuxAdam([{"params": [flat], "use_muon": True}]).step()


def test_mup_optimizers_come_from_the_mup_package(monkeypatch) -> None:
    import sys
    import types

    net = _Net()
    monkeypatch.setitem(sys.modules, "mup", None)   # not installed
    with pytest.raises(ValueError, match="pip install mup"):
        build_basic_optimizer("MuAdam", {"lr": 1e-3}, net.parameters())
    fake = types.ModuleType("mup")
    fake.MuAdamW = lambda groups, **kw: torch.optim.AdamW(groups, **kw)   # type: ignore[attr-defined]
    fake.MuSGD = lambda groups, **kw: torch.optim.SGD(groups, **kw)       # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mup", fake)
    assert isinstance(build_basic_optimizer("MuAdamW", {"lr": 1e-3}, net.parameters()), torch.optim.AdamW)
    assert isinstance(build_basic_optimizer("musgd", {"lr": 1e-3}, net.parameters()), torch.optim.SGD)


def test_moe_group_halves_keep_the_expert_group_name() -> None:
    """The ZeRO wrappers find an expert group's expert-data-parallel group by its name."""
    net = _Net()
    tag_muon_params(net)
    groups = muon_param_groups([{"params": [net.norm.weight]},
                                {"params": [net.proj.weight, net.proj.bias], "moe": True, "name": "ep_size_2"}], {})
    assert [(g["name"], g.get("moe", False), g["use_muon"]) for g in groups] == [
        ("group0-adam-params", False, False), ("ep_size_2", True, True), ("ep_size_2", True, False)]


@pytest.mark.parametrize("dim,fused_parts", [(0, 1), (1, 1), (0, 3), (1, 3)])
def test_join_shards_inverts_autotp_sharding(dim: int, fused_parts: int) -> None:
    from zerospeed.runtime.tensor_parallel.layers import TPShard, shard_of
    from zerospeed.runtime.zero.muon.tp_matrices import full_shape, join_shards

    full = torch.randn(12, 18)
    shards = [TPShard(dim, fused_parts, 2, rank) for rank in range(2)]
    pieces = [shard_of(full, shard) for shard in shards]
    assert full_shape(tuple(pieces[0].shape), shards[0]) == (12, 18)
    assert torch.equal(join_shards(pieces, shards[0]), full)


def test_owner_exchange_returns_each_matrix_and_zeros_elsewhere() -> None:
    """One rank, no process group: a flat buffer with padding before, between and after two
    matrices gets each matrix's O in place and exact zeros everywhere else."""
    torch.manual_seed(0)
    shapes, offsets = [(3, 5), (4, 4)], [2, 20]
    orthogonalizer = OwnerOrthogonalizer(flat_partition_specs(shapes, offsets, 40, 1), group=None)
    update = torch.randn(40)
    out = orthogonalizer(update, 5, "gram")
    for shape, offset in zip(shapes, offsets):
        numel = math.prod(shape)
        expected = orthogonalize(update[offset:offset + numel], shape, 5, "gram")
        assert torch.equal(out[offset:offset + numel], expected)
    gaps = torch.cat([out[:2], out[17:20], out[36:]])
    assert torch.equal(gaps, torch.zeros(9))
