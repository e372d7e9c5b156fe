"""Each scheduler's lr sequence against its formula (written out here) and a few explicit numbers."""

from __future__ import annotations

import math

import pytest
import torch

from zerospeed.runtime.config import DEEPSPEED_SCHEDULERS
from zerospeed.runtime.lr_schedules import (
    VALID_LR_SCHEDULES,
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_lr_scheduler,
)


def _adam(lr: float = 0.1, groups: int = 1) -> torch.optim.Optimizer:
    return torch.optim.Adam([{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(groups)], lr=lr)


def _lrs_after_each_step(scheduler, steps: int, group: int = 0) -> list[float]:
    out = []
    for _ in range(steps):
        scheduler.step()
        out.append(scheduler.optimizer.param_groups[group]["lr"])
    return out


def _ramp(it: int, n: int, kind: str) -> float:
    return math.log(it + 1) / math.log(n) if kind == "log" else it / n


# ------------------------------------------------------------------------------------------ WarmupLR


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr_formula(kind):
    low, high, n = 0.01, 0.1, 10
    scheduler = WarmupLR(_adam(), warmup_min_lr=low, warmup_max_lr=high, warmup_num_steps=n, warmup_type=kind)
    assert scheduler.optimizer.param_groups[0]["lr"] == low  # set at construction
    expected = [low + (high - low) * (_ramp(it, n, kind) if it < n else 1.0) for it in range(25)]
    assert _lrs_after_each_step(scheduler, 25) == pytest.approx(expected, rel=1e-12)


def test_warmup_lr_numbers():
    log = WarmupLR(_adam(), warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=4)
    assert _lrs_after_each_step(log, 6) == pytest.approx([0.0, 0.05, 0.0792481250, 0.1, 0.1, 0.1])
    linear = WarmupLR(_adam(), warmup_max_lr=0.1, warmup_num_steps=4, warmup_type="linear")
    assert _lrs_after_each_step(linear, 5) == pytest.approx([0.0, 0.025, 0.05, 0.075, 0.1])


def test_warmup_lr_defaults_and_edge_cases():
    scheduler = WarmupLR(_adam(lr=0.3), warmup_num_steps=1)  # max defaults to the optimizer lr; N clamped to 2
    assert scheduler.warmup_num_steps == 2 and scheduler.max_lrs == [0.3] and scheduler.min_lrs == [0.0]
    assert _lrs_after_each_step(scheduler, 3) == pytest.approx([0.0, 0.3, 0.3])  # log(2)/log(2) = 1 at it=1
    assert WarmupLR(_adam(), warmup_type="cosine").warmup_type == "log"
    with pytest.raises(ValueError, match="warmup_num_steps must be a positive integer"):
        WarmupLR(_adam(), warmup_num_steps=0)


def test_per_group_lists_and_scalar_broadcast():
    scheduler = WarmupLR(_adam(groups=2), warmup_min_lr=0.0, warmup_max_lr=[0.1, 0.2], warmup_num_steps=2,
                         warmup_type="linear")
    scheduler.step()
    scheduler.step()
    assert scheduler.get_last_lr() == pytest.approx([0.05, 0.1])
    assert [g["lr"] for g in scheduler.optimizer.param_groups] == pytest.approx([0.05, 0.1])
    with pytest.raises(ValueError, match="expected 2 values for warmup_max_lr"):
        WarmupLR(_adam(groups=2), warmup_max_lr=[0.1, 0.2, 0.3])


# ------------------------------------------------------------------------------------------ WarmupDecayLR


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_decay_lr_formula(kind):
    low, high, n, total = 0.0, 0.1, 5, 20
    scheduler = WarmupDecayLR(_adam(), total_num_steps=total, warmup_min_lr=low, warmup_max_lr=high,
                              warmup_num_steps=n, warmup_type=kind)

    def gamma(it: int) -> float:
        return _ramp(it, n, kind) if it < n else max(0.0, (total - it) / max(1.0, total - n))

    expected = [low + (high - low) * gamma(it) for it in range(30)]
    assert _lrs_after_each_step(scheduler, 30) == pytest.approx(expected, rel=1e-12)


def test_warmup_decay_lr_numbers():
    scheduler = WarmupDecayLR(_adam(), total_num_steps=10, warmup_max_lr=0.1, warmup_num_steps=4, warmup_type="linear")
    lrs = _lrs_after_each_step(scheduler, 13)
    assert lrs[4] == pytest.approx(0.1) and lrs[7] == pytest.approx(0.05)
    assert lrs[10] == 0.0 and lrs[12] == 0.0


# ------------------------------------------------------------------------------------------ WarmupCosineLR


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_cosine_lr_formula(kind):
    lr0, n, total, wmin, cmin = 0.2, 5, 25, 0.1, 0.01
    scheduler = WarmupCosineLR(_adam(lr=lr0), total_num_steps=total, warmup_min_ratio=wmin, warmup_num_steps=n,
                               cos_min_ratio=cmin, warmup_type=kind)
    assert scheduler.optimizer.param_groups[0]["lr"] == 0.0  # it = -1

    def ratio(it: int) -> float:
        if it < n:
            return wmin + (1 - wmin) * _ramp(it, n, kind)
        progress = min(1.0, (it - n + 1) / max(1, total - n))
        return max(0.0, cmin + (1 - cmin) * (1 + math.cos(math.pi * progress)) / 2)

    expected = [lr0 * ratio(it) for it in range(35)]
    assert _lrs_after_each_step(scheduler, 35) == pytest.approx(expected, rel=1e-12)


def test_warmup_cosine_lr_numbers():
    scheduler = WarmupCosineLR(_adam(lr=0.1), total_num_steps=10, warmup_num_steps=4, warmup_type="linear")
    lrs = _lrs_after_each_step(scheduler, 12)
    assert lrs[:4] == pytest.approx([0.0, 0.025, 0.05, 0.075])
    assert lrs[4] == pytest.approx(0.1 * (0.0001 + 0.9999 * (1 + math.cos(math.pi / 6)) / 2))
    assert lrs[9] == pytest.approx(1e-5) and lrs[11] == pytest.approx(1e-5)  # stays at the floor


# ------------------------------------------------------------------------------------------ OneCycle


def test_one_cycle_numbers_and_momentum():
    scheduler = OneCycle(_adam(), cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=4,
                         decay_lr_rate=0.5, decay_step_size=2)
    group = scheduler.optimizer.param_groups[0]
    assert group["lr"] == 0.01 and group["betas"] == (0.8, 0.99)
    lrs, moms = [], []
    for _ in range(12):
        scheduler.step()
        lrs.append(group["lr"])
        moms.append(group["betas"][0])
    assert lrs == pytest.approx([0.0325, 0.055, 0.0775, 0.1, 0.0775, 0.055, 0.0325, 0.01,
                                 0.01 / 1.25, 0.01 / 1.5, 0.01 / 1.75, 0.01 / 2.0])
    assert moms == pytest.approx([0.875, 0.85, 0.825, 0.8, 0.825, 0.85, 0.875, 0.9, 0.9, 0.9, 0.9, 0.9])
    assert group["betas"][1] == 0.99


def test_one_cycle_formula_asymmetric():
    low, high, s1, s2 = 0.001, 0.01, 6, 3
    scheduler = OneCycle(_adam(), cycle_min_lr=low, cycle_max_lr=high, cycle_first_step_size=s1,
                         cycle_second_step_size=s2)

    def lr(it: int) -> float:
        if it >= s1 + s2:
            return low  # no decay configured
        batch = it + 1
        x = batch / (s1 + s2) - math.floor(batch / (s1 + s2))
        ratio = s1 / (s1 + s2)
        scale = x / ratio if x <= ratio else (x - 1) / (ratio - 1)
        return low + (high - low) * scale

    assert _lrs_after_each_step(scheduler, 14) == pytest.approx([lr(it) for it in range(14)], rel=1e-12)


def test_one_cycle_stairs():
    scheduler = OneCycle(_adam(), cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=4,
                         cycle_first_stair_count=2)
    assert _lrs_after_each_step(scheduler, 7) == pytest.approx([0.01, 0.055, 0.055, 0.1, 0.055, 0.055, 0.01])


def test_one_cycle_without_betas_keeps_momentum_off():
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1, momentum=0.9)
    scheduler = OneCycle(sgd, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=2)
    scheduler.step()
    assert not scheduler.cycle_momentum and "betas" not in sgd.param_groups[0]
    assert scheduler.get_mom() is None


