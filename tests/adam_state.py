"""The whole model's Adam state read from a live engine, whatever its layout: for every trainable
parameter its fp32 master and both moments made whole (over the data-parallel group with
DeepSpeed's `safe_get_full_*` accessors, then over the tp group for an AutoTP piece), and the step
count of the optimizer. Resharding tests compare it between a resumed run and the saving run
continued (`compare_adam_states`); a pipeline stage returns its own parameters, the caller unites
the stages (all_gather_object).
"""

from __future__ import annotations

from typing import Any

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")


def adam_state(engine: Any, rename: Any = None) -> dict[str, Any]:
    """{"params": {name: {"fp32", "exp_avg", "exp_avg_sq"}}, "step": int}; collective over the
    engine's dp and tp groups. `rename(name)`: the name to report a parameter under."""
    from zerospeed.runtime.tensor_parallel.state_dict import gather_shards
    from zerospeed.utils.tensor_fragment import safe_get_full_fp32_param, safe_get_full_optimizer_state

    tp = getattr(engine, "tensor_parallel", None)
    params: dict[str, dict[str, torch.Tensor]] = {}
    for name, param in engine.module.named_parameters():
        if not param.requires_grad:
            continue
        values = {"fp32": safe_get_full_fp32_param(param)}
        values.update({key: safe_get_full_optimizer_state(param, key) for key in MOMENTS})
        shard = getattr(param, "ds_tp_shard", None)
        if shard is not None:
            values = {key: gather_shards(value, shard, tp.tp_group) for key, value in values.items()}
        params[name if rename is None else rename(name)] = {k: v.clone() for k, v in values.items()}
    return {"params": params, "step": _step(engine)}


def _step(engine: Any) -> int:
    steps = {int(state["step"]) for state in engine.optimizer.optimizer.state.values() if "step" in state}
    assert len(steps) == 1, f"the optimizer's states disagree on the step count: {steps}"
    return steps.pop()


def compare_adam_states(got: dict[str, Any], expected: dict[str, Any]) -> dict[str, Any]:
    """The largest difference of each kind, relative to the largest element of its tensor (an
    exp_avg_sq is ~grad**2: an absolute bound would not see it), and both step counts."""
    assert got["params"].keys() == expected["params"].keys(), (sorted(got["params"]), sorted(expected["params"]))
    worst = {key: 0.0 for key in ("fp32", *MOMENTS)}
    for name, values in expected["params"].items():
        for key, value in values.items():
            diff = (got["params"][name][key] - value).abs().max().item()
            worst[key] = max(worst[key], diff / max(value.abs().max().item(), 1e-30))
    return {**worst, "step": got["step"], "expected_step": expected["step"]}
