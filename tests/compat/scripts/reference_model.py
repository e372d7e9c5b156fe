"""Compat script: an engine without an optimizer (TRL's frozen reference model) and generation under
ZeRO-3 the way TRL's `unwrap_model_for_generation` does it, written against DeepSpeed's API.

`main(ds, ctx)`, per ZeRO stage (0-3, and 3 with the model built under `zero.Init`):
`initialize(model=ref, config=cfg)` with no optimizer anywhere, eval mode, beside a training engine;
the reference's logits, what `backward` / `step` raise, and `type(engine.optimizer)`. Then at ZeRO-3
greedy `generate` on the policy (with an optimizer) and on the reference (without): once with the
hooks on (a gather per layer per token) and once TRL's way (hooks removed from
`engine.optimizer[.parameter_offload]`, every parameter gathered once, hooks restored); the policy
then trains one more step, which must be unchanged by the detour.
"""

from __future__ import annotations

import torch

VOCAB, SEQ, NEW_TOKENS = 64, 6, 6


def tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         tie_word_embeddings=True, attn_implementation="eager", bos_token_id=0, eos_token_id=1,
                         initializer_range=0.5)  # large weights: tokens that depend on the whole model
    return LlamaForCausalLM(config).float()


def weights(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v.clone() for k, v in tiny_llama().state_dict().items()}


def build(ds, state: dict, zero_init: bool, config: dict) -> torch.nn.Module:
    if not zero_init:
        model = tiny_llama()
        model.load_state_dict(state)
        return model
    with ds.zero.Init(config_dict_or_path=config):
        model = tiny_llama()
    for name, param in model.named_parameters():
        with ds.zero.GatheredParameters([param], modifier_rank=0), torch.no_grad():
            param.copy_(state[name])
    return model


def config(stage: int, optimizer: bool) -> dict:
    block = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}} if optimizer else {}
    return {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {
        "stage": stage, "stage3_param_persistence_threshold": 0}, **block}


def ids(rank: int) -> torch.Tensor:
    return torch.randint(2, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(100 + rank))


def _error(fn) -> list:
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the type and message are the result
        return [type(error).__name__, str(error)]
    return [None, None]


def reference_at(ds, ctx, stage: int, zero_init: bool) -> dict:
    policy, *_ = ds.initialize(model=build(ds, weights(1), zero_init, config(stage, True)), config=config(stage, True))
    init_error = _error(lambda: ds.initialize(model=build(ds, weights(0), zero_init, config(stage, False)),
                                              config=config(stage, False)))
    if init_error[0] is not None:
        return {"init_error": init_error}
    ref, *_ = ds.initialize(model=build(ds, weights(0), zero_init, config(stage, False)), config=config(stage, False))
    ref.eval()
    x = ids(ctx.rank)
    with torch.no_grad():
        logits = ref(input_ids=x).logits
    loss = policy(input_ids=x, labels=x).loss
    policy.backward(loss)
    policy.step()
    ref_loss = ref(input_ids=x, labels=x).loss
    return {"init_error": init_error, "logits": ctx.values(logits), "optimizer": type(ref.optimizer).__name__,
            "backward_error": _error(lambda: ref.backward(ref_loss)), "step_error": _error(ref.step)}


def greedy(model, x) -> torch.Tensor:
    return model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False)


def _offload(engine):
    """Where TRL's remove_hooks / add_hooks find the hooks (trl/models/utils.py)."""
    return engine.optimizer.parameter_offload if hasattr(engine.optimizer, "parameter_offload") else engine.optimizer


def generate_gathered_once(ds, engine, x) -> torch.Tensor:
    """TRL's `_unwrap_model_for_generation` at ZeRO-3, its calls one by one."""
    with ds.zero.GatheredParameters(engine.parameters()):
        offload = _offload(engine)
        for _, param in [*offload.module.named_parameters(recurse=True), *offload.module.ds_external_parameters()]:
            param.ds_active_sub_modules.clear()
        for hook in offload.forward_hooks:
            hook.remove()
        for hook in offload.backward_hooks:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        tokens = greedy(engine.module, x)
        coordinator = offload.param_coordinator
        if not coordinator.is_invalid_trace():
            coordinator._invalidate_trace()
        offload._register_deepspeed_module(offload.module)
    return tokens


def generation(ds, ctx, zero_init: bool) -> dict:
    policy, *_ = ds.initialize(model=build(ds, weights(1), zero_init, config(3, True)), config=config(3, True))
    ref, *_ = ds.initialize(model=build(ds, weights(0), zero_init, config(3, False)), config=config(3, False))
    ref.eval()
    x = ids(ctx.rank)
    out: dict = {"losses": []}
    for name, seed in (("policy", 1), ("ref", 0)):   # the single-process model, for reference
        single = tiny_llama()
        single.load_state_dict(weights(seed))
        with torch.no_grad():
            out[f"{name}_single"] = greedy(single, x).tolist()
    for name, engine in (("policy", policy), ("ref", ref)):
        with torch.no_grad():
            out[f"{name}_hooked"] = greedy(engine.module, x).tolist()
            out[f"{name}_once"] = generate_gathered_once(ds, engine, x).tolist()
            out[f"{name}_logits_after"] = ctx.values(engine(input_ids=x).logits)
    for _ in range(2):
        loss = policy(input_ids=x, labels=x).loss
        policy.backward(loss)
        policy.step()
        out["losses"].append(loss.item())
        with torch.no_grad():
            generate_gathered_once(ds, policy, x)
    return out


def main(ds, ctx) -> dict:
    result = {f"stage{stage}": reference_at(ds, ctx, stage, False) for stage in (0, 1, 2, 3)}
    result["stage3_zero_init"] = reference_at(ds, ctx, 3, True)
    result["generation"] = generation(ds, ctx, True)
    return result
