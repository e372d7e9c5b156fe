"""DeepSpeed's per-batch LR schedulers: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest.

All five count batches, not epochs: `step()` advances ``last_batch_iteration`` by one (or sets it)
and writes ``lr`` into every param group; the state is ``{'last_batch_iteration': int}``. A
scalar parameter applies to every group, a list gives one value per group. They work on
anything with ``param_groups``: a torch optimizer or a ZeRO wrapper exposing them.

Formulas (``it`` = last_batch_iteration, ``N`` = warmup steps, clamped to >= 2; DeepSpeed's
`deepspeed/runtime/lr_schedules.py::WarmupLR.get_lr`, `WarmupDecayLR`, `WarmupCosineLR.get_lr`, `OneCycle`, `LRRangeTest`):

* warmup ramp ``w(it)`` = ``log(it+1)/log(N)`` ("log") or ``it/N`` ("linear") for ``it < N``, else 1;
* WarmupLR: ``lr = min + (max - min) * w(it)``;
* WarmupDecayLR: after warmup ``lr = min + (max - min) * max(0, (T - it) / max(1, T - N))``;
* WarmupCosineLR: ``lr = lr0 * r`` with ``r = wmin + (1 - wmin) * w(it)`` in warmup, then
  ``p = min(1, (it - N + 1) / max(1, T - N))``, ``r = max(0, cmin + (1 - cmin) * (1 + cos(pi p)) / 2)``;
* OneCycle: triangle min -> max over ``s1`` steps and back over ``s2`` (momentum moves the other
  way, written to ``betas[0]``), then ``lr = min / (1 + decay_lr_rate * k / decay_step_size)``;
* LRRangeTest: ``lr = min * (1 + rate * (it + 1) / step_size)`` (the quotient floored if staircase).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from zerospeed.runtime.config_utils import suggest_key
from zerospeed.utils.logging import logger

__all__ = [
    "VALID_LR_SCHEDULES",
    "LRRangeTest",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "build_lr_scheduler",
]

WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"


def _per_group(optimizer: Any, value: Any, name: str) -> list[Any]:
    """A scalar broadcast to every param group, or a list that must have one entry per group."""
    num_groups = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != num_groups:
            raise ValueError(f"expected {num_groups} values for {name} (one per param group), got {len(value)}")
        return list(value)
    return [value] * num_groups


def _check_warmup(warmup_num_steps: Any, warmup_type: str) -> tuple[int, str]:
    if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
        raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps!r}")
    if warmup_type not in (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE):
        logger.warning(f"Using unknown warmup_type: {warmup_type}. The increasing function is set to default (log)")
        warmup_type = WARMUP_LOG_RATE
    return max(2, warmup_num_steps), warmup_type


def _warmup_ramp(iteration: int, warmup_num_steps: int, warmup_type: str) -> float:
    """The 0 -> 1 warmup curve; 1.0 once warmup is over."""
    if iteration >= warmup_num_steps:
        return 1.0
    if warmup_type == WARMUP_LOG_RATE:
        return math.log(iteration + 1) / math.log(warmup_num_steps)
    return iteration / warmup_num_steps


class _BatchScheduler:
    """Shared plumbing: batch counter, step, last lr, state dict."""

    def __init__(self, optimizer: Any, last_batch_iteration: int) -> None:
        if not hasattr(optimizer, "param_groups"):
            raise TypeError(f"{type(self).__name__} needs an optimizer with param_groups, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] | None = None

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def _after_lr_update(self) -> None:
        """Hook for schedules that also move momentum."""

    def _apply(self, lrs: list[float]) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def step(self, last_batch_iteration: int | None = None) -> None:
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._apply(self.get_lr())
        self._after_lr_update()

    def get_last_lr(self) -> list[float]:
        assert self._last_lr is not None, "need to call step() first"
        return self._last_lr

    def state_dict(self) -> dict[str, int]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.last_batch_iteration = state_dict["last_batch_iteration"]


class WarmupLR(_BatchScheduler):
    """Warm each group from warmup_min_lr to warmup_max_lr over warmup_num_steps, then hold."""

    def __init__(self, optimizer: Any, warmup_min_lr: float | list[float] = 0.0,
                 warmup_max_lr: float | list[float] | None = None, warmup_num_steps: int = 1000,
                 warmup_type: str = WARMUP_LOG_RATE, last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.warmup_num_steps, self.warmup_type = _check_warmup(warmup_num_steps, warmup_type)
        if warmup_max_lr is None:  # DeepSpeed: the first group's current lr, for every group
            warmup_max_lr = optimizer.param_groups[0]["lr"]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.delta_lrs = [high - low for high, low in zip(self.max_lrs, self.min_lrs)]
        if last_batch_iteration == -1:
            self._apply(self.get_lr())

    def _gamma(self) -> float:
        return _warmup_ramp(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [low + delta * gamma for low, delta in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at total_num_steps."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_lr: float | list[float] = 0.0,
                 warmup_max_lr: float | list[float] = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = WARMUP_LOG_RATE, last_batch_iteration: int = -1) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        if total_num_steps < self.warmup_num_steps:
            logger.warning(f"total_num_steps {total_num_steps} is less than warmup_num_steps {warmup_num_steps}")

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return super()._gamma()
        remaining = self.total_num_steps - self.last_batch_iteration
        return max(0.0, remaining / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_BatchScheduler):
    """A ratio of each group's original lr: warm up to 1, then cosine down to cos_min_ratio."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001,
                 warmup_type: str = WARMUP_LOG_RATE, last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.warmup_num_steps, self.warmup_type = _check_warmup(warmup_num_steps, warmup_type)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        if total_num_steps < self.warmup_num_steps:
            logger.warning(f"total_num_steps {total_num_steps} is less than warmup_num_steps {warmup_num_steps}")
        self.org_lrs = [group["lr"] for group in optimizer.param_groups]
        if last_batch_iteration == -1:
            self._apply(self.get_lr())

    def get_lr_ratio(self) -> float:
        it = self.last_batch_iteration
        if it < 0:
            return 0.0
        if it < self.warmup_num_steps:
            ramp = _warmup_ramp(it, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * ramp
        progress = min(1.0, (it - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        ratio = self.get_lr_ratio()
        return [lr0 * ratio for lr0 in self.org_lrs]


class OneCycle(_BatchScheduler):
    """1Cycle (Smith, 2018): a min -> max -> min lr triangle with inverse momentum, then decay."""

    def __init__(self, optimizer: Any, cycle_min_lr: float | list[float], cycle_max_lr: float | list[float],
                 decay_lr_rate: float = 0.0, cycle_first_step_size: int = 2000,
                 cycle_second_step_size: int | None = None, cycle_first_stair_count: int = 0,
                 cycle_second_stair_count: int | None = None, decay_step_size: int = 0,
                 cycle_momentum: bool = True, cycle_min_mom: float = 0.8, cycle_max_mom: float = 0.9,
                 decay_mom_rate: float = 0.0, last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.first_step_size = float(cycle_first_step_size)
        self.second_step_size = float(cycle_first_step_size if cycle_second_step_size is None else cycle_second_step_size)
        if self.first_step_size <= 0 or self.second_step_size <= 0:
            raise ValueError("cycle_first_step_size and cycle_second_step_size must be > 0")
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        self.decay_step_size = decay_step_size
        self.decay_lr_rate, self.decay_mom_rate = decay_lr_rate, decay_mom_rate
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.cycle_momentum = cycle_momentum and self._has_betas(optimizer)
        self.min_moms = [(m, 0.99) for m in _per_group(optimizer, cycle_min_mom, "cycle_min_mom")]
        self.max_moms = [(m, 0.99) for m in _per_group(optimizer, cycle_max_mom, "cycle_max_mom")]
        if last_batch_iteration == -1:
            self._apply(self.min_lrs)
            if self.cycle_momentum:
                self._set_momentum(self.min_moms)

    @staticmethod
    def _has_betas(optimizer: Any) -> bool:
        defaults = getattr(optimizer, "defaults", None)
        has = "betas" in defaults if isinstance(defaults, dict) else "betas" in optimizer.param_groups[0]
        if not has:
            logger.warning(f"cycle_momentum is disabled because optimizer {type(optimizer).__name__} "
                           "does not support momentum, no betas attribute in defaults")
        return has

    def _scale_factor(self) -> float:
        """0 at the cycle's ends, 1 at its peak (stair-quantised when a stair count is set)."""
        batch = self.last_batch_iteration + 1
        x = batch / self.total_size - math.floor(batch / self.total_size)
        rising = x <= self.step_ratio
        scale = x / self.step_ratio if rising else (x - 1) / (self.step_ratio - 1)
        stairs = self.first_stair_count if rising else self.second_stair_count
        if stairs > 0:  # quantise from the integer offset: float scale can sit 1e-16 under a stair
            offset = batch % self.total_size
            if offset <= self.first_step_size:
                position = offset * stairs / self.first_step_size
            else:
                position = (self.total_size - offset) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def _decay_iteration(self) -> int | None:
        """Batches into the post-cycle decay phase, or None while cycling."""
        if self.last_batch_iteration < self.total_size:
            return None
        return int(self.last_batch_iteration - self.total_size + 1)

    def get_lr(self) -> list[float]:
        k = self._decay_iteration()
        if k is None:
            scale = self._scale_factor()
            return [low + (high - low) * scale for low, high in zip(self.min_lrs, self.max_lrs)]
        if math.isclose(self.decay_step_size, 0) or math.isclose(self.decay_lr_rate, 0):
            return list(self.min_lrs)
        return [low / (1 + self.decay_lr_rate * k / self.decay_step_size) for low in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]] | None:
        if not self.cycle_momentum:
            return None
        k = self._decay_iteration()
        if k is None:
            scale = self._scale_factor()
            return [(high[0] - (high[0] - low[0]) * scale, low[1]) for low, high in zip(self.min_moms, self.max_moms)]
        if math.isclose(self.decay_step_size, 0) or math.isclose(self.decay_mom_rate, 0):
            return list(self.max_moms)
        return [(beta0 * (1 + self.decay_mom_rate * k / self.decay_step_size), beta1) for beta0, beta1 in self.max_moms]

    def _set_momentum(self, momentums: list[tuple[float, float]]) -> None:
        for group, betas in zip(self.optimizer.param_groups, momentums, strict=True):
            group["betas"] = betas

    def _after_lr_update(self) -> None:
        momentums = self.get_mom()
        if momentums is not None:
            self._set_momentum(momentums)


class LRRangeTest(_BatchScheduler):
    """Grow the lr from lr_range_test_min_lr, linearly or in stairs, to find a good range."""

    def __init__(self, optimizer: Any, lr_range_test_min_lr: float | list[float] = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        if lr_range_test_step_size <= 0:
            raise ValueError(f"lr_range_test_step_size must be > 0, got {lr_range_test_step_size}")
        self.min_lrs = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        if last_batch_iteration == -1:
            self._apply(self.min_lrs)

    def get_lr(self) -> list[float]:
        interval = (self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [low * (1 + self.step_rate * interval) for low in self.min_lrs]


_SCHEDULE_CLASSES = {cls.__name__: cls for cls in (LRRangeTest, OneCycle, WarmupLR, WarmupDecayLR, WarmupCosineLR)}
# DeepSpeed's: a list of the names (accelerate tests `type(obj).__name__ in VALID_LR_SCHEDULES`).
VALID_LR_SCHEDULES = list(_SCHEDULE_CLASSES)


def _torch_optimizer(optimizer: Any) -> Any:
    """torch schedulers need the real torch optimizer: unwrap `.optimizer` chains of wrappers."""
    while not isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def build_lr_scheduler(name: str, params: dict[str, Any] | None, optimizer: Any) -> Any:
    """The ds_config ``scheduler`` block: a name here first, then in torch.optim.lr_scheduler."""
    params = dict(params or {})
    if name in _SCHEDULE_CLASSES:
        cls, target = _SCHEDULE_CLASSES[name], optimizer
    elif isinstance(getattr(torch.optim.lr_scheduler, name, None), type):
        cls, target = getattr(torch.optim.lr_scheduler, name), _torch_optimizer(optimizer)
    else:
        torch_names = [n for n in dir(torch.optim.lr_scheduler) if n[:1].isupper()]
        hint = suggest_key(name, [*VALID_LR_SCHEDULES, *torch_names])
        raise ValueError(f"scheduler.type: {name} is not a valid LR scheduler{hint}")
    try:
        return cls(target, **params)
    except TypeError as exc:
        raise ValueError(f"scheduler.params for {name}: {exc}") from exc
