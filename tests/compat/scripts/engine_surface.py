"""Compat script: the engine's smaller public methods and arguments, the same calls on either library.

Each check returns plain values (numbers, digests of tensors, file lists, exception type names) so
that the test can compare DeepSpeed 0.19.8 and zerospeed key by key. Every check raises or not on
all ranks alike, so a failing call never leaves a rank waiting in a collective.
"""

from __future__ import annotations

import enum
import os

import engine_kit as kit
import torch

STEPS = 3


def _engine(ds, stage: int = 0, model: torch.nn.Module | None = None, **extra):
    warmup = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 10}}
    ds_config = kit.config({"stage": stage}, **{"gradient_accumulation_steps": 2, "scheduler": warmup, **extra})
    return kit.engine(ds, lambda: model or kit.Net(), ds_config)


def _batch(ctx, step: int, rows: int = 2):
    generator = kit.generator(ctx, step)
    return torch.randn(rows, 4, generator=generator), torch.randn(rows, 2, generator=generator)


def _train(engine, ctx, steps: int = STEPS) -> list[float]:
    losses = []
    for step in range(steps * engine.gradient_accumulation_steps()):
        loss = engine(*_batch(ctx, step))
        engine.backward(loss)
        engine.step()
        losses.append(round(loss.item(), 6))
    return losses


def batch_sizes(ds, ctx) -> dict:
    engine = _engine(ds)
    sizes = lambda: [engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),  # noqa: E731
                     engine.gradient_accumulation_steps()]
    out = {"initial": sizes()}
    engine.set_train_batch_size(16)
    out["set_train_batch_size_16"] = sizes()
    out["set_train_batch_size_7"] = ctx.error_name(engine.set_train_batch_size, 7)
    engine.set_train_micro_batch_size(1)
    out["set_train_micro_batch_size_1"] = sizes()
    return out


def accumulation_boundary(ds, ctx) -> dict:
    engine = _engine(ds)
    seen = []
    for step in range(4):  # the client decides the boundary: every second backward is one
        engine.set_gradient_accumulation_boundary(step % 2 == 1)
        seen.append(engine.is_gradient_accumulation_boundary())
        engine.backward(engine(*_batch(ctx, step)))
        engine.step()
    return {"boundaries": seen, "global_steps": engine.global_steps, "params": kit.param_digests(ctx, engine)}


def backward_options(ds, ctx) -> dict:
    out = {}
    for scale in (True, False):
        engine = _engine(ds)
        loss = engine(*_batch(ctx, 0))
        engine.backward(loss, retain_graph=True, scale_wrt_gas=scale)
        out[f"grad_scale_wrt_gas_{scale}"] = ctx.values(engine.module.b.bias.grad)
        engine.backward(loss, scale_wrt_gas=scale)  # the retained graph runs backward a second time
        out[f"grad_twice_scale_wrt_gas_{scale}"] = ctx.values(engine.module.b.bias.grad)
    return out


def step_lr_kwargs(ds, ctx) -> dict:
    engine = _engine(ds, gradient_accumulation_steps=1, train_micro_batch_size_per_gpu=2)
    engine.backward(engine(*_batch(ctx, 0)))
    engine.step(lr_kwargs={"last_batch_iteration": 5})
    return {"lr": [round(lr, 9) for lr in engine.get_lr()]}


def no_sync(ds, ctx) -> dict:
    out = {}
    for stage in (0, 1, 2):
        engine = _engine(ds, stage)
        try:
            with engine.no_sync():
                engine.backward(engine(*_batch(ctx, 0)))
            # this rank's own gradient, unreduced (p.grad itself is gone at stage 1 in zerospeed)
            out[f"stage{stage}"] = ctx.values(ds.utils.safe_get_full_grad(engine.module.b.bias))
        except Exception as error:  # noqa: BLE001 - the type is the result
            out[f"stage{stage}"] = type(error).__name__
            continue
        engine.backward(engine(*_batch(ctx, 1)))  # the boundary: reduces what no_sync accumulated
        engine.step()
        out[f"stage{stage}_after_step"] = kit.param_digests(ctx, engine)
    return out


