"""What the one-engine compat scripts (engine_surface.py, config_keys.py) share: the model, the
config, the seeded engine, each rank's batches, parameter digests and the per-check runner.

Library-neutral like the scripts themselves: `ds` is `deepspeed` or `zerospeed`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

MICRO_BATCH = 2


class Net(torch.nn.Module):
    """Two linear layers with a tanh between them, mean-squared error against `y`."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 8)
        self.b = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.b(torch.tanh(self.a(x))), y)


def config(zero: dict, **extra: Any) -> dict:
    """AdamW at `zero`, no accumulation; `extra` keys override. A fresh dict on every call: DeepSpeed
    pops `torch_adam` out of the optimizer params it is given."""
    return {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
            "zero_optimization": zero, "steps_per_print": 1000, **extra}


def engine(ds: Any, make_model: Callable[[], torch.nn.Module], ds_config: dict) -> Any:
    """`ds.initialize` on the trainable parameters of a model built after seeding torch with 0."""
    torch.manual_seed(0)
    model = make_model()
    built, *_ = ds.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                              config=ds_config)
    return built


def generator(ctx: Any, step: int) -> torch.Generator:
    """The random stream of one rank's batch at `step`: ranks and steps differ, runs repeat."""
    return torch.Generator().manual_seed(100 * step + ctx.rank)


def param_digests(ctx: Any, engine: Any) -> dict[str, str]:
    return {name: ctx.digest(p) for name, p in engine.module.named_parameters()}


def run_checks(checks: list[Callable[[Any, Any], dict]], ds: Any, ctx: Any) -> dict:
    """Every check's result by name; one that raises reports its error instead, so one broken
    check does not hide the others (each raises on all ranks alike, leaving no rank waiting)."""
    result = {}
    for check in checks:
        try:
            result[check.__name__] = check(ds, ctx)
        except Exception as error:  # noqa: BLE001 - reported per check, compared by the test
            result[check.__name__] = {"raised": f"{type(error).__name__}: {str(error)[:300]}"}
    return result
