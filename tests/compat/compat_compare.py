"""Comparisons with tolerances derived from the dtype (used by the compat tests).

fp32: both libraries run the same float32 arithmetic, but may sum in another order (bucketing,
reduce-scatter vs all-reduce) and report the grad norm in float32 (DeepSpeed) or float64
(zerospeed): a few float32 ulps, so rtol 1e-5. bf16: one bf16 rounding of a weight differs by
one ulp (2^-8 relative) and a loss computed from it by about as much, so rtol 2^-7 plus a small
atol for values near zero.
"""

from __future__ import annotations

import math

__all__ = ["TOLERANCES", "assert_close", "assert_close_lists", "assert_steps_match"]

TOLERANCES = {"fp32": (1e-5, 1e-6), "bf16": (2 ** -7, 2 ** -9)}


def assert_close(theirs: float | None, ours: float | None, dtype: str, what: str) -> None:
    if theirs is None or ours is None:
        assert theirs is ours, f"{what}: DeepSpeed {theirs} vs zerospeed {ours}"
        return
    rtol, atol = TOLERANCES[dtype]
    assert math.isclose(theirs, ours, rel_tol=rtol, abs_tol=atol), \
        f"{what}: DeepSpeed {theirs!r} vs zerospeed {ours!r} (rtol {rtol}, atol {atol})"


def assert_close_lists(theirs: list[float], ours: list[float], dtype: str, what: str) -> None:
    assert len(theirs) == len(ours), f"{what}: {len(theirs)} values vs {len(ours)}"
    rtol, atol = TOLERANCES[dtype]
    worst = max(range(len(theirs)), key=lambda i: abs(theirs[i] - ours[i]) - rtol * abs(theirs[i]), default=None)
    if worst is not None:
        assert_close(theirs[worst], ours[worst], dtype, f"{what}[{worst}]")


def assert_steps_match(theirs: list[dict], ours: list[dict], dtype: str, what: str,
                       keys: tuple[str, ...] = ("loss", "grad_norm", "lr")) -> None:
    assert len(theirs) == len(ours), f"{what}: {len(theirs)} steps vs {len(ours)}"
    for step, (a, b) in enumerate(zip(theirs, ours)):
        for key in keys:
            assert_close(a[key], b[key], dtype, f"{what} step {step} {key}")
