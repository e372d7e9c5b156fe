"""`init_inference` with AutoTP: logits equal to the unsharded model (fp32, 1e-5) and identical
greedy tokens at tp 1 and 2 on 2 gloo ranks, for every architecture the rules reach; the
checkpoint loaders (each rank reads its slices); the config's keys, precedence and refusals.

Each rank builds the unsharded model itself (same seed) as the reference, so a run returns only
the largest difference and whether the tokens matched.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.distributed import run_on_ranks
from inference_models import KINDS, logits_and_tokens, tiny_model

TOL = 1e-5


def _parity(kind: str, tp: int) -> dict:
    import zerospeed

    ref_logits, ref_tokens = logits_and_tokens(tiny_model(kind))
    engine = zerospeed.init_inference(tiny_model(kind), dtype=torch.float32, tensor_parallel={"tp_size": tp})
    logits, tokens = logits_and_tokens(engine)
    split = sorted(name for name, p in engine.tp_plan.items() if p.style.value != "skip")
    return {"diff": (logits - ref_logits).abs().max().item(), "tokens": torch.equal(tokens, ref_tokens),
            "mp_world_size": engine.mp_world_size, "split": split,
            "sharded": sum(bool(getattr(p, "tensor_model_parallel", False)) for p in engine.module.parameters())}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_logits_and_greedy_tokens_match_unsharded(kind: str, tp: int) -> None:
    for rank, result in enumerate(run_on_ranks(_parity, 2, kind, tp)):
        assert result["diff"] <= TOL, f"rank {rank}: logits differ by {result['diff']}"
        assert result["tokens"], f"rank {rank}: greedy tokens differ"
        assert result["mp_world_size"] == tp
        if tp == 2:   # the cut really happened: every block's projections, each param marked
            assert len(result["split"]) >= 4 * 2 and result["sharded"] >= len(result["split"]), result
        else:
            assert result["split"] == [] and result["sharded"] == 0


def test_tied_embeddings_stay_replicated_and_tied() -> None:
    results = run_on_ranks(_tied_head, 2)
    assert all(results), results


def _tied_head() -> bool:
    import zerospeed

    engine = zerospeed.init_inference(tiny_model("qwen2"), dtype=torch.float32, tensor_parallel={"tp_size": 2})
    head, embed = engine.module.lm_head, engine.module.model.embed_tokens
    return head.weight is embed.weight and type(head) is torch.nn.Linear and "lm_head" not in {
        n for n, p in engine.tp_plan.items() if p.style.value != "skip"}


# --- checkpoints --------------------------------------------------------------------------------

def _save(kind: str, directory: str, fmt: str) -> None:
    """The model's weights in ``fmt``: a Hugging Face directory, or two files (safetensors or torch)
    and a DeepSpeed checkpoint description naming them."""
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in tiny_model(kind).state_dict().items()}
    if fmt == "hf_dir":
        tiny_model(kind).save_pretrained(directory)
        return
    names = sorted(state)
    halves = [dict((k, state[k]) for k in names[: len(names) // 2]), dict((k, state[k]) for k in names[len(names) // 2:])]
    files = [f"part{i}.safetensors" if fmt == "safetensors" else f"part{i}.pt" for i in range(2)]
    for name, part in zip(files, halves):
        if fmt == "safetensors":
            save_file(part, os.path.join(directory, name))
        else:
            torch.save({"module": part}, os.path.join(directory, name))
    description = {"type": "ds_model", "checkpoints": files, "version": 1.0}
    path = os.path.join(directory, "ds_inference_config.json")
    with open(path, "w") as handle:
        json.dump(description, handle)


def tiny_model_meta(kind: str) -> torch.nn.Module:
    """``tiny_model(kind)`` with its parameters on the meta device and its buffers real (what
    ``accelerate.init_empty_weights()`` builds)."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        return tiny_model(kind)


@pytest.mark.parametrize("kind,fmt", [("llama", "safetensors"), ("qwen2", "hf_dir"), ("gpt_neox", "pt"),
                                      ("gpt2", "safetensors")])
def test_checkpoint_loads_straight_into_shards(tmp_path, kind: str, fmt: str) -> None:
    for rank, result in enumerate(run_on_ranks(_from_checkpoint_meta, 2, kind, str(tmp_path / kind), fmt)):
        assert result["diff"] <= TOL and result["tokens"], f"rank {rank}: {result}"


