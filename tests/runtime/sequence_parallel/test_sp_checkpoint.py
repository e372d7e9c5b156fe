"""Checkpoints of sequence-parallel training (`sequence_parallel_size` 2: ZeRO 1 and 3 at sp 2, ZeRO 1
at sp 2 x dp 2 on 4 ranks): DeepSpeed's file layout for that setup (the ZeRO partitions span every sp x dp rank,
so there is one `zero_pp_rank_{r}` file per rank), a resumed run continues bit for bit (Adam, so
the moments must come back too), and `zero_to_fp32` merges the files into the full weights.

tests/compat/test_sp_checkpoint_compat.py checks the same files against DeepSpeed 0.19.8's.
"""

import os

import pytest
import torch

from distributed import run_on_ranks
from test_engine_sp import MICRO, SEQ, TinyAttentionLM, _batches
from zerospeed import comm

SAVE_AT, STEPS = 2, 4


def _engine(stage, sp_size, seed):
    import zerospeed
    from zerospeed.comm import groups
    from zerospeed.runtime.sequence_parallel.groups_setup import sequence_parallel_topology

    topology = sequence_parallel_topology(comm.get_world_size(), sp_size)
    torch.manual_seed(seed)   # the resumed engine starts from other weights: the load must replace them
    model = TinyAttentionLM(groups.create_axis_group(topology, "sequence").group)
    config = {"train_micro_batch_size_per_gpu": MICRO, "sequence_parallel_size": sp_size,
              "zero_optimization": {"stage": stage}, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
    engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine, topology.get_coord(comm.get_rank())


def _steps(engine, coord, sp_size, steps):
    from zerospeed.sequence.loss import sequence_parallel_cross_entropy

    tokens, labels = _batches(comm.get_world_size() // sp_size)
    rows = slice(coord.data * MICRO, (coord.data + 1) * MICRO)
    cols = slice(coord.sequence * SEQ // sp_size, (coord.sequence + 1) * SEQ // sp_size)
    losses = []
    for step in steps:
        loss = sequence_parallel_cross_entropy(engine(tokens[step % len(tokens), rows, cols]),
                                               labels[step % len(tokens), rows, cols], engine.seq_parallel_group)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _params(engine):
    from zerospeed.zero import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):   # a no-op below ZeRO 3
        return {name: p.detach().clone() for name, p in engine.module.named_parameters()}


def _save_and_resume(stage, sp_size, save_dir):
    from zerospeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    engine, coord = _engine(stage, sp_size, seed=0)
    _steps(engine, coord, sp_size, range(SAVE_AT))
    engine.save_checkpoint(save_dir, tag="t")
    at_save = _params(engine)
    continued = _steps(engine, coord, sp_size, range(SAVE_AT, STEPS))
    resumed, _ = _engine(stage, sp_size, seed=1)
    resumed.load_checkpoint(save_dir, tag="t")
    loaded_steps = resumed.global_steps
    result = {"continued": continued, "resumed": _steps(resumed, coord, sp_size, range(SAVE_AT, STEPS)),
              "params": all(torch.equal(a, b) for a, b in zip(_params(engine).values(), _params(resumed).values())),
              "steps": loaded_steps, "files": sorted(os.listdir(os.path.join(save_dir, "t")))}
    if comm.get_rank() == 0:
        merged = get_fp32_state_dict_from_zero_checkpoint(save_dir, tag="t")
        result["zero_to_fp32"] = sorted(merged) == sorted(at_save) and all(
            torch.equal(merged[name], value) for name, value in at_save.items())
    comm.barrier()
    return result


def _runs(sp_size, stages, save_dir):
    return {stage: _save_and_resume(stage, sp_size, os.path.join(save_dir, f"s{stage}")) for stage in stages}


def _expected_files(stage, world):
    optim = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world)]
    if stage == 3:
        return sorted(optim + [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)])
    return sorted(optim + ["mp_rank_00_model_states.pt"])


@pytest.mark.parametrize("world, stages", [(2, (1, 3)), (4, (1,))])
def test_sp_checkpoint_layout_resume_and_zero_to_fp32(tmp_path, world, stages):
    results = run_on_ranks(_runs, world, 2, stages, str(tmp_path))
    for rank, by_stage in enumerate(results):
        for stage, result in by_stage.items():
            assert result["resumed"] == result["continued"], (rank, stage, result)   # bit for bit
            assert result["params"] and result["steps"] == SAVE_AT, (rank, stage)
            files = [f for f in result["files"] if f.endswith(".pt")]
            assert files == _expected_files(stage, world), (stage, files)
    assert all(results[0][stage]["zero_to_fp32"] for stage in stages)
