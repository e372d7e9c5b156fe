"""Generation under ZeRO-3, gathered once, and the full-weight stream (zero/weight_stream.py).

TRL's `unwrap_model_for_generation` at ZeRO-3 (its own `remove_hooks` / `add_hooks`, imported from
trl, around `GatheredParameters(model.parameters())`) on the policy (with an optimizer) and a frozen
reference (without): greedy tokens equal the single-process model's, and the parameter gathers
are the one at the context's entry, none per token (counted with the comms logger), where the
hooked `generate` gathers every layer for every token. `iter_full_weights` yields every parameter
whole (names, shapes, values of the single-process model) and never holds more than one bucket
gathered."""

import pytest
import torch

import zerospeed
from distributed import run_on_ranks
from test_no_optimizer import build, config, reference_weights, tiny_llama

NEW_TOKENS = 5
GATHERS = ("all_gather_in_place", "all_gather_into_tensor")


def greedy(model, x):
    return model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False)


def _gathers() -> int:
    return sum(r.op in GATHERS for r in zerospeed.comm.comms_logger.records)


def _generate_both_ways(engine, x) -> dict:
    from trl.models.utils import add_hooks, remove_hooks

    zerospeed.comm.comms_logger.reset()
    with torch.no_grad():
        hooked = greedy(engine.module, x)
    hooked_gathers = _gathers()
    zerospeed.comm.comms_logger.reset()
    with zerospeed.zero.GatheredParameters(engine.parameters()):
        remove_hooks(engine)
        entry_gathers = _gathers()
        with torch.no_grad():
            once = greedy(engine.module, x)
        add_hooks(engine)
    return {"hooked": hooked, "once": once, "hooked_gathers": hooked_gathers, "entry_gathers": entry_gathers,
            "generate_gathers": _gathers() - entry_gathers}


def _generation() -> dict:
    x = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(7 + torch.distributed.get_rank()))
    policy, *_ = zerospeed.initialize(model=build(reference_weights(1), True, config(3, True)), config=config(3, True))
    ref, *_ = zerospeed.initialize(model=build(reference_weights(0), True, config(3, False)), config=config(3, False))
    ref.eval()
    zerospeed.comm.configure(enabled=True, prof_all=True)
    try:
        out = {"policy": _generate_both_ways(policy, x), "ref": _generate_both_ways(ref, x)}
    finally:
        zerospeed.comm.configure(enabled=False)
    loss = policy(input_ids=x, labels=x).loss   # training goes on after the detour
    policy.backward(loss)
    policy.step()
    for name, seed in (("policy", 1), ("ref", 0)):
        single = tiny_llama()
        single.load_state_dict(reference_weights(seed))
        with torch.no_grad():
            out[name]["single"] = greedy(single, x)
    return out


def test_trl_generation_gathers_once_and_equals_single_process():
    for result in run_on_ranks(_generation, 2):
        for name in ("policy", "ref"):
            r = result[name]
            assert torch.equal(r["once"], r["single"]) and torch.equal(r["hooked"], r["single"]), name
            assert r["entry_gathers"] == 1 and r["generate_gathers"] == 0, name   # one collective, fp32
            # the naive way: every layer's parameters for every token (2 layers, 5 tokens)
            assert r["hooked_gathers"] >= 2 * NEW_TOKENS, name
        assert not torch.equal(result["policy"]["single"], result["ref"]["single"])


@pytest.mark.parametrize("sizes,budget,expected", [
    ([4, 4, 4], 8, [range(0, 2), range(2, 3)]),
    ([10, 1, 1], 4, [range(0, 1), range(1, 3)]),   # larger than the budget: a bucket of its own
    ([1, 10, 1], 4, [range(0, 1), range(1, 2), range(2, 3)]),
    ([], 4, []),
])
def test_plan_weight_buckets(sizes, budget, expected):
    from zerospeed.runtime.zero.weight_stream import plan_weight_buckets

    assert plan_weight_buckets(sizes, budget) == expected


def test_plan_weight_buckets_refuses_a_non_positive_budget():
    from zerospeed.runtime.zero.weight_stream import plan_weight_buckets

    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_weight_buckets([1], 0)


def _gathered_bytes(module) -> int:
    """Bytes of parameter data this rank holds whole beyond the persistent ones: what the stream adds."""
    return sum(p.numel() * p.element_size() for p in module.parameters()
               if p.numel() > 0 and not p.ds_persist)


def _stream(stage: int, bucket_bytes: int) -> dict:
    cfg = {**config(stage, True), "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 40}}
    engine, *_ = zerospeed.initialize(model=build(reference_weights(0), stage == 3, cfg), config=cfg)
    zerospeed.comm.configure(enabled=True, prof_all=True)
    zerospeed.comm.comms_logger.reset()
    streamed, peak = [], 0
    for name, tensor in engine.iter_full_weights(bucket_bytes=bucket_bytes):
        streamed.append((name, tensor.clone()))
        peak = max(peak, _gathered_bytes(engine.module) if stage == 3 else 0)
        del tensor
    zerospeed.comm.configure(enabled=False)
    largest = max(p.ds_numel if stage == 3 else p.numel() for p in engine.module.parameters()) * 4
    partitioned = stage != 3 or all(p.numel() == 0 or p.ds_persist for p in engine.module.parameters())
    return {"streamed": streamed, "peak": peak, "largest": largest, "gathers": _gathers(),
            "partitioned_after": partitioned}


@pytest.mark.parametrize("stage,bucket_bytes", [(3, 20_000), (3, 10**9), (1, 20_000)])
def test_iter_full_weights_streams_the_single_process_weights_within_the_budget(stage, bucket_bytes):
    expected = reference_weights(0)
    model = tiny_llama()
    names = [n for n, _ in model.named_parameters()]
    from zerospeed.runtime.zero.weight_stream import plan_weight_buckets

    sizes = [p.numel() * 4 for _, p in model.named_parameters()]
    num_buckets = len(plan_weight_buckets(sizes, bucket_bytes))
    for result in run_on_ranks(_stream, 2, stage, bucket_bytes):
        assert [n for n, _ in result["streamed"]] == names
        for name, tensor in result["streamed"]:
            assert torch.equal(tensor, expected[name]), name
        assert result["peak"] <= max(bucket_bytes, result["largest"])
        assert result["partitioned_after"]
        if stage == 3:   # one gather per bucket (fp32: one dtype); the small model fits one bucket of 1 GB
            assert result["gathers"] == num_buckets and (num_buckets > 3 or bucket_bytes == 10**9)
            assert result["peak"] > 0
        else:
            assert result["gathers"] == 0
