"""`per_head_muon`: which projections are split by heads ([Note: per-head Muon]), and the update at
ZeRO 0-3, with AutoTP too, equals a single-process reference that orthogonalizes each head's block
of rows on its own (muon_models.reference_run with `head_dims`, float64 Newton-Schulz block by block).

The tiny HF Llama has 4 attention heads of 8 and 2 key/value heads (GQA): q_proj [32, 32] is 4
blocks of [8, 32], k_proj / v_proj [16, 32] 2 blocks of [8, 32]; o_proj and the MLP stay whole.
"""

from __future__ import annotations

import copy

import pytest
import torch
from distributed import run_on_ranks
from muon_models import reference_run

from zerospeed.runtime.zero.muon.param_groups import tag_muon_params
from zerospeed.runtime.zero.muon.per_head import resolve_head_count, tag_per_head

STEPS, MICRO, SEQ, VOCAB, WORLD = 3, 2, 8, 64, 2
MUON = {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.1}
ADAM = {"lr": 2e-3, "betas": (0.9, 0.95), "eps": 1e-3, "weight_decay": 0.1}
BLOCK = {"muon_lr": MUON["lr"], "adam_lr": ADAM["lr"], "momentum": MUON["momentum"], "weight_decay": 0.1,
         "betas": [0.9, 0.95], "eps": 1e-3, "per_head_muon": True}
TOL = 1e-5


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * SEQ,
                                        tie_word_embeddings=False))


def _muon_names(model: torch.nn.Module) -> tuple[str, ...]:
    return tuple(n for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n and "lm_head" not in n)


def _head_dims(model: torch.nn.Module) -> dict[str, int]:
    return {n: 8 for n in _muon_names(model) if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight"))}


def test_projections_split_by_heads_as_deepspeed_resolves_them() -> None:
    model = _llama()
    tag_muon_params(model)
    tag_per_head(model, True)
    heads = {n: (p.muon_num_heads, p.muon_head_dim) for n, p in model.named_parameters() if p.muon_head_dim}
    assert heads == {**{f"model.layers.{i}.self_attn.q_proj.weight": (4, 8) for i in range(2)},
                     **{f"model.layers.{i}.self_attn.{k}_proj.weight": (2, 8) for i in range(2) for k in "kv"}}
    tag_per_head(model, False)   # DeepSpeed's attributes exist either way, None without the option
    assert all(p.muon_num_heads is None and p.muon_head_dim is None for p in model.parameters())


@pytest.mark.parametrize("name,shape,expected", [
    ("a.q_proj.weight", (32, 32), (4, "head-dim")),
    ("a.k_proj.weight", (16, 32), (2, "head-dim")),
    ("a.k_proj.weight", (24, 32), (None, "width-mismatch")),
    ("a.o_proj.weight", (32, 32), (None, "not-attention")),
    ("a.qkv_proj.weight", (64, 32), (None, "not-head-blocked")),
    ("a.query_key_value.weight", (96, 32), (None, "not-head-blocked")),
    ("a.q_proj.weight", (32, 4, 8), (None, "not-2d")),
])
def test_resolution_rules(name: str, shape: tuple[int, ...], expected: tuple) -> None:
    from transformers import LlamaConfig

    text = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    assert resolve_head_count(name, shape, text) == expected


def test_mla_widths() -> None:
    from types import SimpleNamespace

    mla = SimpleNamespace(num_attention_heads=4, qk_nope_head_dim=6, qk_rope_head_dim=2, v_head_dim=4)
    assert resolve_head_count("a.q_b_proj.weight", (32, 16), mla) == (4, "mla-q")
    assert resolve_head_count("a.kv_b_proj.weight", (40, 16), mla) == (4, "mla-kv")
    assert resolve_head_count("a.kv_a_proj_with_mqa.weight", (40, 16), mla) == (None, "not-head-blocked")
    # q_proj on a model with MLA fields and a head_dim: whichever width the rows confirm
    both = SimpleNamespace(num_attention_heads=4, head_dim=4, qk_nope_head_dim=6, qk_rope_head_dim=2)
    assert resolve_head_count("a.q_proj.weight", (32, 16), both) == (4, "mla-q")
    assert resolve_head_count("a.q_proj.weight", (16, 16), both) == (4, "head-dim")


def test_per_head_that_would_change_nothing_is_an_error() -> None:
    from muon_models import make_model
    from transformers import GPT2Config, GPT2LMHeadModel

    plain = make_model()   # no HF config: no head count
    tag_muon_params(plain)
    with pytest.raises(ValueError, match="per_head_muon"):
        tag_per_head(plain, True)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4))   # fused c_attn only
    tag_muon_params(gpt2)
    with pytest.raises(ValueError, match="per_head_muon.*c_attn"):
        tag_per_head(gpt2, True)


