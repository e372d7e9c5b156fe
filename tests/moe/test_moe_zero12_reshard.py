"""Stage-1/2 MoE checkpoints at another world or expert-parallel size ([Note: MoE stage-1/2 reshard]):
every fp32 master and Adam moment comes back bit for bit, per dense parameter and per global expert,
and training goes on as the saving run did."""

from __future__ import annotations

import torch
from distributed import run_on_ranks
from test_moe_checkpoint import _stage3_state
from test_moe_engine import MICRO, MoEModel, _batches, _shard

import zerospeed

GLOBAL_MICRO_BATCHES = 4   # every run sees the same global batch: world size x gradient accumulation


def _engine(ep_size: int, stage: int) -> tuple:
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = MoEModel(ep_size, k=2, drop_tokens=True)
    model.set_expert_weights(rank % ep_size)   # ep groups: consecutive ranks
    config = {"train_micro_batch_size_per_gpu": MICRO,
              "gradient_accumulation_steps": GLOBAL_MICRO_BATCHES // world_size,
              "zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, _, _, _ = zerospeed.initialize(model=model, config=config)
    return engine, model


def _train(engine: object, batches: list, first_step: int) -> dict[tuple[int, int], float]:
    """(step, micro-batch of the global batch) -> loss: the same keys at every world size."""
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    losses = {}
    for step, batch in enumerate(batches, first_step):
        for micro in range(GLOBAL_MICRO_BATCHES // world_size):
            loss = engine(*_shard(batch, micro, rank, world_size))
            engine.backward(loss)
            engine.step()
            losses[(step, micro * world_size + rank)] = loss.item()
    return losses


def _load(save_dir: str, layouts: list[tuple[int, int]]) -> list[dict]:
    """At each (ep size, stage): load, read every master and moment, train the remaining steps."""
    batches = _batches(GLOBAL_MICRO_BATCHES, 1)
    results = []
    for ep_size, stage in layouts:
        engine, model = _engine(ep_size, stage)
        engine.load_checkpoint(save_dir, tag="t")
        results.append({"state": _stage3_state(model), "losses": _train(engine, batches[1:], 1)})
    return results


def _save_then_load(save_dir: str, ep_size: int, stage: int, layouts: list[tuple[int, int]]) -> dict:
    """One step, save, the remaining steps; then the loads of `layouts` on these ranks."""
    batches = _batches(GLOBAL_MICRO_BATCHES, 1)
    engine, model = _engine(ep_size, stage)
    _train(engine, batches[:1], 0)
    engine.save_checkpoint(save_dir, tag="t")
    saved = _stage3_state(model)
    continued = _train(engine, batches[1:], 1)
    return {"saved": saved, "continued": continued, "loaded": _load(save_dir, layouts)}


def _check(saving: list[dict], loads: list[list[dict]], what: str) -> None:
    """Every loaded master and moment equals the saved one bit for bit; every continued loss matches."""
    saved = {name: value for result in saving for name, value in result["saved"].items()}
    continued = {key: loss for result in saving for key, loss in result["continued"].items()}
    assert len(saved) == 5 + 4 * 4   # inp, gate, head (weight, bias) and 4 experts x 4 tensors
    for i, per_rank in enumerate(zip(*loads)):
        seen, losses = set(), {}
        for rank, loaded in enumerate(per_rank):
            for name, value in loaded["state"].items():
                seen.add(name)
                for kind, got, want in zip(("master", "exp_avg", "exp_avg_sq"), value, saved[name]):
                    assert torch.equal(got, want), f"{what}, load {i}, rank {rank}: {name} {kind}"
            losses.update(loaded["losses"])
        assert seen == set(saved), f"{what}, load {i}: every expert held by some rank"
        assert losses.keys() == continued.keys()
        keys = sorted(continued)
        torch.testing.assert_close(torch.tensor([losses[k] for k in keys]), torch.tensor([continued[k] for k in keys]),
                                   rtol=1e-5, atol=0, msg=lambda m, i=i: f"{what}, load {i}: {m}")


def test_stage2_checkpoint_of_4_ranks_ep2_loads_on_2_ranks_and_at_ep4(tmp_path: object) -> None:
    """Saved at stage 2 on 4 ranks with ep 2; loaded on the same 4 ranks at ep 4 (stages 2 and 1), and on 2
    ranks at ep 2 (stage 2) and ep 1 (stage 1)."""
    saving = run_on_ranks(_save_then_load, 4, str(tmp_path), 2, 2, [(4, 2), (4, 1)])
    _check(saving, [result["loaded"] for result in saving], "4 ranks ep 2 -> 4 ranks ep 4")
    _check(saving, run_on_ranks(_load, 2, str(tmp_path), [(2, 2), (1, 1)]), "4 ranks ep 2 -> 2 ranks")


def test_stage1_checkpoint_of_2_ranks_loads_on_4_ranks(tmp_path: object) -> None:
    """Saved at stage 1 on 2 ranks with ep 2 (gradient accumulation 2); loaded on 4 ranks at ep 2 and ep 4."""
    saving = run_on_ranks(_save_then_load, 2, str(tmp_path), 2, 1, [])
    _check(saving, run_on_ranks(_load, 4, str(tmp_path), [(2, 1), (4, 2)]), "2 ranks ep 2 -> 4 ranks")


def test_stage2_checkpoint_loads_at_stage0_and_stage1_at_the_same_sizes(tmp_path: object) -> None:
    """Saved at stage 2 on 2 ranks with ep 2; loaded on the same ranks and sizes at stage 0 (replicated state,
    whose own files are per expert-parallel rank) and at stage 1."""
    saving = run_on_ranks(_save_then_load, 2, str(tmp_path), 2, 2, [(2, 0), (2, 1)])
    _check(saving, [result["loaded"] for result in saving], "stage 2 -> stages 0 and 1")


def _mixed_ep_at_other_sizes(save_dir: str) -> str:
    """A stage-2 checkpoint of layers at ep 2 and ep 4, loaded with both at ep 4: refused, naming the way out."""
    from test_moe_mixed_ep import MixedEpModel

    def engine(ep_sizes: tuple[int, int]) -> object:
        model = MixedEpModel(ep_sizes)
        config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
        return zerospeed.initialize(model=model, config=config)[0]

    engine((2, 4)).save_checkpoint(save_dir, tag="t")
    other = engine((4, 4))
    try:
        other.load_checkpoint(save_dir, tag="t")
    except ValueError as error:
        other.load_checkpoint(save_dir, tag="t", load_optimizer_states=False)   # the weights still load
        return str(error)
    return ""


def test_several_expert_parallel_sizes_at_other_sizes_is_a_clear_error(tmp_path: object) -> None:
    for message in run_on_ranks(_mixed_ep_at_other_sizes, 4, str(tmp_path)):
        assert "load_optimizer_states=False" in message and "one expert-parallel size" in message, message
