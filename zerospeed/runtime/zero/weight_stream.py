"""Streaming the full weights out of a (possibly ZeRO-3 partitioned) model, a bucket at a time.

An RL loop hands the policy's weights to a separate generation engine (vLLM, SGLang, its own
sampler) after every few steps. DeepSpeed offers `GatheredParameters(model.parameters())`, which
holds the whole model gathered at once on every rank (plus whatever the receiver copies), or a
per-parameter loop, which pays one collective per tensor. `iter_full_weights` sits between: it cuts
the parameters, in `named_parameters()` order, into buckets of at most `bucket_bytes` (a parameter
larger than the budget is a bucket of its own), gathers one bucket (one collective per dtype),
yields its `(name, full tensor)` pairs, and partitions the bucket again before gathering the next.

[Note: weight stream memory]
What this rank holds gathered at any moment, beyond the parameters kept whole anyway (ZeRO-3's
persistent ones, or every parameter below stage 3), is one bucket: at most `bucket_bytes`, or the
largest parameter if that is bigger. A yielded tensor stays valid after the iterator moves on (its
storage is only dropped from the parameter, not reused), so a consumer that keeps tensors keeps
their memory: send or copy each one, then let it go.

Names are the module's `named_parameters()` names (Hugging Face names for a Hugging Face model);
a tied parameter is yielded once, under its first name, as `named_parameters()` lists it. Buffers
are not weights a generation engine loads and are not yielded. Every rank of the data-parallel
group must iterate (the gathers are collective); every rank gets every tensor.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from zerospeed.runtime.zero.param_state import ZeroParamStatus, is_zero_param
from zerospeed.runtime.zero.partition_parameters import gather_params, release_params

__all__ = ["iter_full_weights", "plan_weight_buckets"]


def full_nbytes(param: torch.nn.Parameter) -> int:
    numel = param.zs_state.numel if is_zero_param(param) else param.numel()
    return numel * param.element_size()


def plan_weight_buckets(sizes: list[int], bucket_bytes: int) -> list[range]:
    """Consecutive index ranges whose byte sizes sum to at most `bucket_bytes`; an item larger
    than the budget is a range of its own. Pure: the plan every rank computes alike."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be a positive number of bytes, got {bucket_bytes}")
    buckets: list[range] = []
    start, total = 0, 0
    for index, size in enumerate(sizes):
        if index > start and total + size > bucket_bytes:
            buckets.append(range(start, index))
            start, total = index, 0
        total += size
    if start < len(sizes):
        buckets.append(range(start, len(sizes)))
    return buckets


def iter_full_weights(module: torch.nn.Module,
                      bucket_bytes: int = 256 * 2**20) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, full tensor)` for every parameter of `module`, gathering `bucket_bytes` at a
    time ([Note: weight stream memory]). Collective at ZeRO-3: call it on every rank."""
    named = list(module.named_parameters())
    for bucket in plan_weight_buckets([full_nbytes(p) for _, p in named], bucket_bytes):
        params = [named[i][1] for i in bucket]
        # only what this bucket gathers is released after it: parameters a forward or the user
        # already holds whole stay whole
        gathered = [p for p in params if is_zero_param(p) and p.zs_state.status is ZeroParamStatus.NOT_AVAILABLE]
        gather_params(gathered).wait()
        try:
            for name, param in (named[i] for i in bucket):
                yield name, param.detach()
        finally:
            release_params(gathered)
