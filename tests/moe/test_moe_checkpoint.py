"""MoE checkpoints ([Note: MoE checkpoint layout]): DeepSpeed's file layout, a bit-for-bit resume, and
loading the expert weights at a different expert-parallel size."""

from __future__ import annotations

import os

import pytest
import torch
from distributed import run_on_ranks
from test_moe_engine import MICRO, MoEModel, _batches, _shard

import zerospeed
from zerospeed.checkpoint.manifest import load_file
from zerospeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

STEPS = 2


def _engine(ep_size: int, stage: int = 0) -> tuple:
    from zerospeed.utils import groups

    model = MoEModel(ep_size, k=2, drop_tokens=True)
    model.set_expert_weights(torch.distributed.get_rank() % ep_size)   # ep groups: consecutive ranks
    config = {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": stage,
              **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, _, _, _ = zerospeed.initialize(model=model, config=config)
    assert groups._get_expert_parallel_rank(model.moe.expert_group_name) == torch.distributed.get_rank() % ep_size
    return engine, model


def _train(engine: object, batches: list, rank: int, world_size: int) -> list[float]:
    losses = []
    for batch in batches:
        loss = engine(*_shard(batch, 0, rank, world_size))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _global_params(model: MoEModel) -> dict[str, torch.Tensor]:
    """Parameters with local expert indices renamed to global ids."""
    from zerospeed.utils import groups

    ep_rank = groups._get_expert_parallel_rank(model.moe.expert_group_name)
    named = {}
    for name, param in model.named_parameters():
        if "deepspeed_experts." in name:
            head, tail = name.split("deepspeed_experts.")
            local, rest = tail.split(".", 1)
            name = f"{head}deepspeed_experts.{ep_rank * model.moe.num_local_experts + int(local)}.{rest}"
        with zerospeed.zero.GatheredParameters([param]):   # a no-op below stage 3
            named[name] = param.detach().clone()
    return named


def _save_then_resume(save_dir: str, ep_size: int, stage: int) -> dict:
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    batches = _batches(world_size, 1)
    engine, model = _engine(ep_size, stage)
    _train(engine, batches[:1], rank, world_size)
    engine.save_checkpoint(save_dir, tag="t")
    saved = _global_params(model)
    continued = _train(engine, batches[1:], rank, world_size)
    expected = _global_params(model)
    engine, model = _engine(ep_size, stage)
    engine.load_checkpoint(save_dir, tag="t")
    resumed = _train(engine, batches[1:], rank, world_size)
    resharded = None
    if stage == 3:   # the weights alone at ep 4 ([Note: MoE stage-3 reshard])
        engine, other = _engine(world_size, stage)
        engine.load_checkpoint(save_dir, tag="t", load_optimizer_states=False)
        resharded = _global_params(other)
    return {"continued": continued, "resumed": resumed, "expected": expected, "got": _global_params(model),
            "saved": saved, "resharded": resharded}


@pytest.mark.parametrize("world_size,ep_size,stage", [(2, 2, 0), (4, 2, 0), (4, 2, 2), (4, 2, 3)])
def test_resume_is_bit_for_bit_in_deepspeed_layout(world_size: int, ep_size: int, stage: int,
                                                   tmp_path: object) -> None:
    results = run_on_ranks(_save_then_resume, world_size, str(tmp_path), ep_size, stage)
    saved_values = {name: value for result in results for name, value in result["saved"].items()}
    for result in results:
        assert result["continued"] == result["resumed"]
        for name, value in result["expected"].items():
            assert torch.equal(result["got"][name], value), name
        for name, value in (result["resharded"] or {}).items():
            assert torch.equal(value, saved_values[name]), f"at ep 4: {name}"
    tag_dir = os.path.join(str(tmp_path), "t")
    files = set(os.listdir(tag_dir))
    expected_files = {f"layer_0_expert_{e}_mp_rank_00_model_states.pt" for e in range(4)}
    expected_files |= {f"expp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(ep_size)} if stage == 0 else \
        {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world_size)}
    assert expected_files <= files, sorted(files)
    model_file = "zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"
    model_states = load_file(os.path.join(tag_dir, model_file))
    assert not [k for k in model_states["module"] if "deepspeed_experts" in k]
    assert "moe.deepspeed_moe.gate.wg.weight" in model_states["module"] and model_states["num_experts"] == [4]
    expert_3 = load_file(os.path.join(tag_dir, "layer_0_expert_3_mp_rank_00_model_states.pt"))
    assert sorted(expert_3) == [f"moe.deepspeed_moe.experts.deepspeed_experts.3.{n}"
                                for n in ("0.bias", "0.weight", "2.bias", "2.weight")]
    # zero_to_fp32 gives the whole model as saved, every expert once under its global id
    # ([Note: MoE checkpoints in zero_to_fp32]); fp32 training, so bit for bit.
    full = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag="t")
    saved = {name: value for result in results for name, value in result["saved"].items()}
    experts = [name for result in results[:ep_size] for name in result["saved"] if "deepspeed_experts." in name]
    dense = [name for name in results[0]["saved"] if "deepspeed_experts." not in name]
    head = dense.index("head.weight")   # module order: every expert sits between the gate and the head
    assert list(full) == dense[:head] + experts + dense[head:]
    for name, value in saved.items():
        assert full[name].dtype == torch.float32 and torch.equal(full[name], value), name


def _save(save_dir: str, ep_size: int) -> dict:
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    engine, model = _engine(ep_size)
    _train(engine, _batches(world_size, 1)[:1], rank, world_size)
    engine.save_checkpoint(save_dir, tag="t")
    return _global_params(model)


def _load_at(save_dir: str, ep_size: int, load_optimizer_states: bool) -> dict:
    engine, model = _engine(ep_size)
    engine.load_checkpoint(save_dir, tag="t", load_optimizer_states=load_optimizer_states)
    return _global_params(model)


def test_expert_weights_load_at_another_expert_parallel_size(tmp_path: object) -> None:
    saved = run_on_ranks(_save, 2, str(tmp_path), 2)
    expected = {**saved[0], **saved[1]}
    for result in run_on_ranks(_load_at, 2, str(tmp_path), 1, False):  # ep 1: every rank holds all 4 experts
        assert result.keys() == expected.keys()
        for name, value in expected.items():
            assert torch.equal(result[name], value), name
    with pytest.raises(Exception, match="load_optimizer_states=False"):
        run_on_ranks(_load_at, 2, str(tmp_path), 1, True)


def _bf16_save(save_root: str) -> dict:
    """A bf16 run per stage (4 ranks, ep 2: each expert's masters split over 2 ranks at 1-3), saved; each
    parameter's fp32 master (safe_get_full_fp32_param, expert ones over their expert-data-parallel group)
    and bf16 weight, under global ids."""
    from zerospeed.utils import groups, safe_get_full_fp32_param

    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    out = {}
    for stage in (0, 2, 3):
        model = MoEModel(2, k=2, drop_tokens=True)
        model.set_expert_weights(rank % 2)
        config = {"train_micro_batch_size_per_gpu": MICRO, "bf16": {"enabled": True},
                  "zero_optimization": {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
        engine, _, _, _ = zerospeed.initialize(model=model, config=config)
        for batch in _batches(world_size, 1)[:2]:
            engine.backward(engine(*(t.bfloat16() for t in _shard(batch, 0, rank, world_size))))
            engine.step()
        engine.save_checkpoint(os.path.join(save_root, f"s{stage}"), tag="t")
        ep_rank = groups._get_expert_parallel_rank(model.moe.expert_group_name)
        masters, weights = {}, {}
        for name, param in model.named_parameters():
            if "deepspeed_experts." in name:
                head, tail = name.split("deepspeed_experts.")
                local, rest = tail.split(".", 1)
                name = f"{head}deepspeed_experts.{ep_rank * 2 + int(local)}.{rest}"
            masters[name] = safe_get_full_fp32_param(param).clone()
            with zerospeed.zero.GatheredParameters([param]):
                weights[name] = param.detach().float().clone()
        out[stage] = {"masters": masters, "weights": weights}
    return out


def test_bf16_zero_to_fp32_reads_the_experts_fp32_masters(tmp_path: object) -> None:
    """zero_to_fp32 of a bf16 MoE checkpoint gives every parameter, experts included, as the engine's fp32
    master, bit for bit (not the bf16 module weights upcast), at stages 0, 2 and 3."""
    results = run_on_ranks(_bf16_save, 4, str(tmp_path))
    for stage in (0, 2, 3):
        masters = {n: v for result in results for n, v in result[stage]["masters"].items()}
        weights = {n: v for result in results for n, v in result[stage]["weights"].items()}
        full = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / f"s{stage}"), tag="t")
        assert set(full) == set(masters), stage
        for name, value in masters.items():
            assert full[name].dtype == torch.float32 and torch.equal(full[name], value), f"stage {stage} {name}"
        expert = "moe.deepspeed_moe.experts.deepspeed_experts.3.0.weight"
        assert not torch.equal(masters[expert], weights[expert]), "bf16 weights must differ from the masters"


def _stage3_state(model: MoEModel) -> dict:
    """Every parameter's fp32 master and Adam moments under global ids (collectives: every rank calls)."""
    from zerospeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    names = dict(zip(_global_params(model), model.parameters()))
    return {name: (safe_get_full_fp32_param(p).clone(), safe_get_full_optimizer_state(p, "exp_avg").clone(),
                   safe_get_full_optimizer_state(p, "exp_avg_sq").clone()) for name, p in names.items()}


def _stage3_save(save_dir: str) -> dict:
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    engine, model = _engine(2, 3)
    _train(engine, _batches(world_size, 1)[:2], rank, world_size)
    engine.save_checkpoint(save_dir, tag="t")
    return _stage3_state(model)


def _stage3_load(save_dir: str, ep_size: int) -> dict:
    engine, model = _engine(ep_size, 3)
    engine.load_checkpoint(save_dir, tag="t")
    state = _stage3_state(model)
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    _train(engine, _batches(world_size, 1)[2:], rank, world_size)   # and it trains on
    return state


def _stage3_loads(save_dir: str) -> list[dict]:
    return [_stage3_load(save_dir, ep_size) for ep_size in (1, 2)]


def test_stage3_moe_checkpoint_resumes_at_another_world_and_expert_parallel_size(tmp_path: object) -> None:
    """Saved on 4 ranks with ep 2 (experts partitioned over pairs of ranks), loaded on 2 ranks with ep 1 (every
    rank holds all 4 experts) and ep 2: every fp32 master and Adam moment equals the saved one, bit for bit."""
    saved = run_on_ranks(_stage3_save, 4, str(tmp_path))
    expected = {name: value for result in saved for name, value in result.items()}
    assert len(expected) == 5 + 4 * 4   # inp, gate, head (weight, bias) and 4 experts x 4 tensors
    for per_rank in run_on_ranks(_stage3_loads, 2, str(tmp_path)):
        for ep_size, loaded in zip((1, 2), per_rank):
            for name, value in loaded.items():
                for what, got, want in zip(("master", "exp_avg", "exp_avg_sq"), value, expected[name]):
                    assert torch.equal(got, want), f"ep {ep_size}: {name} {what}"


# --- crossing between stage 3 and stages 0-2 ([Note: MoE stage crossing]) --------------------------

def _cross(save_dir: str, save_stage: int, load_stages: list[int]) -> dict:
    """Train 2 steps at `save_stage` and save; go on for one step. Then at each of `load_stages`: load,
    read every master and Adam moment, and take the same step."""
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    batches = _batches(world_size, 1)
    engine, model = _engine(2, save_stage)
    _train(engine, batches[:2], rank, world_size)
    engine.save_checkpoint(save_dir, tag="t")
    saved = _stage3_state(model)
    continued = _train(engine, batches[2:], rank, world_size)
    loaded = {}
    for stage in load_stages:
        engine, model = _engine(2, stage)
        engine.load_checkpoint(save_dir, tag="t")
        state = _stage3_state(model)
        loaded[stage] = {"state": state, "losses": _train(engine, batches[2:], rank, world_size)}
    return {"saved": saved, "continued": continued, "loaded": loaded}


@pytest.mark.parametrize("save_stage,load_stages", [(3, [0, 1, 2]), (2, [3]), (1, [3])])
def test_moe_checkpoint_crosses_between_stage_3_and_stages_0_to_2(save_stage: int, load_stages: list[int],
                                                                   tmp_path: object) -> None:
    """Saved on 4 ranks at ep 2 and loaded at another stage: every fp32 master and Adam moment, experts
    included, equals the saved one bit for bit, and the next step's loss equals the saving run's."""
    results = run_on_ranks(_cross, 4, str(tmp_path), save_stage, load_stages)
    saved = {name: value for result in results for name, value in result["saved"].items()}
    for rank, result in enumerate(results):
        for stage, loaded in result["loaded"].items():
            for name, value in loaded["state"].items():
                for what, got, want in zip(("master", "exp_avg", "exp_avg_sq"), value, saved[name]):
                    assert torch.equal(got, want), f"rank {rank}, stage {save_stage} -> {stage}: {name} {what}"
            torch.testing.assert_close(torch.tensor(loaded["losses"]), torch.tensor(result["continued"]),
                                       rtol=1e-5, atol=0)


def _stage0_into_stage3(save_dir: str) -> None:
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    engine, _ = _engine(2, 0)
    _train(engine, _batches(world_size, 1)[:1], rank, world_size)
    engine.save_checkpoint(save_dir, tag="t")
    engine, _ = _engine(2, 3)
    with pytest.raises(ValueError, match="saved at zero_optimization.stage 0 and this run is at stage 3"):
        engine.load_checkpoint(save_dir, tag="t")


def test_stage0_moe_checkpoint_into_stage3_is_a_clear_error(tmp_path: object) -> None:
    run_on_ranks(_stage0_into_stage3, 2, str(tmp_path))
