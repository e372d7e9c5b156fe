"""`engine.compile()` at ZeRO 0-3 on 2 gloo ranks: the same losses as the eager engine (fp32), no
graph break inside a block (one dynamo graph for the whole run: a break or a recompile would add
one), no recompile when the sequence length changes under `dynamic=True`, and no hang when the
ranks see different lengths ([Note: compiled blocks] in runtime/zero/parameter_offload.py).

dynamo's own counters count graphs, compiled frames and breaks; the backend is `aot_eager` (AOT autograd, the part that takes the parameters as graph inputs and saves them for
backward, without inductor's C++ build, which the benchmark exercises).
"""

import torch
from distributed import run_on_ranks
from example_models import load_example

import zerospeed

STEPS = 10
RTOL = 1e-5   # fp32: the compiled and eager graphs may reassociate a few sums


def _gpt(seed: int) -> torch.nn.Module:
    gpt = load_example("gpt")
    torch.manual_seed(seed)
    return gpt.GPT(gpt.GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32))


def _llama(seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)
    config._attn_implementation = "sdpa"
    # Training: with the KV cache on (transformers' default), each layer's first cache update
    # differs from the next one's and dynamo compiles the layer twice, with or without ZeRO.
    config.use_cache = False
    return LlamaForCausalLM(config)


def _lengths(rank: int) -> list[int]:
    """A different length at every step, and a different one on each rank."""
    return [8 + (3 * step + 5 * rank) % 17 for step in range(STEPS)]


def _train(kind: str, stage: int, backend: str | None = None) -> list[float]:
    rank = torch.distributed.get_rank()
    model = _gpt(0) if kind == "gpt" else _llama(0)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": stage}}
    engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    if backend is not None:
        engine.compile(backend=backend, compile_kwargs={"dynamic": True})
    gen = torch.Generator().manual_seed(100 + rank)
    losses = []
    for length in _lengths(rank):
        tokens = torch.randint(0, 64, (2, length + 1), generator=gen)
        inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        if kind == "gpt":
            loss = engine(inputs, targets)
        else:
            loss = engine(input_ids=inputs, labels=targets).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.destroy()
    return losses


def _compiled_vs_eager(kind: str, stages: list[int]) -> dict:
    """Eager and compiled losses at each of `stages`, and dynamo's counts over all of them: the
    stages share one compiled graph where they compile the same code (a fresh model each time)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    losses = {stage: (_train(kind, stage), _train(kind, stage, "aot_eager")) for stage in stages}
    breaks = {reason: n for reason, n in counters["graph_break"].items()}
    # a break adds a graph, a recompile (per length, per block, per stage) a frame and a graph
    return {"losses": losses, "graphs": counters["stats"]["unique_graphs"],
            "frames": counters["frames"]["total"], "breaks": breaks}


def _check(results: list[dict]) -> None:
    for result in results:
        assert result["breaks"] == {}, result["breaks"]
        assert (result["graphs"], result["frames"]) == (1, 1), result
        for stage, (eager, compiled) in result["losses"].items():
            torch.testing.assert_close(compiled, eager, rtol=RTOL, atol=0, msg=f"stage {stage}")


def test_the_blocks_are_the_compiled_units_without_stage_3_too():
    """[Note: why blocks at every stage] in runtime/compiled_regions.py: without a stage-3 offload
    each block is compiled alone as well (its gradients, and their buckets' reductions, are then
    ready while the blocks before it run their backward); the rest of the model stays eager."""
    from zerospeed.runtime.compiled_regions import compile_model

    model = _gpt(0)
    units = compile_model(model, "aot_eager", {})
    assert units == list(model.blocks)
    assert all("forward" in vars(block) for block in units)   # the compiled forward, per instance
    assert model._compiled_call_impl is None                  # the model itself is not compiled whole


def test_compiled_gpt_is_one_graph_at_stages_0_to_2_with_eager_losses():
    """Each block is compiled alone; the ZeRO hooks of stages 1-2 run in backward, untraced."""
    _check(run_on_ranks(_compiled_vs_eager, 2, "gpt", [0, 1, 2], timeout_s=300))


def test_compiled_gpt_blocks_have_no_graph_break_at_stage_3():
    """Each block is compiled alone, its gather/release hooks outside: one graph for both blocks."""
    _check(run_on_ranks(_compiled_vs_eager, 2, "gpt", [3], timeout_s=300))


def test_compiled_llama_blocks_have_no_graph_break_at_stage_3():
    """An HF Llama's decoder layers, compiled alone: one graph for both layers, nothing else."""
    _check(run_on_ranks(_compiled_vs_eager, 2, "llama", [3], timeout_s=300))
