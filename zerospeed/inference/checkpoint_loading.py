"""`init_inference(checkpoint=...)`: each rank reads only its own slices, straight into its shards.

Sources, as DeepSpeed's AutoTP accepts them plus Hugging Face's layout:

* a checkpoint description, a dict or a JSON file: ``{"type": "ds_model" | "bloom",
  "checkpoints": [file, ...], "version": 1.0}``, the files relative to ``base_dir`` (the config
  key; else the description's own ``base_dir``; else the JSON file's directory);
* a directory of Hugging Face weights: ``model.safetensors`` or the shards named by
  ``model.safetensors.index.json``;
* a single ``.safetensors`` / ``.pt`` / ``.bin`` file.

[Note: reading slices, not copies]
The model is cut first (its parameters may be on the meta device: no memory at all), so every
parameter knows which piece of the full tensor it holds (its `TPShard`). A ``.safetensors``
tensor is read slice by slice with plain file reads (safetensors_slices.py, which says why not
``safe_open``): only this rank's rows or columns are copied out of the file, one tensor at a time. A torch file is memory-mapped (``torch.load(mmap=True)``) and
sliced the same way. So a rank's private memory grows by its shards, never by a whole copy of
the model. A parameter nothing loaded that is still on the meta device is an error naming it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from zerospeed.inference.safetensors_slices import SafetensorsSlices
from zerospeed.runtime.tensor_parallel.layers import TPShard
from zerospeed.utils.logging import logger

__all__ = ["checkpoint_files", "load_into_shards", "slice_index"]

_INDEX = "model.safetensors.index.json"
_SUPPORTED_TYPES = ("ds_model", "bloom")


def _from_description(description: dict[str, Any], base_dir: str, default_dir: str) -> list[str]:
    for key in ("type", "checkpoints"):
        if key not in description:
            raise ValueError(f"init_inference checkpoint description: missing key '{key}' "
                             "(expected {'type': 'ds_model', 'checkpoints': [...], 'version': 1.0})")
    kind = str(description["type"]).lower()
    if kind not in _SUPPORTED_TYPES:
        raise ValueError(f"init_inference checkpoint description: type {description['type']!r} is not supported "
                         f"(zerospeed reads {', '.join(_SUPPORTED_TYPES)}: whole, unsharded tensors)")
    names = description["checkpoints"]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError("init_inference checkpoint description: 'checkpoints' must be a list of file names "
                         "(per-tp-rank Megatron layouts are not supported)")
    root = base_dir or description.get("base_dir") or default_dir
    return [os.path.join(root, name) for name in names]


def _from_directory(directory: str) -> list[str]:
    index = os.path.join(directory, _INDEX)
    if os.path.isfile(index):
        with open(index) as handle:
            weight_map = json.load(handle).get("weight_map", {})
        return [os.path.join(directory, name) for name in dict.fromkeys(weight_map.values())]
    single = os.path.join(directory, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise ValueError(f"init_inference checkpoint: directory {directory!r} holds neither {_INDEX} nor model.safetensors")


def checkpoint_files(source: str | dict[str, Any], base_dir: str = "") -> list[str]:
    """The weight files ``source`` names, in order; each must exist."""
    if isinstance(source, dict):
        files = _from_description(source, base_dir, os.getcwd())
    elif os.path.isdir(source):
        files = _from_directory(source)
    elif source.endswith(".json"):
        if not os.path.isfile(source):
            raise ValueError(f"init_inference checkpoint: {source!r} does not exist")
        with open(source) as handle:
            files = _from_description(json.load(handle), base_dir, os.path.dirname(os.path.abspath(source)))
    else:
        files = [os.path.join(base_dir, source) if base_dir else source]
    missing = [path for path in files if not os.path.isfile(path)]
    if missing:
        raise ValueError(f"init_inference checkpoint: file {missing[0]!r} does not exist")
    return files


def slice_index(shape: tuple[int, ...], shard: TPShard) -> list[tuple[slice, ...]]:
    """The index of this rank's piece in a full tensor of ``shape``: one per fused part (pure)."""
    part_len = shape[shard.dim] // shard.fused_parts
    piece = part_len // shard.tp_size
    indexes = []
    for part in range(shard.fused_parts):
        start = part * part_len + shard.tp_rank * piece
        index = [slice(None)] * len(shape)
        index[shard.dim] = slice(start, start + piece)
        indexes.append(tuple(index))
    return indexes


Reader = Callable[[tuple[slice, ...] | None], torch.Tensor]


def _safetensors_tensors(path: str) -> Iterator[tuple[str, tuple[int, ...], Reader]]:
    with SafetensorsSlices(path) as handle:   # [Note: why not safe_open]
        for key in list(handle.keys()):
            def read(index: tuple[slice, ...] | None, key: str = key) -> torch.Tensor:
                return handle.read(key, index)
            yield key, handle.shape(key), read


