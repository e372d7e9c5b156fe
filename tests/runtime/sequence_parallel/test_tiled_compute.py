"""Tiled compute equals the untiled computation: values, input gradients and parameter gradients
(fp32, one process), including a loss scaled before backward (what gradient accumulation does)."""

import pytest
import torch
import torch.nn.functional as F

from zerospeed.runtime.sequence_parallel.ulysses_sp import (
    TiledFusedLogitsLoss,
    TiledMLP,
    sequence_tiled_compute,
)


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.SiLU(), torch.nn.Linear(12, 6))


def _grads(module, x):
    return [x.grad.clone()] + [p.grad.clone() for p in module.parameters()]


def _run(module, x, fn, scale=1.0):
    module.zero_grad()
    x = x.detach().clone().requires_grad_(True)
    out = fn(module, x)
    (out * scale).sum().backward() if out.dim() else (out * scale).backward()
    return out.detach(), _grads(module, x)


def _assert_same(a, b):
    (va, ga), (vb, gb) = a, b
    torch.testing.assert_close(va, vb, rtol=1e-5, atol=1e-6)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_tiled_mlp_equals_mlp():
    mlp, x = _mlp(), torch.randn(2, 10, 6)
    plain = _run(mlp, x, lambda m, t: m(t))
    tiled = _run(mlp, x, lambda m, t: TiledMLP.apply(lambda s, piece: s(piece), m, t, 3, list(m.parameters())))
    _assert_same(tiled, plain)


@pytest.mark.parametrize("reduction", [None, "mean", "sum"])
def test_sequence_tiled_compute_equals_untiled(reduction):
    mlp, x = _mlp(), torch.randn(2, 10, 6)
    scale = torch.randn(2, 10, 6)

    def fn(hidden_states, scale):
        return mlp(hidden_states) * scale

    reduce = {None: lambda t: t, "mean": torch.mean, "sum": torch.sum}[reduction]
    plain = _run(mlp, x, lambda m, t: reduce(fn(t, scale)))
    tiled = _run(mlp, x, lambda m, t: sequence_tiled_compute(
        fn, 10, 4, {"hidden_states": t, "scale": scale}, {}, "hidden_states", list(m.parameters()),
        output_reduction=reduction))
    _assert_same(tiled, plain)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_tiled_fused_logits_loss_equals_loss_and_honours_a_scaled_loss(reduction):
    head, x = _mlp(), torch.randn(2, 8, 6)
    y = torch.randint(0, 6, (2, 8))
    shards = 4  # 16 rows -> 4 slices of 4: the mean of slice means is the mean

    def loss_fn(module, hidden, labels):
        return F.cross_entropy(module(hidden), labels, reduction=reduction)

    def plain_loss(module, hidden):
        flat = loss_fn(module, hidden.reshape(-1, 6), y.reshape(-1))
        return flat / shards if reduction == "sum" else flat

    def tiled_loss(module, hidden):
        loss = TiledFusedLogitsLoss.apply(loss_fn, module, hidden, y, None, shards, list(module.parameters()),
                                          reduction)
        return loss / shards if reduction == "sum" else loss

    _assert_same(_run(head, x, tiled_loss, scale=0.25), _run(head, x, plain_loss, scale=0.25))
    with pytest.raises(ValueError, match="output_reduction"):
        TiledFusedLogitsLoss.apply(loss_fn, head, x, y, None, 2, [], "max")