# ------------------------------------------------------------------------------------------ LRRangeTest


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test_formula(staircase):
    low, size, rate = 0.002, 3, 0.5
    scheduler = LRRangeTest(_adam(), lr_range_test_min_lr=low, lr_range_test_step_size=size,
                            lr_range_test_step_rate=rate, lr_range_test_staircase=staircase)
    assert scheduler.optimizer.param_groups[0]["lr"] == low

    def lr(it: int) -> float:
        interval = (it + 1) / size
        return low * (1 + rate * (math.floor(interval) if staircase else interval))

    assert _lrs_after_each_step(scheduler, 10) == pytest.approx([lr(it) for it in range(10)], rel=1e-12)


def test_lr_range_test_numbers():
    continuous = LRRangeTest(_adam(), lr_range_test_min_lr=0.01, lr_range_test_step_size=2)
    assert _lrs_after_each_step(continuous, 3) == pytest.approx([0.015, 0.02, 0.025])
    stairs = LRRangeTest(_adam(), lr_range_test_min_lr=0.01, lr_range_test_step_size=2, lr_range_test_staircase=True)
    assert _lrs_after_each_step(stairs, 4) == pytest.approx([0.01, 0.02, 0.02, 0.03])


# ------------------------------------------------------------------------------------------ shared behaviour