def data_loader(ds, ctx) -> dict:
    dataset = torch.utils.data.TensorDataset(torch.arange(22.0).view(11, 2))
    out = {}
    for drop_last in (False, True):
        engine = _engine(ds, dataloader_drop_last=drop_last)
        loader = engine.deepspeed_io(dataset)
        batches = [batch[0].tolist() for batch in loader]
        out[f"drop_last_{drop_last}"] = {"len": len(loader), "batches": batches}
    return out


def checkpoint_options(ds, ctx) -> dict:
    root = ctx.path("ckpt")
    engine = _engine(ds)
    _train(engine, ctx)
    engine.save_checkpoint(root, tag="no_latest", save_latest=False)
    engine.save_checkpoint(root, tag="kept")
    out = {"files": ctx.files(root), "trained": kit.param_digests(ctx, engine), "lr": engine.get_lr()}
    for name, kwargs in {"module_only": {"load_module_only": True},
                         "no_optimizer": {"load_optimizer_states": False},
                         "no_scheduler": {"load_lr_scheduler_states": False},
                         "full": {}}.items():
        fresh = _engine(ds)
        _train(fresh, ctx, steps=1)  # some state of its own, to see what a load replaces
        path, _ = fresh.load_checkpoint(root, tag="kept", **kwargs)
        out[name] = {"path": os.path.basename(str(path)), "params": kit.param_digests(ctx, fresh), "lr": fresh.get_lr(),
                     "global_steps": fresh.global_steps, "then": _train(fresh, ctx, steps=1)}
    calls = []
    custom = _engine(ds)
    custom.load_checkpoint(root, tag="kept", custom_load_fn=lambda src, dst: calls.append(sorted(src)))
    out["custom_load_fn"] = {"calls": calls, "params": kit.param_digests(ctx, custom)}
    return out


class Extended(kit.Net):
    def __init__(self) -> None:
        super().__init__()
        self.extra = torch.nn.Linear(2, 2)


def load_strictness(ds, ctx) -> dict:
    root = ctx.path("strict")
    engine = _engine(ds)
    _train(engine, ctx, steps=1)
    engine.save_checkpoint(root, tag="t")
    out = {}
    for strict in (True, False):
        bigger = _engine(ds, model=Extended())
        try:
            bigger.load_checkpoint(root, tag="t", load_module_strict=strict, load_optimizer_states=False)
            out[f"strict_{strict}"] = ctx.digest(bigger.module.a.weight)
        except Exception as error:  # noqa: BLE001 - the type is the result
            out[f"strict_{strict}"] = type(error).__name__
    return out


def frozen_and_16bit(ds, ctx) -> dict:
    root = ctx.path("frozen")
    model = kit.Net()
    model.a.requires_grad_(False)
    engine = _engine(ds, model=model)
    _train(engine, ctx, steps=1)
    engine.save_checkpoint(root, tag="t", exclude_frozen_parameters=True)
    engine.save_fp16_model(ctx.path("fp16_model"), "model.bin")
    torch.distributed.barrier()  # rank 0 writes it; neither library waits for the others after
    module_file = os.path.join(root, "t", "mp_rank_00_model_states.pt")
    module_keys = sorted(torch.load(module_file, map_location="cpu", weights_only=False)["module"])
    saved = torch.load(ctx.path("fp16_model", "model.bin"), map_location="cpu", weights_only=False)
    return {"module_keys": module_keys, "fp16_model": {k: ctx.digest(v) for k, v in sorted(saved.items())},
            "params": kit.param_digests(ctx, engine)}


