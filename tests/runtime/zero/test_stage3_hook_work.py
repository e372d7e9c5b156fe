"""Stage 3's per-step hook work (issue 33): each module's backward hooks fire once per step, and
what the hooks and the prefetch build from the model (each module's parameter tuple, the walk
along the trace) is built once and reused by later steps, not rebuilt per call."""

import collections
import os
import sys

import torch
from distributed import run_on_ranks

sys.path.insert(0, os.path.dirname(__file__))
from test_stage3 import GLOBAL_BATCH, _batches, _config, _forward, build_model

import zerospeed

STEPS = 4


def _count_calls(counts, owner, name, label):
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        counts[label] += 1
        return original(*args, **kwargs)

    setattr(owner, name, counted)
    return owner, name, original


def _hook_work_per_step():
    from zerospeed.runtime.zero import parameter_offload
    from zerospeed.runtime.zero import partitioned_param_coordinator as coordinator

    counts = collections.Counter()
    patched = [_count_calls(counts, parameter_offload, "_unique_zero_params", "parameter tuples built"),
               _count_calls(counts, coordinator.TraceWalk, "__init__", "trace walks built"),
               _count_calls(counts, parameter_offload.DeepSpeedZeRoOffload, "pre_backward", "pre-backward"),
               _count_calls(counts, parameter_offload.DeepSpeedZeRoOffload, "post_backward", "post-backward")]
    try:
        world_size, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
        engine, *_ = zerospeed.initialize(model=build_model("gpt"), config=_config(3, 1, world_size, 0.0))
        micro = GLOBAL_BATCH // world_size
        per_step = []
        for tokens in _batches(STEPS):
            counts.clear()
            engine.backward(_forward(engine, tokens[rank * micro:(rank + 1) * micro], "gpt"))
            engine.step()
            per_step.append(dict(counts))
    finally:
        for owner, name, original in patched:
            setattr(owner, name, original)
    modules = list(engine.module.modules())
    called = sum(1 for m in modules if not isinstance(m, torch.nn.ModuleList))   # a ModuleList is never called
    with_params = sum(1 for m in modules if any(True for _ in m.parameters(recurse=False)))
    # the two embeddings' inputs are token ids and positions: no gradient reaches them
    with_grad_inputs = with_params - 2
    return per_step, called, with_params, with_grad_inputs


def test_hooks_fire_once_per_module_and_plans_are_built_once():
    for per_step, num_called, with_params, with_grad_inputs in run_on_ranks(_hook_work_per_step, 2):
        first, second, *later = per_step
        # every hooked module builds its tuple once, at its first call (recording the trace)
        assert first.get("parameter tuples built") == num_called, first
        assert "trace walks built" not in first
        # the trace is complete from the second step on: its walk is built then, once
        assert second.get("trace walks built") == 1, second
        for counts in (second, *later):
            assert counts.get("pre-backward") == with_params, counts
            assert counts.get("post-backward") == with_grad_inputs, counts
            assert "parameter tuples built" not in counts, counts
        for counts in later:
            assert "trace walks built" not in counts, counts
