"""`EngineTensorParallel`, the AutoTP component the engine holds, on its own: built from a config
without an engine, its answers when AutoTP is off (no processes), and on 2 gloo ranks its groups,
its batch restatement (a formula) and its full weights against the unsharded model."""

from __future__ import annotations

import copy

import torch

from tests.distributed import run_on_ranks
from tp_models import tiny_model
from zerospeed.runtime.tensor_parallel.engine_component import EngineTensorParallel

BATCH = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}


def test_off_is_one_rank_and_passes_everything_through():
    module = torch.nn.Linear(3, 2)
    tp = EngineTensorParallel(None, module)
    assert (tp.enabled, tp.tp_rank, tp.tp_size, tp.tp_group, tp.dp_group, tp.plan) == (False, 0, 1, None, None, {})
    assert tp.batch_config(BATCH, 1) is BATCH
    state = module.state_dict()
    assert tp.full_weights(state) is state and tp.full_weights(None) is None


def test_build_without_autotp_leaves_the_model_alone():
    module = torch.nn.Linear(3, 2)
    before = copy.deepcopy(module.state_dict())
    tp = EngineTensorParallel.build(module, {"tensor_parallel": {"autotp_size": 1}}, None)
    assert not tp.enabled and tp.module is module
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())


def _on_two_ranks() -> dict:
    from zerospeed import comm
    from zerospeed.comm import groups

    reference = tiny_model("llama").state_dict()
    model = tiny_model("llama")
    try:
        tp = EngineTensorParallel.build(model, {"tensor_parallel": {"autotp_size": 2}}, None)
        full = tp.full_weights(model.state_dict())
        on_rank0 = tp.consolidated_16bit_state_dict(lambda exclude: model.state_dict())
        return {"place": (tp.enabled, tp.tp_size, tp.tp_rank, comm.get_world_size(tp.dp_group)),
                "rank": comm.get_rank(), "split": len(tp.plan) > 0,
                "sharded": any(v.shape != reference[k].shape for k, v in model.state_dict().items()),
                "full": set(full) == set(reference) and all(torch.equal(full[k], reference[k]) for k in reference),
                "rank0": len(on_rank0) and all(torch.equal(on_rank0[k], reference[k]) for k in reference),
                "none": (tp.full_weights(None), tp.consolidated_16bit_state_dict(lambda exclude: None)),
                # 8 = micro 4 x gas 1 x 2 ranks counts the tp ranks: restated for the one dp rank
                "restated": tp.batch_config(BATCH, 1)["train_batch_size"],
                "kept": tp.batch_config({**BATCH, "train_batch_size": 4}, 1)["train_batch_size"]}
    finally:
        groups.reset()


def test_two_ranks_split_join_and_restate():
    results = run_on_ranks(_on_two_ranks, 2)
    for result in results:
        assert result["place"] == (True, 2, result["rank"], 1)
        assert result["split"] and result["sharded"] and result["full"]
        assert result["none"] == (None, {})
        assert (result["restated"], result["kept"]) == (4, 4)
    assert results[0]["rank0"] and results[1]["rank0"] == 0
