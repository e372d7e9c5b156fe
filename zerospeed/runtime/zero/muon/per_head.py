"""`per_head_muon`: which attention projections Newton-Schulz orthogonalizes head by head.

[Note: per-head Muon]
With `"optimizer": {"type": "Muon", "params": {"per_head_muon": true}}` DeepSpeed 0.19.8
(`deepspeed.set_optimizer_flags`, `resolve_per_head_muon_after_sharding`, `original_muon.
_per_head_orthogonalize`) splits an attention projection whose *output* rows are blocked by heads,
`[heads * width, in]`, into `heads` blocks of `width` rows and orthogonalizes each block on its own
(scale `sqrt(max(1, width / in))` per block). Which projections, decided here the same way:

- by the leaf module name (`...self_attn.q_proj.weight` -> `q_proj`, prefix match): query
  `q_proj` / `query` / `wq`; key and value `k_proj` / `key` / `wk` / `v_proj` / `value` / `wv`;
  MLA up-projections `q_b_proj`, `kv_b_proj`. Fused q/k/v (`qkv_proj`, `query_key_value`,
  `c_attn`, `in_proj_qkv`, `wqkv`) and MLA down-projections (`q_a_proj`, `kv_a_proj*`) are never
  split; neither is the output projection (its heads are on the input dim) nor anything else.
- by geometry from the model's HF config (`model.config`, its `text_config` when there is one):
  attention heads (`num_attention_heads`, `num_heads`, `n_heads`, `n_head`, `attention_heads`),
  key/value heads (`num_key_value_heads`, `num_kv_heads`, `multi_query_group_num`, `n_head_kv`,
  `kv_n_heads`, then the attention-head names), `head_dim` (else `hidden_size / heads`), and the
  MLA widths `qk_nope_head_dim + qk_rope_head_dim` (query) and `qk_nope_head_dim + v_head_dim`
  (kv). A candidate (heads, width) counts only when `rows == heads * width` exactly; candidates
  disagreeing on the head count leave the matrix whole. A module whose class is a listed linear
  attention (`KimiDeltaAttention`) gives its own counts and widths instead of the config's.
- `per_head_muon: true` with no projection resolved is an error (nothing would change); one that
  matched a name but no geometry is warned about and stays whole.

Each parameter gets DeepSpeed's attributes: `muon_num_heads` (its heads as held, None when not
split) and `muon_head_dim` (the block height, which survives a tensor-parallel split). zerospeed
resolves after AutoTP on the *joined* shape and orthogonalizes the joined matrix head by head
([Note: Muon with AutoTP] in tp_matrices.py), which equals DeepSpeed's per-shard step whenever each
shard holds whole heads; a shard that cuts a head DeepSpeed orthogonalizes as one matrix (see
docs/compatibility.md), zerospeed still head by head.
"""

from __future__ import annotations

from typing import Any

import torch

from zerospeed.utils.logging import logger

__all__ = ["NOT_HEAD_BLOCKED", "head_geometry", "resolve_head_count", "tag_per_head"]

QUERY, KV, MLA_Q, MLA_KV, NOT_HEAD_BLOCKED = "query", "kv", "mla_q", "mla_kv", "not-head-blocked"
_QUERY_LEAVES = ("q_proj", "query", "wq")
_KV_LEAVES = ("k_proj", "key", "wk", "v_proj", "value", "wv")
_VALUE_LEAVES = ("v_proj", "value", "wv")
_MLA_Q_LEAVES, _MLA_KV_LEAVES = ("q_b_proj",), ("kv_b_proj",)
_WHOLE_LEAVES = ("qkv_proj", "query_key_value", "c_attn", "in_proj_qkv", "wqkv",   # fused q/k/v
                 "q_a_proj", "kv_a_proj", "kv_a_proj_with_mqa")                    # MLA down-projections
_ATTENTION_HEADS = ("num_attention_heads", "num_heads", "n_heads", "n_head", "attention_heads")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "multi_query_group_num", "n_head_kv", "kv_n_heads",
             "num_attention_heads", "n_heads", "attention_heads")
# Linear-attention modules whose own attributes, not the config, give the q/k/v geometry.
_LINEAR_ATTENTION = ("KimiDeltaAttention",)
_OWNER_COUNTS = {"q": ("num_heads", "num_attention_heads", "n_heads"),
                 "k": ("num_k_heads", "num_key_value_heads", "num_kv_heads", "num_heads", "num_attention_heads",
                       "n_heads")}
_OWNER_COUNTS["v"] = ("num_v_heads", *_OWNER_COUNTS["k"])
_OWNER_WIDTHS = {"q": ("head_k_dim", "head_dim", "head_size"), "k": ("head_k_dim", "head_dim", "head_size"),
                 "v": ("head_v_dim", "head_dim", "head_size")}

Candidate = tuple[int, int, str]   # (heads, width, where from)


def _leaf(name: str) -> str:
    parts = name.split(".")
    return parts[-2].lower() if len(parts) >= 2 else parts[-1].lower()


def _kind(leaf: str) -> str | None:
    for leaves, kind in ((_WHOLE_LEAVES, NOT_HEAD_BLOCKED), (_MLA_Q_LEAVES, MLA_Q), (_MLA_KV_LEAVES, MLA_KV),
                         (_KV_LEAVES, KV), (_QUERY_LEAVES, QUERY)):
        if any(leaf.startswith(prefix) for prefix in leaves):
            return kind
    return None