def _all_reduces_during(fn, *args, **kwargs) -> int:
    """How many torch.distributed.all_reduce calls `fn` makes (both libraries' comm layers end there)."""
    calls = []
    all_reduce = torch.distributed.all_reduce

    def counting(*a, **k):
        calls.append(1)
        return all_reduce(*a, **k)

    torch.distributed.all_reduce = counting
    try:
        fn(*args, **kwargs)
    finally:
        torch.distributed.all_reduce = all_reduce
    return len(calls)


def tag_validation(ds, ctx) -> dict:
    """Per checkpoint.tag_validation mode: the torch.distributed all-reduces of one save under one
    tag, and what a save under a tag that differs between ranks raises. Not under "Ignore", which
    compares nothing: zerospeed's ranks would then wait for each other's directories."""
    out = {}
    for mode in ("Ignore", "Warn", "Fail"):
        engine = _engine(ds, checkpoint={"tag_validation": mode})
        all_reduces = _all_reduces_during(engine.save_checkpoint, ctx.path(f"tags_{mode}"), tag="same")
        mismatch = None if mode == "Ignore" else ctx.error_name(engine.save_checkpoint, ctx.path(f"tags_{mode}"),
                                                                 tag=f"rank{ctx.rank}")
        out[mode] = {"all_reduces": all_reduces, "mismatch": mismatch}
    return out


def bf16_overflow_check(ds, ctx) -> dict:
    """`bf16.check_grad_overflow`: an infinite loss skips the step when set, poisons it when not."""
    out = {}
    for check in (True, False):
        engine = _engine(ds, 1, bf16={"enabled": True, "check_grad_overflow": check},
                         gradient_accumulation_steps=1)
        x, y = _batch(ctx, 0)
        loss = engine(x.bfloat16(), y.bfloat16()) * float("inf")
        engine.backward(loss)
        engine.step()
        out[f"check_{check}"] = {"finite": all(bool(torch.isfinite(p.float()).all())
                                               for p in engine.module.parameters()),
                                 "skipped_steps": engine.skipped_steps, "global_steps": engine.global_steps}
    return out


def model_persistence(ds, ctx) -> dict:
    """`stage3_model_persistence_threshold` caps the total size of the parameters kept whole."""
    out = {}
    for cap in (10**9, 20, 0):
        zero = {"stage": 3, "stage3_param_persistence_threshold": 100, "stage3_model_persistence_threshold": cap}
        engine = _engine(ds, 3, zero_optimization=zero)
        out[f"cap_{cap}"] = sorted(n for n, p in engine.module.named_parameters() if getattr(p, "ds_persist", False))
    return out


# DeepSpeed's one-line config getters (zerospeed/runtime/engine_accessors.py), read on two configs.
ACCESSORS = [
    "zero_allgather_bucket_size", "zero_allgather_partitions", "zero_allgather_sequential", "zero_compute_grad_norm",
    "zero_contiguous_gradients", "zero_elastic_checkpoint", "zero_hpz_partition_size", "zero_ignore_unused_parameters",
    "zero_legacy_stage1", "zero_load_from_fp32_weights", "zero_log_trace_cache_warnings", "zero_max_live_parameters",
    "zero_max_reuse_distance", "zero_model_persistence_threshold", "zero_module_granularity_threshold",
    "zero_multi_rank_bucket_allreduce", "zero_offload_optimizer", "zero_offload_param", "zero_overlap_comm",
    "zero_param_persistence_threshold", "zero_parameter_alignment", "zero_prefetch_bucket_size",
    "zero_quantized_gradients", "zero_quantized_nontrainable_weights", "zero_quantized_weights",
    "zero_reduce_bucket_size", "zero_reduce_scatter", "zero_round_robin_gradients",
    "zero_save_muon_momentum_buffer_in_memory", "zero_sub_group_size", "zenflow_config", "is_sanity_checks_enabled",
    "zero_cpu_offload", "zero_use_cpu_optimizer", "zero_partial_offload", "super_offload", "cpuadam_cores_perc",
    "zero_nvme_offload_optimizer", "zero_force_ds_cpu_optimizer", "zero_optimization", "zero_optimization_stage",
    "zero_optimization_partition_gradients", "zero_optimization_partition_weights", "zero_allow_untested_optimizer",
    "optimizer_name", "optimizer_params", "optimizer_legacy_fusion", "scheduler_name", "scheduler_params",
    "initial_dynamic_scale", "dynamic_loss_scale_args", "fp16_master_weights_and_gradients",
    "bf16_master_weights_and_gradients", "bf16_optimizer_states", "dump_state", "managed_gradient_accumulation",
    "checkpoint_tag_validation_enabled", "checkpoint_tag_validation_fail", "checkpoint_serialization_enabled",
    "checkpoint_writer_enabled", "load_universal_checkpoint", "use_node_local_storage",
    "flops_profiler_enabled", "flops_profiler_profile_step", "flops_profiler_module_depth",
    "flops_profiler_top_modules", "flops_profiler_detailed", "flops_profiler_output_file",
    "flops_profiler_recompute_fwd_factor",
]


