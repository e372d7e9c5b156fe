"""The run's `ParallelLayout` and its one table of refused combinations, without processes; then
through `initialize` on 2 ranks, that each refusal comes before the model is cut or grouped."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.distributed import run_on_ranks
from zerospeed.comm.layout import REFUSED_COMBINATIONS, ParallelLayout, parallel_layout_for_run

_SIZES = {"pipe": 2, "tensor": 2, "sequence": 2}


def _layout(features: set[str]) -> ParallelLayout:
    sizes = {axis: size for axis, size in _SIZES.items() if axis in features}
    return ParallelLayout(16, **sizes, has_moe="expert" in features, zero_stage=3 if "zero3" in features else 1)


def _refused(features: set[str]) -> bool:
    return any(refusal.features <= features for refusal in REFUSED_COMBINATIONS)


@pytest.mark.parametrize("pair", list(itertools.combinations(["pipe", "tensor", "sequence", "expert", "zero3"], 2)))
def test_every_pair_is_refused_exactly_when_the_table_says(pair):
    layout = _layout(set(pair))
    assert set(layout.enabled()) == set(pair)
    if _refused(set(pair)):
        with pytest.raises(ValueError, match="is not supported: ") as error:
            layout.validate()
        reason = next(r.reason for r in REFUSED_COMBINATIONS if r.features == frozenset(pair))
        assert reason in str(error.value)
    else:
        layout.validate()


def test_the_supported_pairs_today():
    """The table as a fact: what runs together (a row deleted or added shows up here)."""
    supported = {frozenset(p) for p in itertools.combinations(["pipe", "tensor", "sequence", "expert", "zero3"], 2)
                 if not _refused(set(p))}
    assert supported == {frozenset(p) for p in [("pipe", "expert"), ("tensor", "zero3"), ("sequence", "expert"),
                                                 ("sequence", "zero3"), ("expert", "zero3")]}


def test_data_axis_takes_the_ranks_left():
    assert ParallelLayout(16, pipe=2, sequence=2).data == 4
    assert ParallelLayout(8, tensor=4).data == 2


def test_layout_from_config_names_what_the_user_gave():
    layout = parallel_layout_for_run({"sequence_parallel_size": 2, "zero_optimization": {"stage": 3}}, 4,
                                     tensor_size=2)
    assert (layout.sequence, layout.tensor, layout.zero_stage, layout.has_moe) == (2, 2, 3, False)
    with pytest.raises(ValueError) as error:
        layout.validate()
    message = str(error.value)
    assert "tensor_parallel.autotp_size=2" in message and "sequence_parallel_size=2" in message
    assert "DeepSpeed 0.19.8" in message


def test_moe_layers_at_ep_size_1_count_as_moe():
    """AutoTP does not shard experts even when each rank holds all of them."""
    layout = parallel_layout_for_run({}, 2, tensor_size=2, moe_expert_sizes=(1,))
    assert layout.has_moe and layout.expert == 1
    with pytest.raises(ValueError, match=r"tensor_parallel.autotp_size=2 together with MoE layers \(largest ep_size 1\)"):
        layout.validate()


def _autotp_with_moe() -> tuple[str, list[int]]:
    import zerospeed
    from zerospeed.moe.layer import MoE

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), MoE(8, torch.nn.Linear(8, 8), num_experts=2, ep_size=2))
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "tensor_parallel": {"autotp_size": 2}}
    try:
        zerospeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    except ValueError as error:
        return str(error), [p.numel() for p in model.parameters()]
    return "", []


def test_initialize_refuses_autotp_with_moe_before_cutting():
    full = [64, 8]
    for message, numels in run_on_ranks(_autotp_with_moe, 2):
        assert "tensor_parallel.autotp_size=2 together with MoE layers" in message, message
        assert numels[:2] == full   # the dense layer was not cut


def test_expert_sizes_in_the_models_order_each_once():
    """The expert groups are created in this order on every rank (a collective)."""
    layout = parallel_layout_for_run({}, 4, moe_expert_sizes=(2, 1, 2, 4, 1))
    assert (layout.expert_sizes, layout.expert, layout.has_moe) == ((2, 1, 4), 4, True)
    plain = parallel_layout_for_run({}, 4)
    assert (plain.expert_sizes, plain.expert, plain.has_moe) == ((), 1, False)


def test_expert_sizes_must_agree_with_the_largest():
    with pytest.raises(ValueError, match=r"expert_sizes \(2, 1\)"):
        ParallelLayout(4, expert=1, has_moe=True, expert_sizes=(2, 1))
    with pytest.raises(ValueError, match="has_moe=False"):
        ParallelLayout(4, expert=2, expert_sizes=(2,))


def test_data_parallel_size_beside_sequence_parallel_is_checked_with_the_layout():
    assert parallel_layout_for_run({"sequence_parallel_size": 2, "data_parallel_size": 2}, 4).data == 2
    with pytest.raises(ValueError, match=r"data_parallel_size=4 but world size 4 / sequence_parallel_size 2 = 2"):
        parallel_layout_for_run({"sequence_parallel_size": 2, "data_parallel_size": 4}, 4)
    # a sequence size that does not divide the world is reported where its grid is built
    assert parallel_layout_for_run({"sequence_parallel_size": 3, "data_parallel_size": 4}, 4).sequence == 3
