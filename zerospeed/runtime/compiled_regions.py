"""What `engine.compile()` hands to `torch.compile`: the whole model, or each transformer block.

Without stage 3 the engine's hooks are gradient hooks, which dynamo never traces, so the whole
model is compiled in place (`module.compile()`, as DeepSpeed does). At stage 3 every module's
forward hooks gather and release parameters, and tracing them breaks the graph about a dozen times
per block. There the blocks, the entries of the model's `nn.ModuleList`s (torchtitan's unit:
FSDP2 and per-block `torch.compile`), are compiled one by one, `forward` only, and become fetch
units of the stage-3 hooks, which stay on the block's `__call__`, outside the compiled region
([Note: compiled blocks] in zero/parameter_offload.py). The modules outside the blocks (embeddings,
final norm, LM head) run eagerly: they are a small part of the step and read tied weights, which
are gathered through the partitioned parameter's hooks.
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
    """Compile `module` for training; returns the modules whose forward was compiled. With a
    stage-3 `parameter_offload`, each block is compiled and made a fetch unit (see the module doc)."""
    if parameter_offload is None:
        module.compile(backend=backend, **compile_kwargs)
        return [module]
    blocks = transformer_blocks(module)
    if not blocks:
        logger.warning("engine.compile(): the model has no nn.ModuleList of blocks to compile one by one; "
                       "compiling it whole, with a graph break at every ZeRO-3 gather and release")
        module.compile(backend=backend, **compile_kwargs)
        return [module]
    parameter_offload.set_fetch_units(blocks)
    for block in blocks:
        # The instance attribute shadows the class's forward; __call__ and its hooks stay eager.
        block.forward = torch.compile(block.forward, backend=backend, **compile_kwargs)
    return blocks
