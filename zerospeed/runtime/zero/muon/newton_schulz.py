"""Muon's orthogonalization: the quintic Newton-Schulz iteration and the shape rules around it.

[Note: Muon's update]
For one matrix with gradient G and momentum buffer M (both in the parameter's shape):

    M <- beta * M + (1 - beta) * G                    (momentum, elementwise)
    U  = (1 - beta) * G + beta * M   (nesterov)  or  M
    O  = NS_k(U) * sqrt(max(1, rows / cols))          (Newton-Schulz, k = ns_steps)
    W <- W * (1 - lr * weight_decay) - lr * O

Only `NS_k` needs the whole matrix; everything else is elementwise, so it runs unchanged on a flat
ZeRO partition (muon_optimizer.py) and only U travels to the matrix's owner (owner_exchange.py).
`NS_k` normalizes U by its Frobenius norm (+1e-7) and iterates X <- aX + (bA + cA^2)X, A = XX^T, on
the wide orientation (rows <= cols), with (a, b, c) = (3.4445, -4.7750, 2.0315): the coefficients of
DeepSpeed's `zeropower_via_newtonschulz5`, Keller Jordan's Muon and `torch.optim.Muon`.

Two methods give the same result in exact arithmetic (DeepSpeed's `ns_method`):
- "standard": the iteration above.
- "gram": the iteration carried on the small Gram matrix R = XX^T (rows x rows) instead of X: each
  step's polynomial P = aI + bR + cR^2 is accumulated into Q (X_k = Q X_0) and R <- P R P, with X
  rebuilt once (after 2 steps) to keep the error of the long product bounded; cheaper when
  cols >> rows. A square matrix runs "standard" under "gram" too, as DeepSpeed's: its Gram matrix is
  as large as itself, so "gram" would only add the products of Q (about 20% more work).
Each step's `aX + (bA + cA^2)X` is two fused `addmm`s (`baddbmm` on a batch): the scalings ride on
BLAS's alpha / beta instead of full-size temporaries (within float32 rounding of the unfused form).

Shapes: a 2-D matrix is one matrix; a 4-D weight (a convolution) is viewed as (out, in*kh*kw), the
scale then taken from that view (DeepSpeed takes it from the kernel's last two dims: see
docs/compatibility.md); 3-D and higher are a batch of matrices over the leading dims.

Everything runs in float32, whatever the parameters' dtype: DeepSpeed runs "gram" in fp16 and
"standard" in bf16 where the accelerator has them, which is faster on a GPU and differs from the
full-precision result by about 1e-2 relative (docs/muon.md).
"""

from __future__ import annotations

import math

import torch

__all__ = ["NS_COEFFICIENTS", "NS_METHODS", "matrix_view_shape", "orthogonalize", "zeropower"]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_METHODS = ("gram", "standard")
_NORM_EPS = 1e-7
_GRAM_RESTART_STEP = 2


def matrix_view_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape Newton-Schulz sees for a parameter of `shape` (see the module note)."""
    if len(shape) < 2:
        raise ValueError(f"Muon orthogonalizes matrices; a parameter of shape {tuple(shape)} has "
                         "fewer than 2 dims (give it use_muon=False: AdamW steps it)")
    if len(shape) == 4:
        return (shape[0], math.prod(shape[1:]))
    return tuple(shape)


def _addmm(base: torch.Tensor, left: torch.Tensor, right: torch.Tensor, beta: float = 1.0,
           alpha: float = 1.0) -> torch.Tensor:
    """beta * base + alpha * left @ right in one BLAS call (no scaled temporaries); 2-D or a 3-D batch."""
    if base.dim() == 2:
        return torch.addmm(base, left, right, beta=beta, alpha=alpha)
    return torch.baddbmm(base, left, right, beta=beta, alpha=alpha)


def _polynomial(gram: torch.Tensor) -> torch.Tensor:
    """Z = bR + cR^2 (the step's polynomial P = aI + Z, its aI folded into the products' beta)."""
    _, b, c = NS_COEFFICIENTS
    return _addmm(gram, gram, gram, beta=b, alpha=c)


def _standard(x: torch.Tensor, steps: int) -> torch.Tensor:
    a = NS_COEFFICIENTS[0]
    for _ in range(steps):
        x = _addmm(x, _polynomial(x @ x.mT), x, beta=a)   # X <- aX + ZX
    return x


def _gram(x: torch.Tensor, steps: int) -> torch.Tensor:
    a = NS_COEFFICIENTS[0]
    gram = x @ x.mT
    product: torch.Tensor | None = None   # Q: X_k = Q X (None: the identity)
    for step in range(steps):
        if step == _GRAM_RESTART_STEP and product is not None:
            x = product @ x
            gram = x @ x.mT
            product = None
        poly = _polynomial(gram)
        if product is None:
            product = poly.clone()   # Q = P = aI + Z (poly stays Z: the update of R below uses it)
            product.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            product = _addmm(product, poly, product, beta=a)   # Q <- PQ = aQ + ZQ
        if step < steps - 1 and step + 1 != _GRAM_RESTART_STEP:
            # P commutes with R: R_{k+1} = P R P = P(PR), each factor aY + ZY
            half = _addmm(gram, poly, gram, beta=a)
            gram = _addmm(half, poly, half, beta=a)
    return x if product is None else product @ x


def zeropower(update: torch.Tensor, steps: int, method: str = "gram") -> torch.Tensor:
    """NS_k(update) over the last two dims (a batch over the leading ones), in float32."""
    if method not in NS_METHODS:
        raise ValueError(f"ns_method must be one of {NS_METHODS}, got {method!r}")
    x = update.to(torch.float32)
    batch_shape = x.shape[:-2]
    if x.dim() > 3:
        x = x.reshape(-1, *x.shape[-2:])   # one batch dim: torch.baddbmm's
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + _NORM_EPS)
    # a square matrix gains nothing from "gram" (its Gram matrix is as large): "standard", as DeepSpeed
    square = x.size(-2) == x.size(-1)
    x = _standard(x, steps) if method == "standard" or square else _gram(x, steps)
    x = x.mT if tall else x
    return x.reshape(*batch_shape, *x.shape[-2:])


def orthogonalize(update: torch.Tensor, shape: tuple[int, ...], steps: int = 5,
                  method: str = "gram", head_dim: int | None = None) -> torch.Tensor:
    """O for one parameter ([Note: Muon's update]): `update` holds its elements (any view of
    `numel(shape)` elements); the result is float32, flat, in the same element order. With
    `head_dim` a 2-D matrix is orthogonalized in blocks of `head_dim` rows, one per attention
    head, each scaled by its own shape ([Note: per-head Muon] in per_head.py)."""
    if head_dim is not None:
        shape = _head_blocks(shape, head_dim)
    view = matrix_view_shape(shape)
    rows, cols = view[-2], view[-1]
    result = zeropower(update.reshape(view), steps, method).reshape(-1)
    if rows > cols:
        result.mul_(math.sqrt(rows / cols))   # result is fresh (never `update` itself): in place
    return result


def _head_blocks(shape: tuple[int, ...], head_dim: int) -> tuple[int, ...]:
    """A `[heads * head_dim, in]` matrix as a batch of `heads` blocks `[head_dim, in]`."""
    if len(shape) != 2 or head_dim < 1 or shape[0] % head_dim:
        raise ValueError(f"per-head Muon splits a 2-D attention projection into blocks of {head_dim} rows; "
                         f"a matrix of shape {tuple(shape)} does not split")
    return (shape[0] // head_dim, head_dim, shape[1])
