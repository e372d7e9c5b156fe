"""Which linear layer is split how: the AutoTP partition plan, pure data over module names.

[Note: AutoTP naming rules]
A column-parallel layer splits its output features over the tensor-parallel ranks (its input is
replicated, its output sharded); a row-parallel layer splits its input features (its input is
sharded, its output is summed over the ranks). In a transformer block every projection that
*leaves* a sharded region is row-parallel — attention's output projection (``o_proj``,
``out_proj``, ``attention.dense``, GPT-2's ``attn.c_proj``) and the MLP's down projection
(``down_proj``, ``fc2``, ``dense_4h_to_h``, ``w2``, GPT-2's ``mlp.c_proj``) — and every other
linear in the block is column-parallel (``q/k/v_proj``, ``gate_proj``, ``up_proj``, ``fc1``...).
These are DeepSpeed's AutoTP rules. The rules, in order of precedence:

1. ``partition_config.layer_specs`` (regexes over parameter names, first match wins);
2. the Hugging Face model's own ``tp_plan`` (``base_model_tp_plan`` of its config and the class's
   ``_tp_plan``), as DeepSpeed 0.19.8 prefers it over its heuristics;
3. the name rules above, for linears inside repeated blocks (an ``nn.ModuleList``);
4. the output head (``lm_head``, ``embed_out``) is column-parallel with its output gathered,
   unless it shares its weight with the input embedding (then it stays replicated);
5. everything else stays replicated.

Fused projections are split part by part so every rank holds whole heads: GPT-2's ``c_attn``
([Q|K|V], three equal parts) and ``gate_up_proj`` ([gate|up], two). A fused layout we cannot
read for certain (``query_key_value``, ``qkv_proj``, ``W_pack``...) is an error naming the layer,
never a guess; ``partition_config`` with ``"partition_type": "skip"`` keeps it replicated.

[Note: head-major fused projections]
Some fused ``query_key_value`` layers are laid out head by head: GPT-NeoX's output features are
[head 0: q k v | head 1: q k v | ...], Falcon's (``new_decoder_architecture``) are [kv group 0: q..q
k v | group 1: ...] and Falcon's without multi-query attention [head 0: q k v | ...]. A plain
column split then hands each rank whole heads (whole kv groups), so these are column-parallel with
one part. GPT-NeoX's Hugging Face tp_plan says so itself; Falcon has none, so `hf_tp_plan` adds
it (`_builtin_plan`). Falcon with multi-query attention (one k and v head shared by all) cannot
be split and keeps the error above.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["LayerInfo", "Partition", "Style", "build_plan", "hf_tp_plan"]


class Style(enum.Enum):
    COLUMN = "column"
    ROW = "row"
    SKIP = "skip"


@dataclasses.dataclass(frozen=True)
class Partition:
    """How one layer is split: the style, how many equal fused parts its output holds, whether
    a column-parallel layer's output is all-gathered back to full width."""

    style: Style
    fused_parts: int = 1
    gather_output: bool = False


@dataclasses.dataclass(frozen=True)
class LayerInfo:
    """What the plan needs to know about one linear-like module."""

    name: str            # qualified module name, e.g. "model.layers.0.self_attn.q_proj"
    in_block: bool       # inside a repeated block (a child of an nn.ModuleList)
    tied: bool = False   # its weight is shared with another module (a tied output head)


SKIP = Partition(Style.SKIP)
_ROW_LEAVES = {"o_proj", "out_proj", "down_proj", "dense_4h_to_h", "fc2", "fc_out", "w2", "wo"}
_ROW_SUFFIXES = ("attention.dense", "attn.dense", "attn.c_proj", "mlp.c_proj")
_NEVER_SPLIT = ("mlp.gate", "block_sparse_moe.gate", "q_a_proj", "kv_a_proj_with_mqa")
_FUSED = {"c_attn": 3, "gate_up_proj": 2}
_UNREADABLE_FUSED = {"query_key_value", "qkv_proj", "W_pack", "Wqkv", "qkv"}
_HEADS = ("lm_head", "embed_out")
_HF_STYLES = {"colwise": Partition(Style.COLUMN), "local_colwise": Partition(Style.COLUMN),
              "rowwise": Partition(Style.ROW), "local_rowwise": Partition(Style.ROW),
              "colwise_gather_output": Partition(Style.COLUMN, gather_output=True),
              "colwise_rep": Partition(Style.COLUMN, gather_output=True),
              "packed_colwise": Partition(Style.COLUMN, fused_parts=2)}


