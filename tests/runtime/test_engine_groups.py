"""The run's frozen groups (`runtime/engine_groups.build_run_groups`) on 2 gloo ranks: for each layout
every field holds the ranks the layout says (found by communicating over the group, not by asking
the registry), and DeepSpeed's accessors read the published value."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from distributed import run_on_ranks

from zerospeed import comm
from zerospeed.comm import groups
from zerospeed.comm.layout import parallel_layout_for_run
from zerospeed.comm.run_groups import RunGroups
from zerospeed.utils import groups as ds_groups


def _members(axis) -> list[int] | None:
    if axis is None:
        return None
    flags = torch.zeros(comm.get_world_size())
    flags[comm.get_rank()] = 1.0
    comm.all_reduce(flags, group=axis.group)
    members = [r for r in range(len(flags)) if flags[r] == 1.0]
    assert members == list(axis.ranks), (members, axis.ranks)
    return members


class _Moe(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from zerospeed.moe.layer import MoE

        self.wide = MoE(4, torch.nn.Linear(4, 4), num_experts=2, ep_size=2)
        self.narrow = MoE(4, torch.nn.Linear(4, 4), num_experts=2, ep_size=1)


def _pipeline() -> torch.nn.Module:
    from zerospeed.runtime.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec

    specs = [TiedLayerSpec("embed", torch.nn.Linear, 4, 4), LayerSpec(torch.nn.Linear, 4, 4),
             TiedLayerSpec("embed", torch.nn.Linear, 4, 4)]
    return PipelineModule(specs, num_stages=2, partition_method="uniform")


def _fields(case: str) -> dict:
    from zerospeed.runtime.engine_groups import build_run_groups

    groups.reset()
    raw: dict = {}
    model: torch.nn.Module = torch.nn.Linear(2, 2)
    mpu, pipe_stages, tensor, expert = None, 1, 1, ()
    if case == "sequence":
        raw = {"sequence_parallel_size": 2}
    elif case == "tensor":
        tensor = 2
    elif case == "experts":
        model, expert = _Moe(), (2, 1)
    elif case == "pipe":
        model = _pipeline()
        mpu, pipe_stages = model.mpu(), 2  # type: ignore[operator]
    layout = parallel_layout_for_run(raw, 2, pipe_stages=pipe_stages, tensor_size=tensor, moe_expert_sizes=expert)
    run = build_run_groups(layout, model, mpu)
    result: dict[str, Any] = {f.name: _members(getattr(run, f.name)) for f in dataclasses.fields(RunGroups)
              if f.name not in ("layout", "experts", "tied")}
    result["experts"] = {name: (_members(e.expert_parallel), _members(e.expert_data_parallel))
                         for name, e in run.experts.items()}
    result["tied"] = {key: _members(axis) for key, axis in run.tied.items()}
    result["layout"] = run.layout == layout
    result["accessors_read_the_value"] = (
        ds_groups.get_data_parallel_group() is run.data_parallel.group
        and groups.get_run_groups() is run
        and all(ds_groups._get_expert_parallel_group(n) is e.expert_parallel.group
                and ds_groups._get_expert_data_parallel_group(n) is e.expert_data_parallel.group
                for n, e in run.experts.items())
        and (run.tensor_parallel is None or ds_groups.get_tensor_model_parallel_group() is run.tensor_parallel.group)
        and (run.sequence_parallel is None
             or ds_groups._get_sequence_parallel_group() is run.sequence_parallel.group))
    groups.reset()
    return result


def test_every_field_for_each_layout_on_two_ranks():
    both, none = [0, 1], None
    seen: set[str] = set()
    for case in ("data", "sequence", "tensor", "experts", "pipe"):
        results = run_on_ranks(_fields, 2, case)
        for rank, got in enumerate(results):
            me = [rank]
            expected = {"data_parallel": both, "sequence_data_parallel": both, "sequence_parallel": none,
                        "tensor_parallel": none, "pipe_parallel": none, "pipe_model_parallel": none,
                        "experts": {}, "tied": {}, "layout": True, "accessors_read_the_value": True}
            if case == "sequence":
                expected.update(data_parallel=me, sequence_parallel=both)
            elif case == "tensor":
                expected.update(data_parallel=me, sequence_data_parallel=me, tensor_parallel=both)
            elif case == "experts":
                expected.update(experts={"ep_size_2": (both, me), "ep_size_1": (me, both)})
            elif case == "pipe":
                expected.update(data_parallel=me, sequence_data_parallel=me, pipe_parallel=both,
                                pipe_model_parallel=both, tied={"embed": both})
            assert got == expected, (case, rank)
            seen |= {name for name, value in got.items() if value not in (None, {})}
    # every field of the value was filled by one of the layouts above: a new field needs its case here
    assert seen >= {f.name for f in dataclasses.fields(RunGroups)}