def _first(source: Any, names: tuple[str, ...]) -> Any:
    for name in names:
        value = getattr(source, name, None)
        if value is not None:
            return value
    return None


def _positive_int(source: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(source, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
    return None


def head_geometry(model: torch.nn.Module) -> Any:
    """The config the head counts come from (`text_config` when present), or None without one or
    without an attention-head count."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    text = getattr(config, "text_config", None) or config
    return text if _first(text, _ATTENTION_HEADS) is not None else None


def _config_candidates(kind: str, text: Any) -> list[Candidate]:
    heads = _first(text, _ATTENTION_HEADS)
    kv_heads = _first(text, _KV_HEADS) or heads
    head_dim = getattr(text, "head_dim", None)
    hidden = getattr(text, "hidden_size", None)
    if head_dim is None and hidden is not None and heads and hidden % heads == 0:
        head_dim = hidden // heads
    nope, rope, v_dim = (getattr(text, key, None) for key in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    found: list[Candidate] = []
    if kind in (QUERY, MLA_Q) and nope is not None and rope is not None:
        found.append((heads, nope + rope, "mla-q"))
    if kind == MLA_KV and nope is not None and v_dim is not None:
        found.append((heads, nope + v_dim, "mla-kv"))
    if kind == QUERY and head_dim is not None:
        found.append((heads, head_dim, "head-dim"))
    if kind == KV and head_dim is not None:
        found.append((kv_heads, head_dim, "head-dim"))
    return [c for c in found if c[0] and c[0] >= 1 and c[1] and c[1] >= 1]


def _owner_candidates(kind: str, leaf: str, owner: Any) -> list[Candidate]:
    if owner is None or kind not in (QUERY, KV) or type(owner).__name__ not in _LINEAR_ATTENTION:
        return []
    role = "q" if kind == QUERY else "v" if any(leaf.startswith(v) for v in _VALUE_LEAVES) else "k"
    heads, width = _positive_int(owner, _OWNER_COUNTS[role]), _positive_int(owner, _OWNER_WIDTHS[role])
    return [(heads, width, f"owner-{role}")] if heads and width else []


def resolve_head_count(name: str, shape: tuple[int, ...], text: Any, owner: Any = None) -> tuple[int | None, str]:
    """(heads the whole matrix `name` of layer `shape` splits into on dim 0, or None; the reason)."""
    leaf = _leaf(name)
    kind = _kind(leaf)
    if kind is None:
        return None, "not-attention"
    if kind == NOT_HEAD_BLOCKED:
        return None, NOT_HEAD_BLOCKED
    candidates = _owner_candidates(kind, leaf, owner) or _config_candidates(kind, text)
    if len(shape) != 2:
        return None, "not-2d"
    if not candidates:
        return None, "no-candidate-geometry"
    exact = [c for c in candidates if shape[0] == c[0] * c[1]]
    if not exact:
        return None, "width-mismatch"
    if len({c[0] for c in exact}) > 1:
        return None, "ambiguous:" + "/".join(f"{c[2]}={c[0]}" for c in sorted(exact, key=lambda c: c[2]))
    return exact[0][0], exact[0][2]


def _whole_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The layer shape as one matrix: `ds_shape` under zero.Init, joined over AutoTP's shards."""
    from zerospeed.runtime.zero.muon.tp_matrices import full_shape

    ds_shape = getattr(param, "ds_shape", None)
    shape = tuple(param.shape) if ds_shape is None else tuple(ds_shape)
    shard = getattr(param, "ds_tp_shard", None)
    return shape if shard is None else full_shape(shape, shard)


def tag_per_head(module: torch.nn.Module, per_head: bool) -> None:
    """Set `muon_num_heads` / `muon_head_dim` on every parameter (None unless split by heads)."""
    text = head_geometry(module) if per_head else None
    owners = dict(module.named_modules()) if per_head else {}
    tagged: dict[str, str] = {}
    skipped: dict[str, str] = {}
    for name, param in module.named_parameters():
        heads = None
        shape = _whole_shape(param)
        if per_head and text is not None and getattr(param, "use_muon", False):
            heads, reason = resolve_head_count(name, shape, text, owners.get(name.rsplit(".", 2)[0]))
            (tagged if heads is not None else skipped)[_leaf(name)] = \
                f"{heads} heads of {shape[0] // heads} ({reason})" if heads is not None else reason
        width = shape[0] // heads if heads else None
        held_rows = int(getattr(param, "ds_shape", param.shape)[0])   # a tp shard's own rows
        param.muon_head_dim = width   # type: ignore[attr-defined]
        # DeepSpeed's count after sharding: the shard's heads, None when it cuts one.
        param.muon_num_heads = held_rows // width if width and held_rows % width == 0 else None  # type: ignore[attr-defined]
    if per_head:
        _report(tagged, skipped)


def _report(tagged: dict[str, str], skipped: dict[str, str]) -> None:
    if not tagged:
        raise ValueError("optimizer.params.per_head_muon is true but no attention projection could be split by "
                         "heads, so it would change nothing: the model has no HF config with a head count "
                         "(model.config), its attention leaves are not recognised, or none matches the config's "
                         f"geometry. Remove per_head_muon to train without it. Leaves examined: {skipped or 'none'}")
    unresolved = {leaf: why for leaf, why in skipped.items() if why not in (NOT_HEAD_BLOCKED, "not-attention")}
    if unresolved:
        logger.warning("per_head_muon: %s matched an attention name but no geometry; orthogonalized whole", unresolved)
    logger.info("per_head_muon: split by heads %s", dict(sorted(tagged.items())))
