"""What `engine.compile()` hands to `torch.compile`: each transformer block, or the whole model.

The unit is the block at every stage: the entries of the model's `nn.ModuleList`s (torchtitan's
unit: FSDP2 and per-block `torch.compile`), each compiled alone, `forward` only. The modules
outside the blocks (embeddings, final norm, LM head) run eagerly: they are a small part of the
step and read tied weights. A model without a `ModuleList` is compiled whole, in place
(`module.compile()`, as DeepSpeed does at every stage).

[Note: why blocks at every stage]
A compiled region's backward is one graph whose gradients all appear when it ends. Compiled whole,
a model's gradient hooks (stages 0-2: the bucketed all-reduces and reduce-scatters) would all fire
after the last kernel, and no reduction would overlap the backward; per block, a block's gradients
are ready, and its buckets reduced, while the blocks before it run their backward (DDP gets the
same from its DDPOptimizer, which splits the graph at bucket boundaries). At stage 3 the block is
also the fetch unit: every module's forward hooks gather and release parameters, and tracing
them would break the graph about a dozen times per block; the stage-3 hooks stay on the block's
`__call__`, outside the compiled region ([Note: compiled blocks] in zero/parameter_offload.py).
Measured with `benchmarks/bench_compile.py` (docs/benchmarks.md).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

__all__ = ["compile_model", "transformer_blocks"]

logger = logging.getLogger(__name__)


def transformer_blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The entries that hold parameters of the outermost `nn.ModuleList`s in `module` (a list
    inside a chosen block, such as an MoE layer's experts, belongs to its block)."""
    blocks: list[torch.nn.Module] = []
    inside: set[int] = set()
    for sub in module.modules():   # pre-order: a block is seen before its descendants
        if id(sub) in inside or not isinstance(sub, torch.nn.ModuleList):
            continue
        for entry in sub:
            if any(True for _ in entry.parameters()):
                blocks.append(entry)
                inside.update(id(m) for m in entry.modules())
    return blocks


def compile_model(module: torch.nn.Module, backend: Any, compile_kwargs: dict[str, Any],
                  parameter_offload: Any = None) -> list[torch.nn.Module]:
    """Compile `module` for training; returns the modules whose forward was compiled: each block,
    made a fetch unit with a stage-3 `parameter_offload` ([Note: why blocks at every stage])."""
    blocks = transformer_blocks(module)
    if not blocks:
        if parameter_offload is not None:
            logger.warning("engine.compile(): the model has no nn.ModuleList of blocks to compile one by one; "
                           "compiling it whole, with a graph break at every ZeRO-3 gather and release")
        module.compile(backend=backend, **compile_kwargs)
        return [module]
    if parameter_offload is not None:
        parameter_offload.set_fetch_units(blocks)
    for block in blocks:
        # The instance attribute shadows the class's forward; __call__ and its hooks stay eager.
        block.forward = torch.compile(block.forward, backend=backend, **compile_kwargs)
    return blocks
