"""Compat script: `init_inference` with AutoTP (tp = world size) on tiny HF models, written once
against DeepSpeed's public API (tests/inference/inference_models.py builds the models).

`main(ds, ctx, kinds, checkpoint=False)`: for each kind, the prompt's logits and the greedy
continuation of the engine, or the error `init_inference` raised. With ``checkpoint`` the weights
are first written as safetensors with a DeepSpeed checkpoint description ({"type": "ds_model",
"checkpoints": [...], "version": 1.0}) and the engine loads them into a model whose parameters
are on the meta device (accelerate's init_empty_weights: DeepSpeed loads only into meta tensors).
"""

from __future__ import annotations

import json
import os

import torch

from tests.inference.inference_models import logits_and_tokens, tiny_model


def _description(ctx, kind):
    from safetensors.torch import save_file

    directory = ctx.path(f"ckpt_{kind}")
    if ctx.rank == 0:
        os.makedirs(directory, exist_ok=True)
        # A tied head is saved once, under the embedding's name (safetensors refuses shared tensors).
        model = tiny_model(kind)
        tied = model.lm_head.weight is model.get_input_embeddings().weight
        save_file({k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")},
                  os.path.join(directory, "weights.safetensors"))
    torch.distributed.barrier()
    return {"type": "ds_model", "checkpoints": ["weights.safetensors"], "version": 1.0}, directory


def _run(ds, ctx, kind, checkpoint):
    model, extra = tiny_model(kind), {}
    if checkpoint:
        from accelerate import init_empty_weights

        description, directory = _description(ctx, kind)
        extra = {"checkpoint": description, "base_dir": directory}
        with init_empty_weights():   # parameters on meta (DeepSpeed loads only into meta tensors), buffers real
            model = tiny_model(kind)
    engine = ds.init_inference(model, dtype=torch.float32, tensor_parallel={"tp_size": ctx.world_size}, **extra)
    logits, tokens = logits_and_tokens(engine)
    return {"logits": ctx.values(logits), "tokens": tokens.tolist(), "engine": type(engine).__name__,
            "module": type(engine).__module__.split(".", 1)[1]}


def main(ds, ctx, kinds, checkpoint=False):
    out = {}
    for kind in kinds:
        try:
            out[kind] = _run(ds, ctx, kind, checkpoint)
        except Exception as error:  # noqa: BLE001 - which kinds a library refuses is part of the result
            out[kind] = {"error": f"{type(error).__name__}: {repr(error)[:600]}"}
    ref_logits, ref_tokens = logits_and_tokens(tiny_model(kinds[0]))
    out["reference"] = {"logits": ctx.values(ref_logits), "tokens": ref_tokens.tolist()}
    return json.loads(json.dumps(out))