def _by_name(layer: LayerInfo) -> Partition:
    leaf = layer.name.rsplit(".", 1)[-1]
    if leaf in _HEADS and not layer.in_block:
        return SKIP if layer.tied else Partition(Style.COLUMN, gather_output=True)
    if not layer.in_block or layer.name.endswith(_NEVER_SPLIT):
        return SKIP
    if leaf in _UNREADABLE_FUSED:
        raise ValueError(f"AutoTP: {layer.name} is a fused projection whose layout zerospeed cannot read for "
                         "certain; keep it replicated with tensor_parallel.partition_config "
                         f'{{"layer_specs": [{{"patterns": [".*{leaf}.*"], "partition_type": "skip"}}]}}')
    if leaf in _FUSED:
        return Partition(Style.COLUMN, fused_parts=_FUSED[leaf])
    if leaf in _ROW_LEAVES or layer.name.endswith(_ROW_SUFFIXES):
        return Partition(Style.ROW)
    return Partition(Style.COLUMN)


def _compile_hf_plan(plan: Mapping[str, str]) -> list[tuple[re.Pattern[str], str]]:
    # HF patterns use "*" for one path component (a layer index) and are relative to the model.
    return [(re.compile(r"(^|.*\.)" + re.escape(pattern).replace(r"\*", r"[^.]+") + "$"), style)
            for pattern, style in plan.items()]


def _from_hf_plan(layer: LayerInfo, compiled: list[tuple[re.Pattern[str], str]]) -> Partition | None:
    for pattern, style in compiled:
        if pattern.match(layer.name):
            if layer.tied:
                return SKIP
            return _HF_STYLES.get(style.lower(), SKIP)
    return None


def _spec_partition(spec: Mapping[str, Any], name: str) -> Partition:
    if spec.get("shape") is not None or spec.get("partition_dim") is not None:
        raise ValueError(f"tensor_parallel.partition_config: 'shape'/'partition_dim' (matched by {name}) are "
                         "not implemented in zerospeed; split fused layers into separate linears or skip them")
    kind = str(spec.get("partition_type", "column")).lower()
    if kind not in {s.value for s in Style}:
        raise ValueError(f"tensor_parallel.partition_config: partition_type {kind!r} must be row, column or skip")
    return Partition(Style(kind), gather_output=bool(spec.get("gather_output", False)))


def _from_specs(layer: LayerInfo, specs: Sequence[Mapping[str, Any]]) -> Partition | None:
    param_name = f"{layer.name}.weight"
    for spec in specs:
        if any(re.match(pattern, param_name) for pattern in spec.get("patterns", [])):
            return _spec_partition(spec, param_name)
    return None


def build_plan(layers: Sequence[LayerInfo], hf_plan: Mapping[str, str] | None = None,
               partition_config: Mapping[str, Any] | None = None) -> dict[str, Partition]:
    """Every layer's partition ([Note: AutoTP naming rules]); SKIP where it stays replicated."""
    specs = list((partition_config or {}).get("layer_specs", []))
    use_defaults = bool((partition_config or {}).get("use_default_specs", True))
    compiled = _compile_hf_plan(hf_plan or {})
    plan: dict[str, Partition] = {}
    for layer in layers:
        chosen = _from_specs(layer, specs)
        if chosen is None and use_defaults:
            chosen = _from_hf_plan(layer, compiled) if compiled else None
            chosen = chosen if chosen is not None else _by_name(layer)
        plan[layer.name] = chosen or SKIP
    return plan


def _builtin_plan(config: Any) -> dict[str, str]:
    """Rules for architectures whose Hugging Face config carries no tp_plan ([Note: head-major
    fused projections])."""
    if getattr(config, "model_type", None) == "falcon" and (
            getattr(config, "new_decoder_architecture", False) or not getattr(config, "multi_query", True)):
        return {"h.*.self_attention.query_key_value": "colwise"}
    return {}


def hf_tp_plan(model: Any) -> dict[str, str]:
    """The model's Hugging Face tensor-parallel plan: its config's ``base_model_tp_plan`` merged
    with the class's and instance's ``_tp_plan`` (empty for a model without one), after the
    built-in rules for architectures without one."""
    config = getattr(model, "config", None)
    merged: dict[str, str] = _builtin_plan(config)
    for plan in (getattr(config, "base_model_tp_plan", None), getattr(type(model), "_tp_plan", None),
                 vars(model).get("_tp_plan")):
        if isinstance(plan, dict):
            merged.update({pattern: str(style) for pattern, style in plan.items()})
    return merged