def _from_checkpoint_meta(kind: str, directory: str, fmt: str) -> dict:
    import zerospeed

    if torch.distributed.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
        _save(kind, directory, fmt)
    torch.distributed.barrier()
    where = directory if fmt == "hf_dir" else os.path.join(directory, "ds_inference_config.json")
    ref_logits, ref_tokens = logits_and_tokens(tiny_model(kind))
    engine = zerospeed.init_inference(tiny_model_meta(kind), dtype=torch.float32, tensor_parallel={"tp_size": 2},
                                      checkpoint=where)
    logits, tokens = logits_and_tokens(engine)
    return {"diff": (logits - ref_logits).abs().max().item(), "tokens": torch.equal(tokens, ref_tokens)}


def test_slice_index_reads_each_fused_part() -> None:
    from zerospeed.inference.checkpoint_loading import slice_index
    from zerospeed.runtime.tensor_parallel.layers import TPShard, shard_of

    full = torch.arange(24 * 4).reshape(24, 4)
    for shard in (TPShard(0, 3, 2, 1), TPShard(1, 1, 2, 0), TPShard(0, 1, 4, 3)):
        pieces = torch.cat([full[i] for i in slice_index(tuple(full.shape), shard)], dim=shard.dim)
        assert torch.equal(pieces, shard_of(full, shard)), shard


def test_checkpoint_errors_name_the_problem(tmp_path) -> None:
    from zerospeed.inference.checkpoint_loading import checkpoint_files

    with pytest.raises(ValueError, match="missing key 'checkpoints'"):
        checkpoint_files({"type": "ds_model", "version": 1.0})
    with pytest.raises(ValueError, match="type 'Megatron' is not supported"):
        checkpoint_files({"type": "Megatron", "checkpoints": ["a.pt"], "version": 1.0})
    with pytest.raises(ValueError, match="nope.safetensors"):
        checkpoint_files({"type": "ds_model", "checkpoints": ["nope.safetensors"]}, str(tmp_path))
    with pytest.raises(ValueError, match="neither model.safetensors.index.json nor model.safetensors"):
        checkpoint_files(str(tmp_path))


# --- config ---------------------------------------------------------------------------------

def test_config_and_kwargs_merge_with_deepspeed_precedence(tmp_path) -> None:
    from zerospeed.inference.config import resolve_inference_config

    path = tmp_path / "inference.json"
    path.write_text(json.dumps({"dtype": "fp32", "tensor_parallel": {"tp_size": 2}, "max_tokens": 77}))
    config = resolve_inference_config(str(path), {"keep_module_on_host": True})
    assert (config.dtype, config.tensor_parallel.tp_size, config.max_out_tokens, config.keep_module_on_host) == (
        torch.float32, 2, 77, True)
    assert resolve_inference_config(None, {}).dtype == torch.float16   # DeepSpeed's default
    assert resolve_inference_config({"mp_size": 2}, {}).tensor_parallel.tp_size == 2
    assert resolve_inference_config(None, {"tp": {"tp_size": 2}}).tensor_parallel.tp_size == 2
    with pytest.raises(ValueError, match="Conflicting argument 'dtype'"):
        resolve_inference_config({"dtype": torch.float32}, {"dtype": torch.float16})
    with pytest.raises(ValueError, match="'mp_size' and its replacement 'tensor_parallel.tp_size'"):
        resolve_inference_config({"mp_size": 2, "tensor_parallel": {"tp_size": 2}}, {})


def test_typos_are_errors_with_did_you_mean() -> None:
    from zerospeed.inference.config import resolve_inference_config
    from zerospeed.runtime.config_utils import ConfigError

    with pytest.raises(ConfigError, match="keep_module_on_hots.*did you mean 'keep_module_on_host'"):
        resolve_inference_config(None, {"keep_module_on_hots": True})
    with pytest.raises(ConfigError, match="tensor_parallel.tp_sise.*did you mean 'tp_size'"):
        resolve_inference_config(None, {"tensor_parallel": {"tp_sise": 2}})
    with pytest.raises(ConfigError, match="unknown dtype"):
        resolve_inference_config(None, {"dtype": "fp64"})


