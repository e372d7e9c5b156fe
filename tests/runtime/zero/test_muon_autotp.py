"""Muon with AutoTP: a tiny HF Llama split over 2 tensor-parallel ranks (and 2 tp x 2 dp on 4 ranks)
at ZeRO 0-3 equals single-process Muon on the whole matrices (muon_models.reference_run, fp32).

Every attention and MLP matrix of the model is split by AutoTP (q/k/v/gate/up by rows, o/down by
columns, k/v with GQA), so Newton-Schulz on a shard instead of on the joined matrix ([Note: Muon
with AutoTP]) would miss the reference by far more than the tolerance.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from distributed import run_on_ranks
from muon_models import reference_run

STEPS, MICRO, SEQ, VOCAB = 3, 4, 16, 64
MUON = {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.1}
ADAM = {"lr": 2e-3, "betas": (0.9, 0.95), "eps": 1e-3, "weight_decay": 0.1}
BLOCK = {"muon_lr": MUON["lr"], "adam_lr": ADAM["lr"], "momentum": MUON["momentum"],
         "weight_decay": 0.1, "betas": [0.9, 0.95], "eps": 1e-3}
CLIP = 1.0   # DeepSpeed's default gradient_clipping, which the runs keep: the clip factor uses the tp norm
TOL = 1e-5
# Adam's eps is large so that its update is a smooth function of the gradient: with 1e-10 an element
# whose gradient cancels to ~0 takes a +-lr step whose sign is fp32 rounding, and Muon then carries
# that difference over the next steps well past TOL (the sharded sums round differently).


def _llama(kind: str = "llama") -> torch.nn.Module:
    """The tiny Llama (GQA), or a GPT-2 whose fused q/k/v `c_attn` is an [in, out] Conv1D weight."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=2 * SEQ, n_embd=32, n_layer=2, n_head=4,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * SEQ,
                                        tie_word_embeddings=False))


def _muon_names(model: torch.nn.Module) -> tuple[str, ...]:
    return tuple(n for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n and "lm_head" not in n)


def _lm_loss(model: torch.nn.Module, batch: tuple[torch.Tensor]) -> torch.Tensor:
    return model(input_ids=batch[0], labels=batch[0]).loss


def _train(stage: int, tp: int, ns_method: str, kind: str = "llama") -> dict:
    import zerospeed
    from zerospeed.comm import groups
    from zerospeed.runtime.tensor_parallel.state_dict import consolidated_state_dict

    dp = torch.distributed.get_world_size() // tp
    generator = torch.Generator().manual_seed(7)
    data = [torch.randint(0, VOCAB, (MICRO * dp, SEQ), generator=generator) for _ in range(STEPS)]
    model = _llama(kind)
    ref_losses, ref_params = reference_run(model, [(ids,) for ids in data], MUON, ADAM, CLIP,
                                           muon_names=_muon_names(model), loss_of=_lm_loss)
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "Muon", "params": {**BLOCK, "ns_method": ns_method}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
           "tensor_parallel": {"autotp_size": tp}}
    try:
        engine, *_ = zerospeed.initialize(model=copy.deepcopy(model), config=cfg)
        losses = []
        for ids in data:
            mine = ids[engine.get_data_parallel_rank() * MICRO:][:MICRO]
            loss = engine(input_ids=mine, labels=mine).loss
            engine.backward(loss)
            engine.step()
            mean = loss.detach().clone()
            torch.distributed.all_reduce(mean, group=engine.dp_group)
            losses.append(mean.item() / dp)
        with engine.optimizer.gathered_parameters(list(engine.module.parameters())):
            full = consolidated_state_dict(engine.module, engine.tensor_parallel.tp_group) if tp > 1 \
                else dict(engine.module.state_dict())
            diff = {name: (full[name] - ref_params[name]).abs().max().item() for name in ref_params}
        split = sum(bool(getattr(p, "tensor_model_parallel", False)) for p in engine.module.parameters()
                    if p.use_muon)
        return {"loss": max(abs(a - b) for a, b in zip(losses, ref_losses)), "param": diff, "split": split, "tp": tp,
                "calls": engine.basic_optimizer.newton_schulz_calls, "num_muon": len(_muon_names(model))}
    finally:
        groups.reset()


def _check(results: list[dict]) -> None:
    for result in results:
        assert result["split"] > 0, result
        assert result["loss"] < TOL, result
        worst = max(result["param"].items(), key=lambda item: item[1])
        assert worst[1] < TOL, worst
    # Each split matrix was orthogonalized whole exactly once per step, somewhere; one AutoTP left
    # whole (GPT-2's wte / wpe) once per tp rank (the same result on each); every rank did part.
    split, whole = results[0]["split"], results[0]["num_muon"] - results[0]["split"]
    assert sum(r["calls"] for r in results) == STEPS * (split + results[0]["tp"] * whole)
    assert all(r["calls"] > 0 for r in results)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_muon_autotp2_equals_single_process_muon(stage: int) -> None:
    _check(run_on_ranks(_train, 2, stage, 2, "gram"))


@pytest.mark.parametrize("stage", [1, 3])
def test_muon_autotp2_gpt2_fused_qkv_equals_single_process_muon(stage: int) -> None:
    _check(run_on_ranks(_train, 2, stage, 2, "gram", "gpt2"))


@pytest.mark.parametrize("stage", [1, 3])
def test_muon_autotp2_dp2_equals_single_process_muon(stage: int) -> None:
    _check(run_on_ranks(_train, 4, stage, 2, "standard" if stage == 3 else "gram"))



def _resume(stage: int, save_dir: str) -> float:
    """Train 2 steps, save, train a third; a fresh engine loading the save and training the same
    third step lands on the same parameters (Muon's momentum and Adam's moments per tp shard)."""
    import zerospeed
    from zerospeed.comm import groups

    generator = torch.Generator().manual_seed(11)
    data = [torch.randint(0, VOCAB, (MICRO, SEQ), generator=generator) for _ in range(3)]
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "Muon", "params": BLOCK},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
           "tensor_parallel": {"autotp_size": 2}}

    def step(engine: Any, ids: torch.Tensor) -> None:
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()

    def params(engine: Any) -> list[torch.Tensor]:
        with engine.optimizer.gathered_parameters(list(engine.module.parameters())):
            return [p.detach().clone() for p in engine.module.parameters()]

    try:
        engine, *_ = zerospeed.initialize(model=_llama(), config=cfg)
        for ids in data[:2]:
            step(engine, ids)
        engine.save_checkpoint(save_dir, tag="two")
        step(engine, data[2])
        expected = params(engine)
        groups.reset()
        fresh, *_ = zerospeed.initialize(model=_llama(), config=cfg)
        fresh.load_checkpoint(save_dir, tag="two")
        step(fresh, data[2])
        return max((a - b).abs().max().item() for a, b in zip(params(fresh), expected))
    finally:
        groups.reset()


@pytest.mark.parametrize("stage", [1, 3])
def test_muon_autotp2_checkpoint_resumes_exactly(stage: int, tmp_path: Any) -> None:
    assert run_on_ranks(_resume, 2, stage, str(tmp_path)) == [0.0, 0.0]
