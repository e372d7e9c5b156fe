"""[Note: stage dispatch] (base_optimizer.py): every optimizer wrapper answers the contract the
engine and the checkpoint code use, so neither has to ask which stage it runs.

Each stage trains one step on 2 ranks and its answers are checked against the module itself
(names, shapes, full weights) and against DeepSpeed's rules (no_sync below stage 2 only)."""

import os

import pytest
import torch

import zerospeed
from distributed import run_on_ranks
from parity import global_batches, make_model, micro_batch
from zerospeed.runtime.base_optimizer import DeepSpeedOptimizer

GLOBAL_BATCH = 8


def _engine(stage, precision):
    config = {"train_batch_size": GLOBAL_BATCH, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                    "stage3_gather_16bit_weights_on_model_save": True}, **precision}
    model = make_model()
    model.fc2.bias.requires_grad_(False)   # a frozen parameter: not in any trainable group
    engine, _, _, _ = zerospeed.initialize(model=model, config=config)
    rank = torch.distributed.get_rank()
    x, y = micro_batch(global_batches(1, GLOBAL_BATCH)[0], 0, rank, GLOBAL_BATCH // 2, 2)
    dtype = next(p for p in engine.module.parameters()).dtype
    engine.backward(engine(x.to(dtype), y.to(dtype)))
    engine.step()
    return engine


def _contract(stage, precision, tmp_dir):
    engine = _engine(stage, precision)
    wrapper = engine.optimizer
    reference = make_model()
    full_shapes = {n: p.shape for n, p in reference.named_parameters()}
    trainable_names = [n for n, p in reference.named_parameters() if n != "fc2.bias"]
    groups = wrapper.trainable_param_groups()
    module_params = {id(p) for p in engine.module.parameters()}
    shapes = wrapper.param_shapes(engine.param_names)
    state16 = wrapper.module_state_dict_16bit(engine.module)
    wrapper.refresh_fp32_params()                   # masters from the weights: nothing moves
    after = wrapper.module_state_dict_16bit(engine.module)
    engine.save_16bit_model(tmp_dir, f"model{stage}.bin")
    return {
        "is_wrapper": isinstance(wrapper, DeepSpeedOptimizer),
        "abstract_left": sorted(getattr(type(wrapper), "__abstractmethods__", ())),
        "group_members_are_module_params": all(id(p) in module_params for g in groups for p in g),
        "group_names": [engine.param_names[p] for g in groups for p in g],
        "shape_names": [n for g in shapes for n in g],
        "shapes_match": all(full_shapes[n] == s for g in shapes for n, s in g.items()),
        "trainable_names": trainable_names,
        # stage 3 gathers to rank 0 only (None elsewhere), as DeepSpeed
        "state16": None if state16 is None else {k: v.float() for k, v in state16.items()},
        "after_refresh": None if after is None else {k: v.float() for k, v in after.items()},
        "saves": wrapper.saves_16bit_model(),
        "no_sync": wrapper.supports_no_sync,
        "state_keys": sorted(wrapper.state_dict()),
    }


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", [{}, {"bf16": {"enabled": True}}], ids=["fp32", "bf16"])
def test_every_wrapper_answers_the_contract(stage, precision, tmp_path):
    results = run_on_ranks(_contract, 2, stage, precision, str(tmp_path))
    for rank, answer in enumerate(results):
        assert answer["is_wrapper"] and answer["abstract_left"] == []
        assert answer["group_members_are_module_params"]
        assert sorted(answer["group_names"]) == sorted(answer["trainable_names"])
        assert answer["shape_names"] == answer["group_names"] and answer["shapes_match"]
        assert answer["no_sync"] == (stage < 2) and answer["saves"]
        assert "loss_scaler" in answer["state_keys"]
        if stage == 3 and rank > 0:
            assert answer["state16"] is None
            continue
        for name, tensor in answer["state16"].items():
            assert torch.equal(answer["after_refresh"][name], tensor), name
            assert tensor.shape == make_model().state_dict()[name].shape
            assert torch.equal(tensor, results[0]["state16"][name])   # the same full weights everywhere
    saved = torch.load(os.path.join(tmp_path, f"model{stage}.bin"), weights_only=True)
    assert sorted(saved) == sorted(results[0]["state16"])
    for name, tensor in results[0]["state16"].items():
        assert torch.equal(saved[name].float(), tensor)