@pytest.mark.parametrize("key,value", [("replace_with_kernel_inject", True), ("kernel_inject", True),
                                       ("enable_cuda_graph", True), ("use_triton", True), ("dtype", torch.int8),
                                       ("dtype", "int8"), ("save_mp_checkpoint_path", "/tmp/x"),
                                       ("training_mp_size", 2)])
def test_kernel_options_are_refused_by_name(key: str, value) -> None:
    import zerospeed

    name = {"kernel_inject": "replace_with_kernel_inject", "dtype": "int8"}.get(key, key)
    with pytest.raises(ValueError, match=name):
        zerospeed.init_inference(torch.nn.Linear(2, 2), **{key: value})


def test_accepted_options_leave_numbers_alone() -> None:
    import zerospeed

    model = tiny_model("llama")
    expected = logits_and_tokens(model)
    engine = zerospeed.init_inference(tiny_model("llama"), dtype="fp32", max_out_tokens=64, min_out_tokens=1,
                                      triangular_masking=True, return_tuple=True, replace_method="auto",
                                      quant={"enabled": False}, keep_module_on_host=True)
    got = logits_and_tokens(engine)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert engine.module is not model and engine.config is engine.module.config and engine.mp_world_size == 1
    with pytest.raises(RuntimeError, match="exceeds maximum length of 3"):
        zerospeed.init_inference(tiny_model("llama"), dtype=torch.float32, max_tokens=3).generate(
            input_ids=torch.ones(1, 5, dtype=torch.long), max_new_tokens=1)


def test_dtype_converts_the_model() -> None:
    import zerospeed

    engine = zerospeed.init_inference(tiny_model("llama"), dtype=torch.bfloat16)
    assert {p.dtype for p in engine.module.parameters()} == {torch.bfloat16}


def _injection_policy() -> dict:
    import zerospeed
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    ref_logits, ref_tokens = logits_and_tokens(tiny_model("llama"))
    engine = zerospeed.init_inference(tiny_model("llama"), dtype=torch.float32, tensor_parallel={"tp_size": 2},
                                      injection_policy={LlamaDecoderLayer: ("self_attn.o_proj", "mlp.down_proj")})
    logits, tokens = logits_and_tokens(engine)
    styles = {name.split(".layers.0.")[-1]: p.style.value for name, p in engine.tp_plan.items() if ".layers.0." in name}
    return {"diff": (logits - ref_logits).abs().max().item(), "tokens": torch.equal(tokens, ref_tokens),
            "styles": styles, "head": engine.tp_plan["lm_head"].style.value}


def test_injection_policy_names_the_row_parallel_layers() -> None:
    for result in run_on_ranks(_injection_policy, 2):
        assert result["diff"] <= TOL and result["tokens"]
        assert result["styles"]["self_attn.o_proj"] == "row" and result["styles"]["mlp.down_proj"] == "row"
        assert result["styles"]["self_attn.q_proj"] == "column" and result["head"] == "skip"


def test_safetensors_slices_equal_safetensors_own_reads(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    from zerospeed.inference.safetensors_slices import SafetensorsSlices

    generator = torch.Generator().manual_seed(3)
    tensors = {"a": torch.randn(6, 8, generator=generator), "b": torch.randn(4, 6, 10).to(torch.bfloat16),
               "c": torch.arange(12, dtype=torch.int64), "s": torch.tensor(2.5)}
    save_file(tensors, str(tmp_path / "t.safetensors"), metadata={"format": "pt"})
    expected = load_file(str(tmp_path / "t.safetensors"))
    with SafetensorsSlices(str(tmp_path / "t.safetensors")) as handle:
        assert sorted(handle.keys()) == sorted(tensors) and handle.shape("b") == (4, 6, 10)
        for key in tensors:
            assert torch.equal(handle.read(key), expected[key]), key
        for key, index in (("a", (slice(2, 5), slice(None))), ("a", (slice(None), slice(4, 8))),
                           ("b", (slice(None), slice(None), slice(3, 7))), ("b", (slice(None), slice(0, 3))),
                           ("c", (slice(6, 12),))):
            assert torch.equal(handle.read(key, index), expected[key][index]), (key, index)