def _plain(value):
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return type(value).__name__


def config_accessors(ds, ctx) -> dict:
    """Each accessor's value under the defaults (stage 0) and under non-default keys (stage 3)."""
    zero = {"stage": 3, "reduce_bucket_size": 1234, "allgather_bucket_size": 4322, "overlap_comm": False,
            "contiguous_gradients": False, "sub_group_size": 1000, "stage3_max_live_parameters": 10**6,
            "stage3_max_reuse_distance": 10**5, "stage3_prefetch_bucket_size": 500,
            "stage3_param_persistence_threshold": 7, "stage3_model_persistence_threshold": 99,
            "stage3_allgather_sequential": True, "load_from_fp32_weights": False, "ignore_unused_parameters": False,
            "log_trace_cache_warnings": True, "use_multi_rank_bucket_allreduce": False}
    custom = {"zero_optimization": zero, "zero_force_ds_cpu_optimizer": False,
              "checkpoint": {"tag_validation": "fail", "use_node_local_storage": True},
              "fp16": {"enabled": False, "initial_scale_power": 10},
              "flops_profiler": {"enabled": False, "profile_step": 3, "module_depth": 2, "top_modules": 4,
                                 "detailed": False, "output_file": "flops.txt"}}
    out = {}
    for name, engine in (("defaults", _engine(ds)), ("custom", _engine(ds, 3, **custom))):
        out[name] = {}
        for accessor in ACCESSORS:
            method = getattr(type(engine), accessor, None)
            out[name][accessor] = _plain(method(engine)) if callable(method) else "missing"
    return out


def client_optimizer_name(ds, ctx) -> dict:
    """optimizer_name() with the client's `optimizer=`: an instance, a function that builds one (alone and
    beside a config optimizer); and the config's alone."""
    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-2)

    out = {}
    for name, client, in_config in (("instance", "instance", False), ("callable", adamw, False),
                                    ("callable_and_config", adamw, True), ("config", None, True)):
        torch.manual_seed(0)
        model = kit.Net()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2) if client == "instance" else client
        ds_config = kit.config({"stage": 0})
        if not in_config:
            del ds_config["optimizer"]
        engine, *_ = ds.initialize(model=model, model_parameters=model.parameters(), optimizer=optimizer,
                                   config=ds_config)
        out[name] = engine.optimizer_name()
    return out


CHECKS = [batch_sizes, accumulation_boundary, backward_options, step_lr_kwargs, no_sync, data_loader,
          checkpoint_options, load_strictness, frozen_and_16bit, tag_validation, bf16_overflow_check,
          model_persistence, config_accessors, client_optimizer_name]


def main(ds, ctx) -> dict:
    return kit.run_checks(CHECKS, ds, ctx)
