"""FusedLamb against the LAMB update written out independently."""

import math

import torch

from zerospeed.ops.lamb import FusedLamb


def _reference_lamb(weights, grads, lr, betas, eps, weight_decay, max_coeff=10.0, min_coeff=0.01):
    m = [0.0] * len(weights)
    v = [0.0] * len(weights)
    w = list(weights)
    for step, g in enumerate(grads, start=1):
        m = [betas[0] * mi + (1 - betas[0]) * gi for mi, gi in zip(m, g)]
        v = [betas[1] * vi + (1 - betas[1]) * gi * gi for vi, gi in zip(v, g)]
        update = [(mi / (1 - betas[0] ** step)) / (math.sqrt(vi / (1 - betas[1] ** step)) + eps) + weight_decay * wi
                  for mi, vi, wi in zip(m, v, w)]
        ratio = math.sqrt(sum(x * x for x in w)) / math.sqrt(sum(u * u for u in update))
        ratio = min(max(ratio, min_coeff), max_coeff)
        w = [wi - lr * ratio * ui for wi, ui in zip(w, update)]
    return w


def test_fused_lamb_matches_the_formula():
    torch.manual_seed(0)
    start = torch.randn(5, dtype=torch.float64)
    grads = [torch.randn(5, dtype=torch.float64) for _ in range(4)]
    param = torch.nn.Parameter(start.clone())
    optimizer = FusedLamb([param], lr=0.1, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01)
    for grad in grads:
        param.grad = grad.clone()
        optimizer.step()
    expected = _reference_lamb(start.tolist(), [g.tolist() for g in grads], 0.1, (0.9, 0.99), 1e-6, 0.01)
    assert torch.allclose(param.detach(), torch.tensor(expected, dtype=torch.float64), rtol=1e-10, atol=1e-12)


def test_trust_ratio_is_clamped():
    param = torch.nn.Parameter(torch.full((4,), 1000.0))
    optimizer = FusedLamb([param], lr=1.0, max_coeff=2.0)
    param.grad = torch.ones(4)
    optimizer.step()
    assert optimizer.lamb_coeffs == [2.0]
