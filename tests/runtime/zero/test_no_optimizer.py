"""An engine without an optimizer ([Note: engine without an optimizer] in runtime/engine.py): TRL's
frozen reference model. `initialize(model=ref, config=cfg)` with no optimizer anywhere, in eval
mode, beside a training engine in the same process, at every ZeRO stage, the model built under
zero.Init or not: its logits equal the single-process model's (fp32), its partitioned parameters
are gathered and released around forward with the gathers an engine with an optimizer issues
(trace, prefetch), and `backward` / `step` refuse."""

import pytest
import torch

import zerospeed
from distributed import run_on_ranks

VOCAB, SEQ = 64, 12


def tiny_llama() -> torch.nn.Module:
    """Tied embeddings on purpose: the LM head reads the embedding's weight (an external parameter)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * SEQ,
                         tie_word_embeddings=True, attn_implementation="eager", initializer_range=0.5)
    return LlamaForCausalLM(config).float()


def reference_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v.clone() for k, v in tiny_llama().state_dict().items()}


def build(weights: dict[str, torch.Tensor], zero_init: bool, config: dict) -> torch.nn.Module:
    """The model with `weights`, partitioned at construction by zero.Init when asked."""
    if not zero_init:
        model = tiny_llama()
        model.load_state_dict(weights)
        return model
    with zerospeed.zero.Init(config_dict_or_path=config):
        model = tiny_llama()
    for name, param in model.named_parameters():
        with zerospeed.zero.GatheredParameters([param], modifier_rank=0), torch.no_grad():
            param.copy_(weights[name])
    return model


def config(stage: int, optimizer: bool) -> dict:
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    block = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}} if optimizer else {}
    return {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero, **block}


def inputs(rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(100 + rank))


def _reference_beside_policy(stage: int, zero_init: bool) -> dict:
    rank = torch.distributed.get_rank()
    weights = reference_weights()
    policy, *_ = zerospeed.initialize(model=build(reference_weights(1), zero_init, config(stage, True)),
                                      config=config(stage, True))
    ref, *_ = zerospeed.initialize(model=build(weights, zero_init, config(stage, False)), config=config(stage, False))
    ref.eval()
    ids = inputs(rank)
    logits = []
    for _ in range(2):   # a policy step between two reference passes, as in DPO / GRPO
        with torch.no_grad():
            logits.append(ref(input_ids=ids).logits)
        loss = policy(input_ids=ids, labels=ids).loss
        policy.backward(loss)
        policy.step()
    with torch.no_grad():
        single = tiny_llama()
        single.load_state_dict(weights)
        expected = single(input_ids=ids).logits
    errors = {}
    for name, call in (("backward", lambda: ref.backward(ref(input_ids=ids, labels=ids).loss)), ("step", ref.step)):
        try:
            call()
        except RuntimeError as error:
            errors[name] = str(error)
    partitioned = [p.numel() == 0 for p in ref.module.parameters()] if stage == 3 else []
    return {"logits": logits, "expected": expected, "errors": errors, "partitioned": partitioned,
            "optimizer": type(ref.optimizer).__name__}


@pytest.mark.parametrize("stage,zero_init", [(0, False), (1, False), (2, False), (3, False), (3, True)])
def test_reference_model_without_optimizer_matches_single_process(stage, zero_init):
    for result in run_on_ranks(_reference_beside_policy, 2, stage, zero_init):
        for logits in result["logits"]:   # fp32, same ops on the same weights: rounding only
            torch.testing.assert_close(logits, result["expected"], rtol=1e-5, atol=1e-5)
        assert set(result["errors"]) == {"backward", "step"}
        assert all("has no optimizer" in m and "'optimizer' block" in m for m in result["errors"].values())
        if stage == 3:   # DeepSpeed's attribute: the hooks object, where TRL's remove_hooks looks
            assert result["optimizer"] == "DeepSpeedZeRoOffload"
            assert result["partitioned"] and all(result["partitioned"])   # released after forward
        else:
            assert result["optimizer"] == "NoneType"


def _gather_records(with_optimizer: bool) -> list[list[tuple]]:
    """The parameter collectives of three eval forwards of one engine: (op, bytes, async)."""
    cfg = {**config(3, with_optimizer), "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                                              "stage3_prefetch_bucket_size": 4000}}
    engine, *_ = zerospeed.initialize(model=build(reference_weights(), True, cfg), config=cfg)
    engine.eval()
    ids = inputs(torch.distributed.get_rank())
    zerospeed.comm.configure(enabled=True, prof_all=True)
    per_forward = []
    try:
        for _ in range(3):
            zerospeed.comm.comms_logger.reset()
            with torch.no_grad():
                engine(input_ids=ids)
            per_forward.append([(r.op, r.msg_bytes, r.async_op) for r in zerospeed.comm.comms_logger.records])
    finally:
        zerospeed.comm.configure(enabled=False)
        zerospeed.comm.comms_logger.reset()
    return per_forward


def _same_gathers() -> tuple:
    return _gather_records(True), _gather_records(False)


def test_no_optimizer_gathers_and_prefetches_as_with_one():
    for with_opt, without in run_on_ranks(_same_gathers, 2):
        assert without == with_opt
        assert any(is_async for _, _, is_async in without[-1]), "forwards after the first prefetch from the trace"


def _saving(tmp_dir: str) -> dict:
    cfg = {**config(3, False), "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}}
    engine, *_ = zerospeed.initialize(model=build(reference_weights(0), True, cfg), config=cfg)
    saved = engine.save_16bit_model(tmp_dir)
    try:
        engine.save_checkpoint(tmp_dir)
        refused = None
    except NotImplementedError as error:
        refused = str(error)
    return {"saved": saved, "refused": refused}


def test_zero3_without_optimizer_saves_16bit_weights_and_refuses_checkpoints(tmp_path):
    import os

    results = run_on_ranks(_saving, 2, str(tmp_path))
    assert all(r["saved"] for r in results)
    assert all("save_checkpoint on a ZeRO-3 engine without an optimizer" in r["refused"] for r in results)
    state = torch.load(os.path.join(tmp_path, "pytorch_model.bin"))
    expected = reference_weights(0)
    for name, tensor in expected.items():
        if name in state:
            assert torch.equal(state[name], tensor), name
    assert "model.embed_tokens.weight" in state