def _lm_loss(model: torch.nn.Module, batch: tuple[torch.Tensor]) -> torch.Tensor:
    return model(input_ids=batch[0], labels=batch[0]).loss


def _train(stage: int, tp: int, zero_init: bool = False) -> dict:
    import zerospeed
    from zerospeed.comm import groups
    from zerospeed.runtime.tensor_parallel.state_dict import consolidated_state_dict

    dp = torch.distributed.get_world_size() // tp
    generator = torch.Generator().manual_seed(7)
    data = [torch.randint(0, VOCAB, (MICRO * dp, SEQ), generator=generator) for _ in range(STEPS)]
    model = _llama()
    _, ref_params = reference_run(model, [(ids,) for ids in data], MUON, ADAM, 1.0, muon_names=_muon_names(model),
                                  loss_of=_lm_loss, head_dims=_head_dims(model))
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "optimizer": {"type": "Muon", "params": BLOCK},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
           "tensor_parallel": {"autotp_size": tp}}
    try:
        if zero_init:   # the layer shapes are ds_shape: heads resolved from them
            with zerospeed.zero.Init(config_dict_or_path=cfg):
                partitioned = _llama()
            values = dict(model.named_parameters())
            params = dict(partitioned.named_parameters())
            with zerospeed.zero.GatheredParameters(list(params.values()), modifier_rank=0), torch.no_grad():
                for name, param in params.items():   # HF's init under zero.Init draws other values
                    param.copy_(values[name])
            model = partitioned
        engine, *_ = zerospeed.initialize(model=model if zero_init else copy.deepcopy(model), config=cfg)
        for ids in data:
            mine = ids[engine.get_data_parallel_rank() * MICRO:][:MICRO]
            engine.backward(engine(input_ids=mine, labels=mine).loss)
            engine.step()
        with engine.optimizer.gathered_parameters(list(engine.module.parameters())):
            full = consolidated_state_dict(engine.module, engine.tensor_parallel.tp_group) if tp > 1 \
                else dict(engine.module.state_dict())
            diff = {name: (full[name] - ref_params[name]).abs().max().item() for name in ref_params}
        q = engine.module.model.layers[0].self_attn.q_proj.weight
        return {"param": diff, "q_heads": (q.muon_num_heads, q.muon_head_dim)}
    finally:
        groups.reset()


@pytest.mark.parametrize("stage,tp,zero_init", [(0, 1, False), (1, 1, False), (2, 1, False), (3, 1, False),
                                                (3, 1, True), (1, 2, False), (3, 2, False)])
def test_per_head_muon_equals_single_process_per_head_reference(stage: int, tp: int, zero_init: bool) -> None:
    for result in run_on_ranks(_train, WORLD, stage, tp, zero_init):
        worst = max(result["param"].items(), key=lambda item: item[1])
        assert worst[1] < TOL, worst
        # DeepSpeed's count after AutoTP: the shard's heads (4 / tp), the width unchanged
        assert result["q_heads"] == (4 // tp, 8)
