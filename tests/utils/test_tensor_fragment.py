"""`deepspeed.utils.safe_get_*` / `safe_set_*` at ZeRO stages 0-3 on 2 gloo ranks, against a
single-process torch reference of the same global batch (fp32)."""

import pytest
import torch

from distributed import run_on_ranks

IN, HIDDEN, OUT, BATCH = 6, 5, 3, 4  # 5x6 + 5 + 3x5 + 3 = 53 elements: partitions cut through params


def _model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    return torch.randn(2 * BATCH, IN, generator=generator), torch.randn(2 * BATCH, OUT, generator=generator)


def _reference() -> dict[str, list[torch.Tensor]]:
    model = _model()
    x, y = _batch()
    torch.nn.functional.mse_loss(model(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    optimizer.step()
    return {"grads": grads, "params": [p.detach().clone() for p in model.parameters()],
            "exp_avg": [optimizer.state[p]["exp_avg"].clone() for p in model.parameters()]}


def _run(stage: int) -> dict[str, list[torch.Tensor]]:
    import zerospeed
    from zerospeed import utils

    rank = torch.distributed.get_rank()
    config = {"train_micro_batch_size_per_gpu": BATCH, "optimizer": {"type": "Adam", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": stage}}
    engine, *_ = zerospeed.initialize(model=_model(), config=config)
    x, y = _batch()
    x, y = x[rank * BATCH:(rank + 1) * BATCH], y[rank * BATCH:(rank + 1) * BATCH]
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    params = list(engine.module.parameters())
    grads = [utils.safe_get_full_grad(p) for p in params]
    engine.step()
    out = {"grads": grads, "params": [utils.safe_get_full_fp32_param(p) for p in params],
           "exp_avg": [utils.safe_get_full_optimizer_state(p, "exp_avg") for p in params]}
    # A full write lands in every rank's piece: reading it back gives the value written.
    utils.safe_set_full_fp32_param(params[0], torch.full_like(out["params"][0], 0.25))
    utils.safe_set_full_optimizer_state(params[2], torch.ones_like(out["exp_avg"][2]), "exp_avg")
    out["written"] = [utils.safe_get_full_fp32_param(params[0]),
                      utils.safe_get_full_optimizer_state(params[2], "exp_avg")]
    if stage == 3:
        local = utils.safe_get_local_fp32_param(params[0])
        out["local_numel"] = [torch.tensor(local.numel())]
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_safe_get_and_set_match_torch(stage):
    reference = _reference()
    for result in run_on_ranks(_run, 2, stage):
        for key in ("grads", "params", "exp_avg"):
            for ours, theirs in zip(result[key], reference[key]):
                torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7, msg=f"{key} at stage {stage}")
        torch.testing.assert_close(result["written"][0], torch.full_like(reference["params"][0], 0.25))
        torch.testing.assert_close(result["written"][1], torch.ones_like(reference["exp_avg"][2]))
        if stage == 3:
            assert int(result["local_numel"][0]) == (reference["params"][0].numel() + 1) // 2


def _frozen_error(_: int) -> str:
    import zerospeed
    from zerospeed import utils

    model = _model()
    model[0].weight.requires_grad_(False)
    engine, *_ = zerospeed.initialize(model=model, config={"train_micro_batch_size_per_gpu": 2,
                                                           "zero_optimization": {"stage": 2},
                                                           "optimizer": {"type": "Adam", "params": {"lr": 0.1}}})
    with pytest.raises(ValueError, match="frozen"):
        utils.safe_get_full_fp32_param(model[0].weight)
    with pytest.raises(ValueError, match="stage 3"):
        utils.safe_get_local_fp32_param(model[0].bias)
    del engine
    return "ok"


def test_frozen_param_and_local_outside_stage3_are_named_errors():
    assert run_on_ranks(_frozen_error, 2, 0) == ["ok", "ok"]
