"""`sequence_parallel_size` in the ds_config: DeepSpeed's rank layout, and training with Ulysses
attention at ZeRO 0-3 equals full-sequence training in one process (losses, gradient norm and
parameters, fp32, SGD so that a gradient off by the sp size shows), on sp 2 and on sp 2 x dp 2."""

import functools

import pytest
import torch
import torch.nn.functional as F

from distributed import run_on_ranks
from ulysses_lm import UlyssesLM
from zerospeed import comm

VOCAB, HIDDEN, HEADS, SEQ, MICRO, STEPS, LR = 16, 8, 2, 8, 2, 3, 0.5


TinyAttentionLM = functools.partial(UlyssesLM, VOCAB, HIDDEN, HEADS)   # (sp_group=None): Ulysses given one


def _batches(dp_size):
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (STEPS, dp_size * MICRO, SEQ), generator=gen)
    labels = torch.cat([tokens[..., 1:], torch.full((STEPS, dp_size * MICRO, 1), -100)], dim=-1)
    labels[..., :2] = -100  # uneven valid tokens per slice: a "prompt" only the first slice holds
    return tokens, labels


def _reference(dp_size):
    torch.manual_seed(0)
    model = TinyAttentionLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    tokens, labels = _batches(dp_size)
    losses, norms = [], []
    for step in range(STEPS):
        per_sample = []
        for d in range(dp_size):  # the engine averages over data-parallel replicas
            rows = slice(d * MICRO, (d + 1) * MICRO)
            logits = model(tokens[step, rows])
            per_sample.append(F.cross_entropy(logits.reshape(-1, VOCAB), labels[step, rows].reshape(-1)))
        loss = torch.stack(per_sample).mean()
        optimizer.zero_grad()
        loss.backward()
        norms.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm().item())
        optimizer.step()
        losses.append(loss.item())
    return losses, norms, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _train(stage, sp_size):
    import zerospeed
    from zerospeed.comm import groups
    from zerospeed.sequence.loss import sequence_parallel_cross_entropy

    world = comm.get_world_size()
    dp_size = world // sp_size
    config = {"train_micro_batch_size_per_gpu": MICRO, "sequence_parallel_size": sp_size,
              "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "SGD", "params": {"lr": LR}}}
    torch.manual_seed(0)
    from zerospeed.runtime.sequence_parallel.groups_setup import sequence_parallel_topology

    topology = sequence_parallel_topology(world, sp_size)
    coord = topology.get_coord(comm.get_rank())
    # The model needs the group before the engine exists: build it from the same topology.
    model_group = groups.create_axis_group(topology, "sequence").group
    model = TinyAttentionLM(model_group)
    engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    tokens, labels = _batches(dp_size)
    rows = slice(coord.data * MICRO, (coord.data + 1) * MICRO)
    cols = slice(coord.sequence * SEQ // sp_size, (coord.sequence + 1) * SEQ // sp_size)
    losses, norms = [], []
    for step in range(STEPS):
        logits = engine(tokens[step, rows, cols])
        loss = sequence_parallel_cross_entropy(logits, labels[step, rows, cols], engine.seq_parallel_group)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(float(engine.get_global_grad_norm()))
    if stage == 3:
        from zerospeed.zero import GatheredParameters

        with GatheredParameters(list(engine.module.parameters())):
            params = torch.cat([p.detach().reshape(-1).clone() for p in engine.module.parameters()])
    else:
        params = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
    layout = {"sp": list(groups.get_group(groups.SEQUENCE_PARALLEL).ranks),
              "dp": list(groups.get_group(groups.DATA_PARALLEL).ranks),
              "seq_dp": engine.seq_dp_world_size, "dp_world_size": engine.dp_world_size,
              "train_batch_size": engine.train_batch_size()}
    return losses, norms, params, layout


def _train_stages(stages, sp_size):
    # Average over data-parallel losses for comparison with the reference (same on sp peers).
    out = {}
    for stage in stages:
        losses, norms, params, layout = _train(stage, sp_size)
        mean = torch.tensor(losses)
        comm.all_reduce(mean)
        out[stage] = ((mean / comm.get_world_size()).tolist(), norms, params, layout)
    return out


def _close(a, b, rel=1e-5):
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return ((a - b).abs().max() / b.abs().max()).item() < rel


@pytest.mark.parametrize("world, sp_size, stages", [(2, 2, (0, 1, 2, 3)), (4, 2, (2,))])
def test_sequence_parallel_training_equals_full_sequence(world, sp_size, stages):
    dp_size = world // sp_size
    ref_losses, ref_norms, ref_params = _reference(dp_size)
    results = run_on_ranks(_train_stages, world, stages, sp_size)
    for rank, by_stage in enumerate(results):
        for stage, (losses, norms, params, layout) in by_stage.items():
            assert _close(losses, ref_losses), (rank, stage, losses, ref_losses)
            assert _close(norms, ref_norms), (rank, stage, norms, ref_norms)
            assert _close(params, ref_params), (rank, stage)
            # DeepSpeed's layout: sp groups are consecutive ranks, data-parallel peers stride by sp.
            assert layout["sp"] == [rank // sp_size * sp_size + i for i in range(sp_size)]
            assert layout["dp"] == [rank % sp_size + i * sp_size for i in range(dp_size)]
            assert layout["seq_dp"] == world and layout["dp_world_size"] == dp_size
            assert layout["train_batch_size"] == MICRO * dp_size
