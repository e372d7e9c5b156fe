"""Compat script: train, save, resume, convert — written once against DeepSpeed's public API.

`main(ds, ctx, cases, steps, load_from=None, resume_steps=0)` runs each case (a dict with
`stage`, `dtype` and optional `offload`, `scheduler`, `clip`, `frozen`) on a tiny MLP:

* without `load_from`: `steps` training steps, `save_checkpoint(ctx.path(name))`, then
  `resume_steps` more steps (what a resumed run must reproduce);
* with `load_from`: a fresh engine (other initial weights), `load_checkpoint(load_from/<name>)`,
  then `resume_steps` steps; and on rank 0 this library's zero_to_fp32 on that checkpoint.

Each case reports per-step loss, global grad norm and lr, and full parameters (after saving or
loading, and at the end).
"""

from __future__ import annotations

import functools

import torch
from seeded_batch import seeded_batch

IN, HIDDEN, OUT, MICRO = 8, 16, 4, 2
PRECISION = {"fp32": {}, "bf16": {"bf16": {"enabled": True}}}


def case_name(case: dict) -> str:
    extra = "-".join(f"{k}" for k in ("offload", "scheduler", "clip", "frozen") if case.get(k))
    return f"stage{case['stage']}-{case['dtype']}" + (f"-{extra}" if extra else "")


def make_model(case: dict, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))
    if case.get("frozen"):
        model[0].bias.requires_grad_(False)
    return model


def config(case: dict, world_size: int) -> dict:
    offload = case.get("offload")
    zero = {"stage": case["stage"]}
    if case["stage"] == 3:
        zero["stage3_param_persistence_threshold"] = 0
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    adam = {"lr": 1e-2, "weight_decay": 0.01, "betas": [0.9, 0.99]}
    if not offload:
        adam["torch_adam"] = True   # DeepSpeed's fused Adam needs a CUDA build; offload uses its CPU Adam
    cfg = {"train_batch_size": MICRO * world_size, "train_micro_batch_size_per_gpu": MICRO,
           "optimizer": {"type": "AdamW", "params": adam}, "zero_optimization": zero,
           **PRECISION[case["dtype"]]}
    if case.get("scheduler"):
        cfg["scheduler"] = {"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 3, "total_num_steps": 10}}
    if case.get("clip"):
        cfg["gradient_clipping"] = case["clip"]
    return cfg


batch = functools.partial(seeded_batch, micro=MICRO, in_features=IN, out_features=OUT)   # (step, rank, world_size)


def full_params(ds, ctx, engine) -> dict:
    params = list(engine.module.named_parameters())
    with ds.zero.GatheredParameters([p for _, p in params]):
        return {name: ctx.values(p) for name, p in params}


def train(ds, ctx, engine, first: int, count: int) -> list[dict]:
    dtype = next(engine.module.parameters()).dtype
    records = []
    for step in range(first, first + count):
        x, y = batch(step, ctx.rank, ctx.world_size)
        loss = torch.nn.functional.mse_loss(engine(x.to(dtype)).float(), y)
        engine.backward(loss)
        engine.step()
        norm = engine.get_global_grad_norm()
        records.append({"loss": loss.item(), "grad_norm": None if norm is None else float(norm),
                        "lr": engine.get_lr()[0]})
    return records


def run_case(ds, ctx, case: dict, steps: int, load_from: str | None, resume_steps: int) -> dict:
    model = make_model(case, seed=0 if load_from is None else 7)
    params = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = ds.initialize(model=model, model_parameters=params, config=config(case, ctx.world_size))
    name = case_name(case)
    result: dict = {"name": name}
    if load_from is None:
        result["steps"] = train(ds, ctx, engine, 0, steps)
        engine.save_checkpoint(ctx.path(name))
        result["files"] = ctx.files(ctx.path(name))
        result["params_saved"] = full_params(ds, ctx, engine)
        if ctx.rank == 0:
            result["zero_to_fp32"] = zero_to_fp32(ctx, ctx.path(name))
    else:
        try:
            path, client = engine.load_checkpoint(f"{load_from}/{name}")
        except Exception as error:  # noqa: BLE001 - reported, so the other cases still run
            return {"name": name, "error": type(error).__name__, "message": str(error)[-500:]}
        result["loaded"] = path is not None
        result["global_steps"] = engine.global_steps
        result["params_saved"] = full_params(ds, ctx, engine)
        if ctx.rank == 0:
            result["zero_to_fp32"] = zero_to_fp32(ctx, f"{load_from}/{name}")
    result["continued"] = train(ds, ctx, engine, steps, resume_steps)
    result["params"] = full_params(ds, ctx, engine)
    return result


def zero_to_fp32(ctx, checkpoint_dir: str) -> dict:
    """This library's converter on a checkpoint: {name: values}, or {"error": type name}."""
    converter = ctx.submodule("utils.zero_to_fp32")
    try:
        state = converter.get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir)
    except Exception as error:  # noqa: BLE001 - the type is the result
        return {"error": type(error).__name__}
    return {name: ctx.values(tensor) for name, tensor in state.items()}


def main(ds, ctx, cases: list[dict], steps: int, load_from: str | None = None, resume_steps: int = 0) -> dict:
    return {case_name(case): run_case(ds, ctx, case, steps, load_from, resume_steps) for case in cases}