def _torch_tensors(path: str) -> Iterator[tuple[str, tuple[int, ...], Reader]]:
    state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    if isinstance(state, dict) and ("module" in state or "model" in state) and not torch.is_tensor(
            state.get("module", state.get("model"))):
        state = state.get("module", state.get("model"))
    for key, tensor in state.items():
        if torch.is_tensor(tensor):
            def read(index: tuple[slice, ...] | None, tensor: torch.Tensor = tensor) -> torch.Tensor:
                return (tensor if index is None else tensor[index]).clone()   # copies out of the mapped file
            yield key, tuple(tensor.shape), read


def _tensors(path: str) -> Iterator[tuple[str, tuple[int, ...], Reader]]:
    return _safetensors_tensors(path) if path.endswith(".safetensors") else _torch_tensors(path)


def _read(shape: tuple[int, ...], read: Reader, shard: TPShard | None, name: str) -> torch.Tensor:
    if shard is None:
        return read(None)
    if shape[shard.dim] % (shard.fused_parts * shard.tp_size):
        raise ValueError(f"init_inference checkpoint: {name} has shape {list(shape)}, which does not split "
                         f"into {shard.fused_parts} part(s) x {shard.tp_size} ranks along dim {shard.dim}")
    pieces = [read(index) for index in slice_index(shape, shard)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=shard.dim)


class _Targets:
    """Every parameter and persistent buffer by state-dict name, with all the places that hold it
    (a tied weight has two), so a loaded tensor replaces the object everywhere at once."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.owners: dict[int, list[tuple[torch.nn.Module, str, bool]]] = {}
        self.names: dict[int, list[str]] = {}
        self.by_name: dict[str, torch.Tensor] = {}
        for module_name, module in model.named_modules(remove_duplicate=False):
            prefix = f"{module_name}." if module_name else ""
            persistent = set(module._buffers) - set(getattr(module, "_non_persistent_buffers_set", ()))
            holders = [(n, t, True) for n, t in module._parameters.items()]
            holders += [(n, t, False) for n, t in module._buffers.items() if n in persistent]
            for leaf, tensor, is_param in holders:
                if tensor is None:
                    continue
                self.by_name[prefix + leaf] = tensor
                self.names.setdefault(id(tensor), []).append(prefix + leaf)
                owners = self.owners.setdefault(id(tensor), [])
                if (module, leaf, is_param) not in owners:
                    owners.append((module, leaf, is_param))

    def assign(self, old: torch.Tensor, value: torch.Tensor) -> None:
        new = value.to(dtype=old.dtype)
        if isinstance(old, torch.nn.Parameter):
            new = torch.nn.Parameter(new, requires_grad=old.requires_grad)
            for attr in ("ds_tp_shard", "tensor_model_parallel"):
                if hasattr(old, attr):
                    setattr(new, attr, getattr(old, attr))
        for module, leaf, is_param in self.owners[id(old)]:
            if is_param:
                module._parameters[leaf] = new  # type: ignore[assignment]  # a Parameter, built above
            else:
                module._buffers[leaf] = new
        self.owners[id(new)], self.names[id(new)] = self.owners.pop(id(old)), self.names.pop(id(old))
        for name in self.names[id(new)]:
            self.by_name[name] = new


def load_into_shards(model: torch.nn.Module, files: list[str]) -> None:
    """Fill ``model`` (already cut) from ``files``: this rank's slice of every tensor it holds
    ([Note: reading slices, not copies])."""
    targets = _Targets(model)
    unused = 0
    for path in files:
        for key, shape, read in _tensors(path):
            old = targets.by_name.get(key)
            if old is None:
                unused += 1
                continue
            value = _read(shape, read, getattr(old, "ds_tp_shard", None), key)
            expected = tuple(old.shape)
            if tuple(value.shape) != expected:
                raise ValueError(f"init_inference checkpoint: {key} in {path} has shape {list(shape)}; this rank "
                                 f"expects {list(expected)} for its piece")
            targets.assign(old, value)
    _check_complete(model, unused)


def _check_complete(model: torch.nn.Module, unused: int) -> None:
    on_meta = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if tensor.is_meta]
    if on_meta:
        raise ValueError(f"init_inference checkpoint: {on_meta[0]} (and {len(on_meta) - 1} more) was not in the "
                         "checkpoint and is still on the meta device; build the model with its buffers "
                         "materialized (accelerate.init_empty_weights() keeps buffers real)")
    if unused:
        logger.warning(f"init_inference checkpoint: {unused} tensor(s) in the checkpoint match no parameter")
