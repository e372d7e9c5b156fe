"""A sequence-parallel checkpoint loaded at another sp x dp layout (or world size) trains on as if
uninterrupted: the run that saved at one layout and resumed at another equals one process that
trained the same global batches on full sequences with the same AdamW (losses and parameters,
fp32). Adam makes the moments matter: a load that dropped or misplaced them would diverge.

ZeRO partitions span the sp x dp ranks (the sequence-data-parallel group), so a layout change at
the same world size keeps every rank's partition; a world-size change goes through the ordinary
resharding path.
"""

import functools
import os

import pytest
import torch
import torch.nn.functional as F

from distributed import run_on_ranks
from ulysses_lm import UlyssesLM
from zerospeed import comm

# eps 1e-3: with the default 1e-8 a gradient element near 0 turns fp32 rounding into an lr-sized step.
VOCAB, HIDDEN, HEADS, SEQ, MICRO, LR, EPS = 16, 16, 4, 8, 2, 1e-2, 1e-3
SAVE_AT, STEPS = 2, 4


ReshardLM = functools.partial(UlyssesLM, VOCAB, HIDDEN, HEADS)   # 4 heads, so sp 4 fits


def _global_batch(step, dp_size):
    """Step ``step``'s global batch at ``dp_size`` replicas (replica d: rows d*MICRO ..)."""
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (dp_size * MICRO, SEQ), generator=gen)
    labels = torch.cat([tokens[:, 1:], torch.full((dp_size * MICRO, 1), -100)], dim=-1)
    labels[:, :3] = -100   # slices hold different numbers of valid tokens
    return tokens, labels


def _reference(dp_before, dp_after):
    """One process, full sequences: SAVE_AT steps at ``dp_before`` replicas, then ``dp_after``."""
    torch.manual_seed(0)
    model = ReshardLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, eps=EPS)
    losses = []
    for step in range(STEPS):
        dp_size = dp_before if step < SAVE_AT else dp_after
        tokens, labels = _global_batch(step, dp_size)
        per_replica = [F.cross_entropy(model(tokens[d * MICRO:(d + 1) * MICRO]).reshape(-1, VOCAB),
                                       labels[d * MICRO:(d + 1) * MICRO].reshape(-1)) for d in range(dp_size)]
        loss = torch.stack(per_replica).mean()   # the engine averages over data-parallel replicas
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _engine(stage, sp_size, seed):
    import zerospeed
    from zerospeed.comm import groups
    from zerospeed.runtime.sequence_parallel.groups_setup import sequence_parallel_topology

    topology = sequence_parallel_topology(comm.get_world_size(), sp_size)
    sp_group = groups.create_axis_group(topology, "sequence").group if sp_size > 1 else None
    torch.manual_seed(seed)   # the resumed engine starts from other weights: the load must replace them
    model = ReshardLM(sp_group)
    config = {"train_micro_batch_size_per_gpu": MICRO, "sequence_parallel_size": sp_size,
              "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "eps": EPS}}}
    engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine, topology.get_coord(comm.get_rank())


def _train(engine, coord, sp_size, steps):
    """This rank's losses (each its replica's whole-sample loss) for ``steps``."""
    from zerospeed.sequence.loss import sequence_parallel_cross_entropy

    dp_size = comm.get_world_size() // sp_size
    rows = slice(coord.data * MICRO, (coord.data + 1) * MICRO)
    cols = slice(coord.sequence * SEQ // sp_size, (coord.sequence + 1) * SEQ // sp_size)
    losses = []
    for step in steps:
        tokens, labels = _global_batch(step, dp_size)
        logits = engine(tokens[rows, cols])
        if sp_size > 1:
            loss = sequence_parallel_cross_entropy(logits, labels[rows, cols], engine.seq_parallel_group)
        else:
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels[rows, cols].reshape(-1))
        engine.backward(loss)
        engine.step()
        mean = torch.tensor([loss.item()])
        comm.all_reduce(mean)   # sp peers hold the same loss: the world mean is the replica mean
        losses.append(mean.item() / comm.get_world_size())
    return losses


def _params(engine):
    from zerospeed.zero import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):   # a no-op below ZeRO 3
        return torch.cat([p.detach().reshape(-1).clone() for p in engine.module.parameters()])


def _save(stage, sp_size, save_dir):
    engine, coord = _engine(stage, sp_size, seed=0)
    losses = _train(engine, coord, sp_size, range(SAVE_AT))
    engine.save_checkpoint(save_dir, tag="t")
    return losses


def _resume(stage, sp_size, save_dir):
    engine, coord = _engine(stage, sp_size, seed=1)
    engine.load_checkpoint(save_dir, tag="t")
    steps = engine.global_steps
    return {"steps": steps, "losses": _train(engine, coord, sp_size, range(SAVE_AT, STEPS)),
            "params": _params(engine)}


def _rel(a, b):
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return ((a - b).abs().max() / b.abs().max()).item()


def _close(a, b, rel=1e-5):
    return _rel(a, b) < rel


# (stage, world and sp at the save, world and sp at the load)
CASES = [
    (1, 2, 2, 2, 1),   # sp 2 x dp 1 -> sp 1 x dp 2 on the same 2 ranks
    (3, 2, 2, 2, 1),
    (1, 4, 2, 4, 4),   # sp 2 x dp 2 -> sp 4 x dp 1 on 4 ranks
    (3, 4, 2, 4, 4),
    (1, 2, 2, 4, 2),   # sp 2 on 2 ranks -> sp 2 x dp 2 on 4 ranks (the ZeRO partitions recut)
    (3, 2, 2, 4, 2),
]


@pytest.mark.parametrize("stage, world_a, sp_a, world_b, sp_b", CASES)
def test_sp_checkpoint_loads_at_another_layout(tmp_path, stage, world_a, sp_a, world_b, sp_b):
    dp_a, dp_b = world_a // sp_a, world_b // sp_b
    ref_losses, ref_params = _reference(dp_a, dp_b)
    save_dir = os.path.join(str(tmp_path), "ckpt")
    saved = run_on_ranks(_save, world_a, stage, sp_a, save_dir)
    resumed = run_on_ranks(_resume, world_b, stage, sp_b, save_dir)
    assert _close(saved[0], ref_losses[:SAVE_AT]), (saved[0], ref_losses)
    for rank, result in enumerate(resumed):
        assert result["steps"] == SAVE_AT
        assert _close(result["losses"], ref_losses[SAVE_AT:]), (rank, result["losses"], ref_losses)
        assert _close(result["params"], ref_params), (rank, _rel(result["params"], ref_params))
