"""The gradient space on 2 real gloo ranks against one process's torch: each case lays one full
gradient vector out over the ranks as a layout would (ZeRO partitions, stage-0 experts, AutoTP
split and replicated elements, pipeline stages with a tied weight), and the space's norm must equal
the float64 norm of the concatenated distinct elements; an inf on one rank must stop every rank
that steps with it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distributed import run_on_ranks
from zerospeed.runtime.grad_space import DENSE, GradSpace, PipelineStages

# Each rank's elements are summed in float64 (under 64 Ki elements: one float64 pass), so the
# space's norm differs from the reference only by float64 rounding of a few adds.
RTOL = 1e-12
EXPERT = "ep_size_2"


def _tensors(seed: int, *numels: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=generator) for n in numels]


def _reference(*tensors: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(torch.cat([t.reshape(-1) for t in tensors]), dtype=torch.float64))


def _case(layout: str) -> tuple[float, float]:
    """(the space's norm on this rank, the reference norm of the whole vector)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    everyone = dist.group.WORLD
    if layout == "zero":       # one vector, each rank a disjoint partition
        (full,) = _tensors(1, 1000)
        mine = full.chunk(world)[rank]
        return GradSpace(everyone, partitioned=True).scaled_norm([(mine, DENSE)]), _reference(full)
    if layout == "replicated":  # stage 0: every rank the whole averaged vector
        full = _tensors(2, 300, 40)
        return GradSpace(everyone).scaled_norm([(t, DENSE) for t in full]), _reference(*full)
    if layout == "experts":     # stage 0: dense replicated, one distinct expert per ep rank
        dense, *experts = _tensors(3, 50, 70, 70)
        space = GradSpace(everyone, expert_groups={EXPERT: everyone})
        return space.scaled_norm([(dense, DENSE), (experts[rank], (EXPERT, False))]), _reference(dense, *experts)
    if layout.startswith("tp"):  # a split weight (a column block per tp rank) and a replicated bias
        weight, bias = _tensors(4, 12 * 8, 8)
        block = weight.view(12, 8).chunk(world, dim=1)[rank].contiguous()
        pieces = [(block, ("", True)), (bias, ("", False))]
        if layout == "tp_zero":  # ... and each piece partitioned over a dp group of one rank
            solos = [dist.new_group([0]), dist.new_group([1])]   # every rank creates every group
            space = GradSpace(solos[rank], partitioned=True, tp_group=everyone)
        else:
            space = GradSpace(everyone, tp_group=everyone)
        return space.scaled_norm(pieces), _reference(weight, bias)
    # pipeline: one stage per rank, a tied weight on both; the second copy's squares are subtracted
    stage_layers = _tensors(5, 200, 90)
    (tied,) = _tensors(6, 33)
    duplicate = float(tied.double().square().sum()) if rank == 1 else 0.0
    space = GradSpace(everyone, pipeline=PipelineStages(everyone, everyone, lambda: duplicate))
    return space.scaled_norm([(stage_layers[rank], DENSE), (tied, DENSE)]), _reference(*stage_layers, tied)


@pytest.mark.parametrize("layout", ["zero", "replicated", "experts", "tp", "tp_zero", "pipeline"])
def test_norm_equals_the_full_vector_norm(layout):
    results = run_on_ranks(_case, 2, layout)
    for norm, reference in results:
        assert norm == pytest.approx(reference, rel=RTOL)
    assert results[0][0] == results[1][0]   # every rank clips by the same number


def _overflow(layout: str) -> bool:
    rank = dist.get_rank()
    everyone = dist.group.WORLD
    grads = [torch.ones(70_000), torch.ones(5)]
    if rank == 1:
        grads[0][12_345] = float("inf")
    spaces = {"zero": GradSpace(everyone, partitioned=True),
              "experts": GradSpace(everyone, expert_groups={EXPERT: everyone}),
              "tp": GradSpace(None, tp_group=everyone),
              "pipeline": GradSpace(None, pipeline=PipelineStages(everyone, everyone, lambda: 0.0)),
              "replicated": GradSpace(everyone)}
    return spaces[layout].overflow(grads)


@pytest.mark.parametrize("layout", ["zero", "experts", "tp", "pipeline"])
def test_overflow_on_one_rank_stops_every_rank(layout):
    assert run_on_ranks(_overflow, 2, layout) == [True, True]


def test_replicated_gradients_are_not_reduced():
    # Stage 0 without experts: gradients are equal everywhere, so the flag is local (no collective).
    assert run_on_ranks(_overflow, 2, "replicated") == [False, True]


def test_parts_of_parameters():
    split, expert, plain = (torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
    split.tensor_model_parallel = True
    expert.allreduce, expert.group_name = False, EXPERT
    with_tp = GradSpace(tp_group=object())
    assert [with_tp.part_of(p) for p in (split, plain)] == [("", True), DENSE]
    with_experts = GradSpace(expert_groups={EXPERT: None})
    assert [with_experts.part_of(p) for p in (expert, plain)] == [(EXPERT, False), DENSE]
    # ZeRO 1-3 declare no expert part (the dp sum counts each expert once); no tp group, no split part
    assert [GradSpace(partitioned=True).part_of(p) for p in (split, expert)] == [DENSE, DENSE]
