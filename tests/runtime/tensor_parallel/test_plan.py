"""The AutoTP plan (pure, no processes) and the ``tensor_parallel`` config section."""

from __future__ import annotations

import pytest
import torch

from zerospeed.runtime.config import DeepSpeedConfig
from zerospeed.runtime.tensor_parallel.config import TPTrainingConfig
from zerospeed.runtime.tensor_parallel.plan import LayerInfo, Partition, Style, build_plan, hf_tp_plan
from zerospeed.runtime.tensor_parallel.shard import linear_layers

COLUMN, ROW, SKIP = Partition(Style.COLUMN), Partition(Style.ROW), Partition(Style.SKIP)


def _tiny(kind: str) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if kind == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=4))
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))


def _plan(model: torch.nn.Module, **kwargs) -> dict[str, Partition]:
    return build_plan([info for _, _, info in linear_layers(model)], hf_tp_plan(model), **kwargs)


def test_llama_projections_follow_deepspeeds_rules():
    plan = _plan(_tiny("llama"))
    layer = "model.layers.0."
    assert {plan[layer + f"self_attn.{p}_proj"] for p in "qkv"} == {COLUMN}
    assert plan[layer + "self_attn.o_proj"] == ROW and plan[layer + "mlp.down_proj"] == ROW
    assert plan[layer + "mlp.gate_proj"] == COLUMN and plan[layer + "mlp.up_proj"] == COLUMN
    assert plan["lm_head"] == Partition(Style.COLUMN, gather_output=True)


def test_gpt2_conv1d_fused_qkv_and_tied_head():
    plan = _plan(_tiny("gpt2"))
    assert plan["transformer.h.0.attn.c_attn"] == Partition(Style.COLUMN, fused_parts=3)
    assert plan["transformer.h.0.attn.c_proj"] == ROW and plan["transformer.h.0.mlp.c_proj"] == ROW
    assert plan["transformer.h.0.mlp.c_fc"] == COLUMN
    assert plan["lm_head"] == SKIP  # tied to wte: stays replicated


def test_name_rules_without_a_hf_plan():
    layers = [LayerInfo("blocks.0.attn.out_proj", True), LayerInfo("blocks.0.mlp.fc1", True),
              LayerInfo("blocks.0.mlp.fc2", True), LayerInfo("blocks.0.mlp.gate", True), LayerInfo("pooler", False)]
    plan = build_plan(layers)
    assert [plan[layer.name] for layer in layers] == [ROW, COLUMN, ROW, SKIP, SKIP]


def test_partition_config_overrides_and_unreadable_fused_layouts_fail():
    with pytest.raises(ValueError, match="query_key_value"):
        build_plan([LayerInfo("h.0.attention.query_key_value", True)])
    spec = {"layer_specs": [{"patterns": [r".*query_key_value\.weight$"], "partition_type": "skip"}]}
    assert build_plan([LayerInfo("h.0.attention.query_key_value", True)], partition_config=spec)[
        "h.0.attention.query_key_value"] == SKIP
    only = {"use_default_specs": False, "layer_specs": [{"patterns": [r".*o_proj\.weight$"], "partition_type": "row"}]}
    plan = _plan(_tiny("llama"), partition_config=only)
    assert plan["model.layers.0.self_attn.o_proj"] == ROW and plan["model.layers.0.self_attn.q_proj"] == SKIP


def test_config_section_keys_defaults_and_errors():
    section = TPTrainingConfig()
    assert (section.autotp_size, section.dtype, section.tensor_parallel.tp_size, section.tp_size) == \
        (0, torch.float16, 1, 1)
    parsed = DeepSpeedConfig({"train_batch_size": 2, "tensor_parallel": {"autotp_size": 2, "dtype": "bf16",
                                                                         "tp": {"tp_size": 2}}}, world_size=1)
    assert parsed.tensor_parallel_config.tp_size == 2 and parsed.tensor_parallel_config.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="tp.tp_size"):
        TPTrainingConfig(autotp_size=2, tp={"tp_size": 4})
    with pytest.raises(ValueError, match="autotp_sise"):
        DeepSpeedConfig({"train_batch_size": 2, "tensor_parallel": {"autotp_sise": 2}}, world_size=1)


def _falcon(**kwargs) -> torch.nn.Module:
    from transformers import FalconConfig, FalconForCausalLM

    return FalconForCausalLM(FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                          **kwargs))


def test_falcon_head_major_fused_qkv_is_column_parallel_and_multi_query_is_refused():
    # [Note: head-major fused projections]: the new decoder architecture groups q..q k v per kv head.
    plan = _plan(_falcon(new_decoder_architecture=True, num_kv_heads=2))
    assert plan["transformer.h.0.self_attention.query_key_value"] == COLUMN
    assert plan["transformer.h.0.self_attention.dense"] == ROW
    assert plan["transformer.h.0.mlp.dense_h_to_4h"] == COLUMN and plan["transformer.h.0.mlp.dense_4h_to_h"] == ROW
    assert _plan(_falcon(multi_query=False))["transformer.h.0.self_attention.query_key_value"] == COLUMN
    with pytest.raises(ValueError, match="query_key_value is a fused projection"):
        _plan(_falcon(multi_query=True))   # one k/v head shared by all: cannot be split


def test_alibi_models_are_refused():
    from zerospeed.runtime.tensor_parallel.shard import _check_heads

    with pytest.raises(ValueError, match="ALiBi"):
        _check_heads(_falcon(new_decoder_architecture=True, num_kv_heads=2, alibi=True), 2)
