"""torch Adam / AdamW stepped over a flat partition in chunks, so its temporaries are chunk-sized.

[Note: chunked optimizer step]
ZeRO steps one flat fp32 partition per parameter group (stage 1/2) or sub-group (stage 3). torch's
single-tensor Adam, the CPU default, builds `exp_avg_sq.sqrt()` and its quotient by the bias
correction for the whole tensor at once: two partition-sized temporaries at the step, the step's
peak (issue 21: +189 MiB and 48k page faults a step on wide10 at stage 3; DeepSpeed's flat
partition pays the same). Adam is elementwise, so stepping the partition piece by piece gives the
same bits, with temporaries of at most `CHUNK_NUMEL` elements.

`step_in_chunks` calls the optimizer's own `step()` once (its hooks run once), after swapping, in
each parameter group, every large parameter for views of it of at most `CHUNK_NUMEL` elements; each
view gets the matching views of the gradient and of the optimizer state, and a copy of the `step`
counter (each view's counter is incremented once). Afterwards the groups and state are put back
and the counter written once. Checkpoints never see the views: they exist only inside the call.

Only where it is exact and helps: torch `Adam` / `AdamW` (their subclasses may override the
arithmetic) taking the single-tensor path (foreach and fused batch every tensor of the group at
once, so chunks would not bound anything), CPU tensors, state already created (the first step
creates it for the whole tensor, as before). Anything else steps as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["CHUNK_NUMEL", "step_in_chunks"]

# 8 MiB of fp32: two such temporaries at the step instead of two partitions; with chunks this
# large the per-chunk Python cost of the loop (~20 small calls) is far below the arithmetic.
CHUNK_NUMEL = 1 << 21
_STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def step_in_chunks(optimizer: torch.optim.Optimizer, chunk_numel: int = CHUNK_NUMEL) -> None:
    """`optimizer.step()`, with large parameters stepped in chunks where that is exact."""
    if not _chunkable(optimizer):
        optimizer.step()
        return
    with _chunked_groups(optimizer, chunk_numel):
        optimizer.step()


def _chunkable(optimizer: torch.optim.Optimizer) -> bool:
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    return all(not group.get("foreach") and not group.get("fused") and not group.get("capturable")
               and not group.get("differentiable") for group in optimizer.param_groups)


def _splits(param: torch.Tensor, state: dict[str, Any], chunk_numel: int) -> bool:
    return (param.grad is not None and param.numel() > chunk_numel and param.device.type == "cpu"
            and param.is_contiguous() and param.grad.is_contiguous() and "exp_avg" in state)


@contextlib.contextmanager
def _chunked_groups(optimizer: torch.optim.Optimizer, chunk_numel: int) -> Iterator[None]:
    saved_params = [group["params"] for group in optimizer.param_groups]
    split: list[tuple[torch.Tensor, list[torch.Tensor]]] = []   # (parameter, its chunk views)
    try:
        for group in optimizer.param_groups:
            params: list[torch.Tensor] = []
            for param in group["params"]:
                state = optimizer.state[param]
                if not _splits(param, state, chunk_numel):
                    params.append(param)
                    continue
                views = _chunk_views(optimizer, param, state, chunk_numel)
                split.append((param, views))
                params.extend(views)
            group["params"] = params
        yield
        for param, views in split:
            optimizer.state[param]["step"] = optimizer.state[views[0]]["step"]
    finally:
        for group, params in zip(optimizer.param_groups, saved_params):
            group["params"] = params
        for _, views in split:
            for view in views:
                optimizer.state.pop(view, None)


def _chunk_views(optimizer: torch.optim.Optimizer, param: torch.Tensor, state: dict[str, Any],
                 chunk_numel: int) -> list[torch.Tensor]:
    """Views of `param` (flattened) of at most `chunk_numel` elements, each with its gradient and
    optimizer state views registered; `param`'s own state is left untouched."""
    flat = param.detach().view(-1)
    grad = param.grad.view(-1)  # type: ignore[union-attr]
    views = []
    for start in range(0, flat.numel(), chunk_numel):
        length = min(chunk_numel, flat.numel() - start)
        view = flat.narrow(0, start, length)
        view.grad = grad.narrow(0, start, length)
        chunk_state: dict[str, Any] = {"step": state["step"].clone()}
        for key in _STATE_KEYS:
            if key in state:
                chunk_state[key] = state[key].view(-1).narrow(0, start, length)
        optimizer.state[view] = chunk_state
        views.append(view)
    return views