FACTORIES = {
    "WarmupLR": lambda opt: WarmupLR(opt, warmup_max_lr=0.1, warmup_num_steps=5),
    "WarmupDecayLR": lambda opt: WarmupDecayLR(opt, total_num_steps=12, warmup_num_steps=5),
    "WarmupCosineLR": lambda opt: WarmupCosineLR(opt, total_num_steps=12, warmup_num_steps=5),
    "OneCycle": lambda opt: OneCycle(opt, 0.01, 0.1, cycle_first_step_size=3, decay_lr_rate=0.1, decay_step_size=1),
    "LRRangeTest": lambda opt: LRRangeTest(opt, lr_range_test_step_size=3),
}


@pytest.mark.parametrize("name", list(FACTORIES))
def test_state_dict_round_trip(name):
    reference = FACTORIES[name](_adam())
    _lrs_after_each_step(reference, 7)
    state = reference.state_dict()
    assert state == {"last_batch_iteration": 6}
    resumed = FACTORIES[name](_adam())
    resumed.load_state_dict(state)
    assert _lrs_after_each_step(resumed, 8) == pytest.approx(_lrs_after_each_step(reference, 8), rel=1e-12)


@pytest.mark.parametrize("name", list(FACTORIES))
def test_step_with_explicit_iteration(name):
    jumped, walked = FACTORIES[name](_adam()), FACTORIES[name](_adam())
    jumped.step(last_batch_iteration=9)
    _lrs_after_each_step(walked, 10)
    assert jumped.last_batch_iteration == 9
    assert jumped.get_last_lr() == pytest.approx(walked.get_last_lr(), rel=1e-12)


class _Wrapper:
    """A ZeRO-style wrapper: exposes the inner optimizer's param_groups."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups


def test_build_lr_scheduler():
    inner = _adam()
    ours = build_lr_scheduler("WarmupLR", {"warmup_max_lr": 0.05, "warmup_num_steps": 2}, _Wrapper(inner))
    assert isinstance(ours, WarmupLR)
    ours.step()
    ours.step()
    assert inner.param_groups[0]["lr"] == pytest.approx(0.05)
    theirs = build_lr_scheduler("StepLR", {"step_size": 1, "gamma": 0.5}, _Wrapper(inner))
    assert isinstance(theirs, torch.optim.lr_scheduler.StepLR)
    with pytest.raises(ValueError, match="did you mean 'OneCycle'"):
        build_lr_scheduler("OneCycel", {}, inner)
    with pytest.raises(ValueError, match="scheduler.params for WarmupLR"):
        build_lr_scheduler("WarmupLR", {"warmup_steps": 3}, inner)


def test_config_and_module_agree_on_names():
    assert set(DEEPSPEED_SCHEDULERS) == set(VALID_LR_SCHEDULES)
