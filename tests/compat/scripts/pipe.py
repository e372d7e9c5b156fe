"""Compat script: a pipelined MLP trained, saved and resumed, written once against DeepSpeed's API.

`main(ds, ctx, stage, steps, load_from=None, resume_steps=0, num_stages=2, universal=False)`: 2 stages
on 2 ranks, 2 micro-batches per step, `steps` train_batch calls then `save_checkpoint(ctx.path("ckpt"))`;
with `load_from` a fresh engine (`num_stages`; `universal`: `"load_universal": true`) loads that
directory instead and trains `resume_steps` more. Reports
the losses and this stage's parameters by global layer name (also as saved: "saved"); also whether `seed_layers=True`
with partition_method='parameters' raises (DeepSpeed 0.19.8: TypeError on Python >= 3.11).
"""

from __future__ import annotations

import torch

IN, HIDDEN, OUT, MICRO, GAS = 6, 10, 3, 2, 2


def specs(ds):
    from torch import nn

    LayerSpec = ds.pipe.LayerSpec
    return [LayerSpec(nn.Linear, IN, HIDDEN), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, HIDDEN, HIDDEN),
            LayerSpec(nn.Tanh), LayerSpec(nn.Linear, HIDDEN, OUT)]


def loss_fn(outputs, labels):
    return torch.nn.functional.mse_loss(outputs, labels)


def micro_batches(step):
    generator = torch.Generator().manual_seed(500 + step)
    x, y = torch.randn(MICRO * GAS, IN, generator=generator), torch.randn(MICRO * GAS, OUT, generator=generator)
    return iter([(x[k * MICRO:(k + 1) * MICRO], y[k * MICRO:(k + 1) * MICRO]) for k in range(GAS)])


def engine_for(ds, stage, num_stages=2, universal=False):
    module = ds.pipe.PipelineModule(specs(ds), num_stages=num_stages, loss_fn=loss_fn, seed_layers=True, base_seed=42,
                                    partition_method="uniform")
    config = {"train_batch_size": MICRO * GAS, "train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 100,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
              "zero_optimization": {"stage": stage},
              # DeepSpeed 0.19.8 clips a stage-0 pipeline by the norm of stage 0 alone (its
              # clip_grad_norm_ skips params off model-parallel rank 0 = other stages); zerospeed uses
              # every stage. Off here, so the steps compare; the difference is in docs/compatibility.md.
              "gradient_clipping": 0.0, **({"checkpoint": {"load_universal": True}} if universal else {})}
    engine, _, _, _ = ds.initialize(model=module, model_parameters=module.parameters(), config=config)
    return engine


def main(ds, ctx, stage, steps, load_from=None, resume_steps=0, num_stages=2, universal=False):
    ds.init_distributed(dist_backend="gloo")  # PipelineModule needs the backend before initialize
    seed_error = ctx.error_name(ds.pipe.PipelineModule, specs(ds), num_stages=2, loss_fn=loss_fn,
                                seed_layers=True, partition_method="parameters")
    torch.manual_seed(0)
    engine = engine_for(ds, stage, num_stages, universal)
    losses, first_step, saved = [], 0, {}
    if load_from is None:
        for step in range(steps):
            losses.append(float(engine.train_batch(micro_batches(step))))
        engine.save_checkpoint(ctx.path("ckpt"))
        saved = {name: ctx.values(p) for name, p in engine.module.named_parameters()}
        first_step = steps
    else:
        engine.load_checkpoint(load_from)
        first_step = engine.global_steps
    for step in range(first_step, first_step + resume_steps):
        losses.append(float(engine.train_batch(micro_batches(step))))
    params = {name: ctx.values(p) for name, p in engine.module.named_parameters()}
    files = ctx.files(ctx.path("ckpt")) if load_from is None else []
    return {"losses": losses, "params": params, "saved": saved, "seed_error": seed_error, "files": files,
            "global_steps": engine.global_steps}
