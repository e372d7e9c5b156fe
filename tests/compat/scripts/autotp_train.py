"""Compat script: a tiny HF Llama trained with AutoTP (tensor_parallel.autotp_size = world size),
written once against DeepSpeed's public API.

`main(ds, ctx, steps, stage, load_from=None, adam=False)`: `tp_model_init` + `initialize` at ZeRO `stage`, `steps`
clipped SGD steps (SGD: the clip factor shows in the parameters; `adam`: AdamW, whose moments a universal folder holds;
`universal`: `load_from` is read through `"load_universal": true`; at world size 1 the model is not cut), then the full weights
(`_consolidated_16bit_state_dict`), `save_checkpoint` and the checkpoint's file names. Also
reports which error, if any, AutoTP on GPT-2 raises at `initialize`. With `load_from` ({impl:
checkpoint dir}) it loads that checkpoint instead and reports the full weights it then holds.
`then`: steps taken after the save (or the load), on the batches that follow; their losses and the
full weights after them are reported (`then_losses`, `then_full`), so a loaded run can be compared
with the saving run continued.
"""

from __future__ import annotations

import torch

SEQ, MICRO, LR, CLIP = 8, 2, 0.2, 0.5


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * SEQ,
                                        tie_word_embeddings=False))


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=2 * SEQ, n_embd=32, n_layer=1, n_head=4))


def _config(stage, tp, adam=False):
    optimizer = {"type": "AdamW", "params": {"lr": 1e-2}} if adam else {"type": "SGD", "params": {"lr": LR}}
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
            "optimizer": optimizer, "zero_allow_untested_optimizer": True,
            "gradient_clipping": CLIP,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "tensor_parallel": {"autotp_size": tp}}


def _full(engine, tp):
    return engine._consolidated_16bit_state_dict() if tp > 1 else engine.module.state_dict()


def _train(engine, generator, steps):
    losses, norms = [], []
    for _ in range(steps):
        ids = torch.randint(0, 64, (MICRO, SEQ), generator=generator)   # tp peers: the same batch
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(float(engine.get_global_grad_norm()))
    return losses, norms


def _then(ctx, engine, generator, tp, then):
    if not then:
        return {}
    losses = _train(engine, generator, then)[0]
    return {"then_losses": losses, "then_full": {name: ctx.values(v) for name, v in (_full(engine, tp) or {}).items()}}


def main(ds, ctx, steps, stage, load_from=None, adam=False, universal=False, then=0):
    tp = ctx.world_size
    model = ds.tp_model_init(_llama(), tp_size=tp, dtype=torch.float32) if tp > 1 else _llama()
    config = {**_config(stage, tp, adam), **({"checkpoint": {"load_universal": True}} if universal else {})}
    engine, _, _, _ = ds.initialize(model=model, config=config)
    generator = torch.Generator().manual_seed(7)
    if load_from is not None:   # the other library's checkpoint ({impl: dir}); universal: latest_universal
        engine.load_checkpoint(load_from[ctx.impl], tag=None if universal else "t")
        loaded = _full(engine, tp)
        for _ in range(engine.global_steps):   # the batches the saving run already took
            torch.randint(0, 64, (MICRO, SEQ), generator=generator)
        return {"loaded": {name: ctx.values(value) for name, value in (loaded or {}).items()},
                "global_steps": engine.global_steps, **_then(ctx, engine, generator, tp, then)}
    losses, norms = _train(engine, generator, steps)
    full = {name: ctx.values(value) for name, value in (engine._consolidated_16bit_state_dict() or {}).items()}
    engine.save_checkpoint(ctx.path("ckpt"), tag="t")
    return {"losses": losses, "norms": norms, **_then(ctx, engine, generator, tp, then), "full": full,
            "files": [f for f in ctx.files(ctx.path("ckpt", "t")) if f.endswith(".pt")],
            "gpt2_error": ctx.error_name(lambda: ds.initialize(model=ds.tp_model_init(_gpt2(), tp, torch.float32),
                                                               config=_config(stage, tp)))}
