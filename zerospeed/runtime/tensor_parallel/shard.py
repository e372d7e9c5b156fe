"""Apply the AutoTP plan to a model: replace its linear layers by tensor-parallel ones, in place.

The model must hold the same full weights on every rank before this runs (the engine broadcasts
them first); each rank then keeps its own piece. Attention modules whose projections were split
also get their per-module head counts and widths divided (``num_heads``, ``embed_dim``,
``split_size``...), since a Hugging Face attention reshapes its activations with them.
"""

from __future__ import annotations

from typing import Any

import torch

from zerospeed import comm
from zerospeed.runtime.tensor_parallel.layers import LinearAllreduce, LinearLayer, SharedInputCopy
from zerospeed.runtime.tensor_parallel.plan import LayerInfo, Partition, Style, build_plan, hf_tp_plan

__all__ = ["apply_autotp", "is_tensor_parallel_param", "linear_layers"]

# Per-module attributes that count heads or features of the local shard (DeepSpeed's list, plus
# GPT-2's split_size). head_dim is per head and stays.
_LOCAL_ATTRS = ("n_heads", "inner_dim", "num_heads", "num_kv", "num_attention_heads", "num_attn_heads",
                "all_head_size", "embed_dim", "hidden_size", "num_key_value_heads", "num_kv_heads",
                "kv_n_heads", "d_model", "split_size")
_HEAD_COUNTS = ("num_attention_heads", "num_key_value_heads", "num_kv_heads", "n_head")


def _is_conv1d(module: torch.nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def linear_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, LayerInfo]]:
    """(name, module, info) of every nn.Linear and Hugging Face Conv1D, in module order."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    in_block = {name for name, module in model.named_modules() if isinstance(module, torch.nn.ModuleList)}
    found = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) or _is_conv1d(module):
            inside = any(name.startswith(block + ".") for block in in_block)
            tied = owners.get(id(module.weight), 0) > 1
            found.append((name, module, LayerInfo(name, inside, tied)))
    return found


def _check_heads(model: torch.nn.Module, tp_size: int) -> None:
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    if getattr(config, "alibi", False) or getattr(config, "model_type", None) == "bloom":
        # The ALiBi bias is built per head from the model's total head count; each rank would add
        # the first heads' slopes to its own heads.
        raise ValueError("AutoTP: models with ALiBi attention biases (BLOOM, Falcon with alibi=True) are not "
                         "supported: their per-head biases are not split with the heads")
    for key in _HEAD_COUNTS:
        count = getattr(config, key, None)
        if isinstance(count, int) and count % tp_size:
            raise ValueError(f"AutoTP: the model's {key} ({count}) is not divisible by "
                             f"tensor_parallel.autotp_size ({tp_size}); every rank must hold whole heads")


def _replacement(module: torch.nn.Module, partition: Partition, group: Any,
                 shared_input: SharedInputCopy) -> torch.nn.Module:
    transposed = _is_conv1d(module)
    if partition.style is Style.ROW:
        return LinearAllreduce(module, group, transposed=transposed)
    return LinearLayer(module, group, transposed=transposed, fused_parts=partition.fused_parts,
                       gather_output=partition.gather_output, shared_input=shared_input)


def _localize_attributes(parent: torch.nn.Module, tp_size: int) -> None:
    for attr in _LOCAL_ATTRS:
        value = getattr(parent, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value % tp_size == 0:
            setattr(parent, attr, value // tp_size)


def apply_autotp(model: torch.nn.Module, group: Any, partition_config: dict[str, Any] | None = None) -> dict[str, Partition]:
    """Shard ``model`` over ``group``; returns the plan (name -> partition, SKIP where replicated)."""
    tp_size = comm.get_world_size(group)
    _check_heads(model, tp_size)
    layers = linear_layers(model)
    plan = build_plan([info for _, _, info in layers], hf_tp_plan(model), partition_config)
    parents_split: dict[str, torch.nn.Module] = {}
    shared_input = SharedInputCopy()   # this model's ([Note: one all-reduce per shared input])
    for name, module, _ in layers:
        partition = plan[name]
        if partition.style is Style.SKIP:
            continue
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, leaf, _replacement(module, partition, group, shared_input))
        if not partition.gather_output:
            parents_split[parent_name] = parent
    for parent in parents_split.values():
        _localize_attributes(parent, tp_size)
    setattr(model, "ds_autotp_parsed", True)  # noqa: B010  DeepSpeed's marker: this model is sharded
    return plan


def is_tensor_parallel_param(param: torch.Tensor) -> bool:
    """Whether ``param`` is one rank's piece of a split parameter (DeepSpeed's flag)."""
    return bool(getattr(param, "tensor_model_parallel", False))
