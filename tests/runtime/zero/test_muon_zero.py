"""Muon under ZeRO 0-3 on 2 gloo ranks equals single-process Muon on full matrices (muon_models.py)."""

from __future__ import annotations

import pytest
import torch
from distributed import run_on_ranks
from muon_models import MUON_NAMES, batches, config, make_model, reference_run

import zerospeed

MICRO, WORLD, STEPS = 2, 2, 3
MUON = {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.1}
ADAM = {"lr": 2e-3, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.1}
BLOCK = {"muon_lr": MUON["lr"], "adam_lr": ADAM["lr"], "momentum": MUON["momentum"],
         "weight_decay": 0.1, "betas": [0.9, 0.95], "eps": 1e-10}


def _full_params(engine: zerospeed.DeepSpeedEngine) -> dict[str, torch.Tensor]:
    params = dict(engine.module.named_parameters())
    with zerospeed.zero.GatheredParameters(list(params.values())):
        return {name: p.detach().clone() for name, p in params.items()}


def _train(stage: int, zero_init: bool, ns_method: str, clip: float,
           bf16: bool = False) -> tuple[list[float], dict, int]:
    rank = torch.distributed.get_rank()
    cfg = config(stage, MICRO, {**BLOCK, "ns_method": ns_method}, gradient_clipping=clip, bf16={"enabled": bf16})
    if zero_init:
        with zerospeed.zero.Init(config_dict_or_path=cfg):
            model = make_model()
    else:
        model = make_model()
    engine, optimizer, _, _ = zerospeed.initialize(model=model, config=cfg)
    losses = []
    for tokens, labels in batches(STEPS, MICRO * WORLD):
        rows = slice(rank * MICRO, (rank + 1) * MICRO)
        loss = engine(tokens[rows], labels[rows])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, _full_params(engine), engine.basic_optimizer.newton_schulz_calls


def _check(results: list, clip: float = 0.0) -> None:
    ref_losses, ref_params = reference_run(make_model(), batches(STEPS, MICRO * WORLD), MUON, ADAM, clip)
    calls = 0
    for _, params, rank_calls in results:
        calls += rank_calls
        for name, expected in ref_params.items():
            torch.testing.assert_close(params[name], expected, rtol=0, atol=1e-5, msg=name)
    # Losses are per rank (its half of the batch); their mean is the reference's.
    mean = [sum(r[0][i] for r in results) / len(results) for i in range(STEPS)]
    torch.testing.assert_close(torch.tensor(mean), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    # Newton-Schulz ran on every matrix once per step, on its owner: every rank did part of it.
    assert calls == STEPS * len(MUON_NAMES)
    assert all(0 < rank_calls < calls for _, _, rank_calls in results)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_muon_equals_single_process_reference(stage: int) -> None:
    _check(run_on_ranks(_train, WORLD, stage, False, "gram", 0.0))


def test_muon_stage3_under_zero_init_with_standard_ns_and_clipping() -> None:
    _check(run_on_ranks(_train, WORLD, 3, True, "standard", 0.5), clip=0.5)


@pytest.mark.parametrize("stage", [0, 3])
def test_muon_bf16_trains_near_the_fp32_reference(stage: int) -> None:
    """bf16 parameters with fp32 masters and Newton-Schulz. Newton-Schulz normalizes the update and
    amplifies its small singular directions, so bf16 gradients' rounding moves the parameters well
    past bf16 rounding: the losses, not the parameters, are held to the reference."""
    results = run_on_ranks(_train, WORLD, stage, False, "gram", 0.0, True)
    ref_losses, _ = reference_run(make_model(), batches(STEPS, MICRO * WORLD), MUON, ADAM)
    mean = [sum(r[0][i] for r in results) / len(results) for i in range(STEPS)]
    torch.testing.assert_close(torch.tensor(mean), torch.tensor(ref_losses), rtol=2e-2, atol=0)
    assert all(rank_calls > 0 for _, _, rank_calls in results)


def test_muon_stage2_with_clipping() -> None:
    _check(run_on_ranks(_train, WORLD, 2, False, "gram", 0.5), clip=0.5)


def test_muon_refuses_tensor_parallel_params_not_split_by_autotp() -> None:
    """A matrix flagged tensor_model_parallel by another library (no AutoTP shard record): its whole
    matrix cannot be rebuilt, so Muon is refused rather than run per shard."""
    from zerospeed.runtime.engine_setup import _prepare_muon

    model = torch.nn.Linear(8, 8)
    model.weight.tensor_model_parallel = True   # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="not split by AutoTP.*'weight'"):
        _prepare_muon(model)
