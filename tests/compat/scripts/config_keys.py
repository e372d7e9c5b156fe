"""Compat script: ds_config keys the runtime reads, each set both ways on either library.

`fp16.auto_cast`, `zero_optimization.load_from_fp32_weights`, `allgather_partitions`,
`allgather_bucket_size` and `stage3_allgather_sequential`: every check returns plain values
(dtype names, losses, digests of tensors) so that the test can compare DeepSpeed 0.19.8 and
zerospeed key by key, and the settings of one key with each other.

DeepSpeed refuses fp16 on a CPU without mkldnn fp16 support ("Type fp16 is not supported on your
device", a device check at `initialize`); the fp16 checks lift that one check so that the rest of
DeepSpeed's fp16 path runs as it would on a device that has it.
"""

from __future__ import annotations

import engine_kit as kit
import torch

STEPS = 2


class Probe(kit.Net):
    """Records the dtypes forward receives; casts to its own dtype so that every setting runs."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[dict[str, str]] = []

    def forward(self, x: torch.Tensor, index: torch.Tensor, y: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        self.seen.append({"x": str(x.dtype), "index": str(index.dtype), "y": str(y.dtype),
                          "kwarg_scale": str(scale.dtype)})
        dtype = self.a.weight.dtype
        out = self.b(torch.tanh(self.a(x.to(dtype)))) * scale.to(dtype)
        return torch.nn.functional.mse_loss(out, y.to(dtype)[index])


def _engine(ds, zero: dict, **extra):
    return kit.engine(ds, Probe, kit.config(zero, **extra))


def _batch(ctx, step: int):
    generator = kit.generator(ctx, step)
    x, y = torch.randn(2, 4, generator=generator), torch.randn(2, 2, generator=generator)
    return (x, torch.tensor([1, 0]), y), {"scale": torch.full((2, 2), 0.5)}


def _train(engine, ctx, steps: int = STEPS, first: int = 0, cast=None) -> list[float]:
    losses = []
    for step in range(first, first + steps):
        args, kwargs = _batch(ctx, step)
        if cast is not None:
            args = (args[0].to(cast), args[1], args[2].to(cast))
        loss = engine(*args, **kwargs)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _allow_fp16_on_cpu(ds) -> None:
    if ds.__name__ == "deepspeed":
        from deepspeed.accelerator import get_accelerator

        get_accelerator().is_fp16_supported = lambda: True


def fp16_auto_cast(ds, ctx) -> dict:
    """What forward receives under each (fp16.enabled, fp16.auto_cast), and the losses of two steps."""
    _allow_fp16_on_cpu(ds)
    out = {}
    for enabled, auto_cast in ((True, True), (True, False), (False, True), (False, False)):
        fp16 = {"enabled": enabled, "auto_cast": auto_cast, "initial_scale_power": 8}
        engine = _engine(ds, {"stage": 1}, fp16=fp16)
        losses = _train(engine, ctx)
        out[f"enabled_{enabled}_auto_cast_{auto_cast}"] = {
            "seen": engine.module.seen[0], "weight_dtype": str(engine.module.a.weight.dtype), "losses": losses,
            "loss_dtype": str(engine(*_batch(ctx, 9)[0], **_batch(ctx, 9)[1]).dtype)}
    return out


def fp32_weights_on_load(ds, ctx) -> dict:
    """`load_from_fp32_weights`: the fp32 masters after a load come from the checkpoint's fp32
    partitions (true) or from the bf16 module weights (false). After training the masters are not
    bf16 numbers, so the two settings must give different masters and different next steps."""
    out = {}
    for stage in (1, 2):
        root = ctx.path(f"fp32_weights_stage{stage}")
        engine = _engine(ds, {"stage": stage}, bf16={"enabled": True})
        _train(engine, ctx, steps=3, cast=torch.bfloat16)
        saved = {n: ds.utils.safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()}
        engine.save_checkpoint(root, tag="t")
        for from_fp32 in (True, False):
            fresh = _engine(ds, {"stage": stage, "load_from_fp32_weights": from_fp32}, bf16={"enabled": True})
            fresh.load_checkpoint(root, tag="t")
            masters = {n: ds.utils.safe_get_full_fp32_param(p) for n, p in fresh.module.named_parameters()}
            out[f"stage{stage}_from_fp32_{from_fp32}"] = {
                "masters": {n: ctx.digest(m) for n, m in masters.items()},
                "masters_equal_saved_masters": all(torch.equal(masters[n], saved[n]) for n in saved),
                "masters_equal_bf16_weights": all(torch.equal(m, p.float()) for (n, m), p in
                                                  zip(masters.items(), fresh.module.parameters())),
                "then_losses": _train(fresh, ctx, steps=1, first=5, cast=torch.bfloat16),
                "then_params": kit.param_digests(ctx, fresh)}
    return out


def allgather_knobs(ds, ctx) -> dict:
    """Keys that choose how updated partitions are gathered, never what they hold: each setting's
    parameters after training, at stages 1, 2 (allgather_partitions, allgather_bucket_size) and 3
    (stage3_allgather_sequential)."""
    settings = {"default": {}, "allgather_partitions_false": {"allgather_partitions": False},
                "allgather_bucket_size_8": {"allgather_bucket_size": 8}}
    out = {}
    for stage in (1, 2):
        for name, keys in settings.items():
            engine = _engine(ds, {"stage": stage, **keys})
            out[f"stage{stage}_{name}"] = {"losses": _train(engine, ctx), "params": kit.param_digests(ctx, engine)}
    for sequential in (False, True):
        zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_allgather_sequential": sequential}
        engine = _engine(ds, zero)
        losses = _train(engine, ctx)
        params = {n: ctx.digest(ds.utils.safe_get_full_fp32_param(p)) for n, p in engine.module.named_parameters()}
        out[f"stage3_allgather_sequential_{sequential}"] = {"losses": losses, "params": params}
    return out


CHECKS = [fp16_auto_cast, fp32_weights_on_load, allgather_knobs]


def main(ds, ctx) -> dict:
    return kit.run_checks(CHECKS, ds, ctx)
