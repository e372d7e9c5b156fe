"""FLOPs and MACs of one aten operator call: the table the flops profiler looks ops up in.

[Note: what is counted]
The profiler sees operators after PyTorch's composite decomposition (`linear` arrives as `addmm`
or `mm`, `einsum` and `matmul` as `bmm` / `mm`, `conv2d` as `convolution`), so every
multiply-accumulate kernel is counted exactly once:
* matrix products and convolutions (`mm, addmm, bmm, baddbmm, convolution, ...`) use PyTorch's own
  formulas (`torch.utils.flop_counter.flop_registry`): FLOPs = 2 x MACs; a bias added by `addmm`
  or `baddbmm` is not counted, as in DeepSpeed's profiler;
* fused attention (`scaled_dot_product_attention`, including the CPU kernel that PyTorch's table
  lacks) counts its two batched products, Q K^T and P V: 2 x b x h x s_q x s_k x (d_qk + d_v) FLOPs;
* elementwise math (activations, softmax, add / mul / div, ...) counts one FLOP per output
  element and no MACs; layer norm counts 5 per element (mean, centre, variance, scale, affine).
Data movement (views, copies, indexing) is free.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

__all__ = ["OpCount", "count_op"]

aten = torch.ops.aten
OpCount = tuple[int, int]  # (flops, macs)


def _first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        for item in out:
            if isinstance(item, torch.Tensor):
                return item
    return None


def _sdpa(args: tuple, kwargs: dict, out: Any) -> OpCount:
    query, key, value = args[:3]
    *batch, s_q, d_qk = query.shape
    s_k, d_v = key.shape[-2], value.shape[-1]
    num_heads_batch = 1
    for size in batch:
        num_heads_batch *= size
    macs = num_heads_batch * s_q * s_k * (d_qk + d_v)
    return 2 * macs, macs


def _elementwise(flops_per_element: int) -> Callable[[tuple, dict, Any], OpCount]:
    def count(args: tuple, kwargs: dict, out: Any) -> OpCount:
        result = _first_tensor(out)
        return (flops_per_element * result.numel(), 0) if result is not None else (0, 0)

    return count


_SDPA_OPS = ["_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"]
_ONE_FLOP_OPS = [
    "add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_", "pow", "pow_", "neg", "exp", "log", "sqrt",
    "rsqrt", "tanh", "tanh_", "sigmoid", "sigmoid_", "relu", "relu_", "gelu", "gelu_", "silu", "silu_",
    "leaky_relu", "elu", "hardtanh", "_softmax", "_log_softmax", "where", "clamp", "clamp_min", "maximum",
    "minimum", "mean", "sum", "erf", "sin", "cos",
]
_NORM_OPS = {"native_layer_norm": 5, "native_group_norm": 5, "_native_batch_norm_legit_no_training": 2,
             "_native_batch_norm_legit": 4, "native_batch_norm": 4, "_fused_rms_norm": 4}


def _build_table() -> dict[Any, Callable[[tuple, dict, Any], OpCount]]:
    """Op packets by name; names this torch build lacks are left out."""
    table: dict[Any, Callable[[tuple, dict, Any], OpCount]] = {}
    entries = [(name, _sdpa) for name in _SDPA_OPS] + [(name, _elementwise(1)) for name in _ONE_FLOP_OPS]
    entries += [(name, _elementwise(per_element)) for name, per_element in _NORM_OPS.items()]
    for name, count in entries:
        packet = getattr(aten, name, None)
        if packet is not None:
            table[packet] = count
    return table


_SPECIAL = _build_table()


def count_op(func: Any, args: tuple, kwargs: dict, out: Any) -> OpCount:
    """(flops, macs) of one call of the aten overload `func` with `args`, `kwargs` giving `out`."""
    packet = func.overloadpacket
    special = _SPECIAL.get(packet)
    if special is not None:
        return special(args, kwargs, out)
    registered = flop_registry.get(packet)
    if registered is None:
        return 0, 0
    flops = int(registered(*args, **kwargs, out_val=out))
    return flops, flops // 2
