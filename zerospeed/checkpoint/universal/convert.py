"""A ZeRO checkpoint (zerospeed's or DeepSpeed's, stage 1-3) converted to DeepSpeed's universal folder.

[Note: streaming conversion]
DeepSpeed's `ds_to_universal` loads every rank's optim file whole, writes every parameter's
fragments to a temporary folder and merges them. Here nothing is written twice and the model is
never held at once: the parameters are taken in flat order, in chunks of about `chunk_bytes` of
fp32 state (at least one parameter), and for each chunk every rank's optim file is opened with
mmap and cut down to the chunk's parameters (stage 1/2: its `param_slice_mappings`; stage 3: a
window of its flat groups), then read by the same exporters a resharded load uses
(full_state.py `export_zero12` / `export_zero3`). A chunk is read in one pass per state: the fp32
masters first, then each per-element optimizer state (`exp_avg`, `exp_avg_sq`, ...) in turn, given
to the exporters in the masters' place, so they merge it by the same layout rules while only one
state of the chunk is ever materialised. The files are re-opened for every pass so the pages the
previous pass touched are unmapped: peak memory is about one state of one chunk plus its input
pages, not the model (and not the three states of its largest parameter at once). The folder is
written crash-safe ([Note: atomic universal folder]).
With model parallelism every chunk is read from each mp rank's files and combined (source.py:
AutoTP pieces joined, pipeline stages united); an MoE checkpoint is read whole instead, its
experts renamed by global id.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import Any

import torch

from zerospeed.checkpoint import constants as C
from zerospeed.checkpoint.atomic import crash_point
from zerospeed.checkpoint.deepspeed_format import zero_state_for_deepspeed
from zerospeed.checkpoint.full_state import FullOptimizerState, export_zero3, export_zero12
from zerospeed.checkpoint.manifest import load_file
from zerospeed.checkpoint.tp_pieces import join_pieces
from zerospeed.checkpoint.universal.folder import UniversalFolderWriter
from zerospeed.checkpoint.universal.layout import (CAT_DIM, FP32, OPTIMIZER_STATE_FILE, PARAM, STEP,
                                                   UNIVERSAL_CHECKPOINT_INFO, ZERO_DIR, state_file)
from zerospeed.checkpoint.universal.source import CheckpointSource, checkpoint_source
from zerospeed.checkpoint.zero_checkpoint import SavedLayout, export_full_state

__all__ = ["CHUNK_BYTES", "convert_to_universal"]

CHUNK_BYTES = 64 * 2**20
_SHARDED_KEYS = (C.BASE_OPTIMIZER_STATE, C.PARAM_SLICE_MAPPINGS, C.SINGLE_PARTITION_OF_FP32_GROUPS,
                 C.FP32_FLAT_GROUPS, C.OPTIMIZER_STATE_DICT)


def convert_to_universal(input_folder: str, output_folder: str, strict: bool = True,
                         inject_missing_state: bool = False, chunk_bytes: int = CHUNK_BYTES) -> None:
    """Write the universal folder of the tag directory `input_folder` to `output_folder`, and
    `latest_universal` beside it (DeepSpeed's `ds_to_universal.main`). An AutoTP checkpoint's
    split parameters are joined from every tp rank ([Note: streaming conversion])."""
    source = checkpoint_source(input_folder)
    zero_stage = source.saved[0].zero_stage
    if zero_stage <= 2 and source.model_states[0].get(UNIVERSAL_CHECKPOINT_INFO) is None and not inject_missing_state:
        raise ValueError(f"Required {UNIVERSAL_CHECKPOINT_INFO} state is missing in checkpoint "
                         f"{source.model_files[0]}: pass --inject_missing_state (DeepSpeed's converter requires the same)")
    shapes = source.full_shapes()
    writer = UniversalFolderWriter(output_folder).begin()
    try:
        first = True
        # not enumerate(): its reused result tuple would keep the previous state alive while the
        # generator reads the next one
        for chunk, key, full in _full_states(source, shapes, chunk_bytes):
            # a scalar (the step) is a view of its mmap'd file and would keep every page this chunk
            # touched mapped while the chunk is written: own it, so the inputs unmap here
            full.scalars = {name: {k: _owned(v) if torch.is_tensor(v) else v for k, v in values.items()}
                            for name, values in full.scalars.items()}
            _write_params(writer, full, chunk, key, shapes, strict, source.record)
            del full
            if first:
                crash_point("universal_mid_params")
                first = False
        if zero_stage <= 2:   # as DeepSpeed: frozen params and buffers too, from the module
            _write_module_entries(writer, source, shapes)
        writer.save(os.path.join(ZERO_DIR, OPTIMIZER_STATE_FILE), _optimizer_state(source.saved[0]),
                    deepspeed_names=True)
        for path in source.model_files:
            writer.copy(path, os.path.basename(path))
        writer.commit()
    except BaseException:
        writer.abort()
        raise


def _full_states(source: CheckpointSource, shapes: dict[str, torch.Size],
                 chunk_bytes: int) -> Iterator[tuple[list[str], str | None, FullOptimizerState]]:
    """The whole model's state a chunk and a state at a time: `(chunk, None, full)` carries the
    masters in `full.fp32` (and the scalars), `(chunk, key, full)` the per-element state `key` in
    `full.fp32`. An MoE checkpoint is read whole, through the resharded load's exporter, which names
    each expert by its global id ([Note: MoE stage-3 reshard]): its partitions follow per-parameter
    group sizes the chunk windows do not model."""
    if source.moe:
        full = export_full_state(source.saved[0], source.model_states[0])
        shapes.update({name: value.shape for name, value in full.fp32.items()})
        yield list(full.fp32), None, full
        return
    keys = _per_element_keys(source.saved[0])
    for chunk in _chunks(shapes, chunk_bytes):
        for key in (None, *keys):
            yield chunk, key, source.combine([_export_chunk(saved, model_state, chunk, key)
                                              for saved, model_state in zip(source.saved, source.model_states)])


def _per_element_keys(saved: SavedLayout) -> list[str]:
    """The optimizer's per-element states (Adam's two moments, a momentum buffer), from rank 0."""
    state = load_file(saved.optim_files[0], mmap=True)[C.OPTIMIZER_STATE_DICT]
    base = state[C.BASE_OPTIMIZER_STATE] if saved.zero_stage <= 2 else state[C.OPTIMIZER_STATE_DICT]
    keys: list[str] = []
    for entry in base["state"].values():
        keys += [key for key, value in entry.items() if torch.is_tensor(value) and value.dim() >= 1 and key not in keys]
    return keys


def _one_state(entry: dict[str, Any], numel: int) -> dict[str, Any]:
    """An optimizer state entry without its per-element tensors (the scalars stay)."""
    return {key: value for key, value in entry.items()
            if not (torch.is_tensor(value) and value.dim() >= 1 and value.numel() == numel)}


def _chunks(shapes: dict[str, torch.Size], chunk_bytes: int) -> Iterator[list[str]]:
    """Runs of parameters in flat order holding about `chunk_bytes` of fp32 value and two moments."""
    chunk: list[str] = []
    size = 0
    for name, shape in shapes.items():
        numel_bytes = 3 * 4 * math.prod(shape)
        if chunk and size + numel_bytes > chunk_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append(name)
        size += numel_bytes
    if chunk:
        yield chunk


def _export_chunk(saved: SavedLayout, model_state: dict[str, Any], chunk: list[str],
                  key: str | None) -> FullOptimizerState:
    """The chunk's masters (`key` None) or its state `key`, in `fp32` either way."""
    wanted = set(chunk)
    if saved.zero_stage in (1, 2):
        return export_zero12(_zero12_states(saved, wanted, key), model_state[C.PARAM_SHAPES])
    groups = model_state[C.PARAM_SHAPES]
    groups = groups if isinstance(groups, list) else [groups]
    holding = _sub_groups_holding(saved, key)
    windows = [window if held else (0, 0) for window, held in zip(_zero3_windows(groups, wanted, saved.dp_world_size), holding)]
    restricted = [{name: shape for name, shape in group.items() if name in wanted and held}
                  for group, held in zip(groups, holding)]
    return export_zero3(_zero3_states(saved, windows, key), restricted, saved.dp_world_size)


def _sub_groups_holding(saved: SavedLayout, key: str | None) -> list[bool]:
    """Per stage-3 sub-group: does it hold state `key` (the masters, key None, always)?"""
    state = load_file(saved.optim_files[0], mmap=True)[C.OPTIMIZER_STATE_DICT]
    base = state[C.OPTIMIZER_STATE_DICT]
    indices = [index for group in base["param_groups"] for index in group["params"]]
    return [key is None or key in base["state"].get(index, {}) for index in indices[:len(state[C.FP32_FLAT_GROUPS])]]


def _zero12_states(saved: SavedLayout, wanted: set[str], key: str | None) -> Iterator[dict[str, Any]]:
    """Each rank's state with only the chunk's fragments mapped (the tensors stay mmap'd), and only
    one per-element state: the masters, or `key` standing in their place."""
    for path in saved.optim_files:
        state = load_file(path, mmap=True)[C.OPTIMIZER_STATE_DICT]
        mappings = [{name: address for name, address in group.items() if name in wanted}
                    for group in state[C.PARAM_SLICE_MAPPINGS]]
        base = state[C.BASE_OPTIMIZER_STATE]
        leans, cut = list(state[C.SINGLE_PARTITION_OF_FP32_GROUPS]), {}
        for g, lean in enumerate(leans):
            index = base["param_groups"][g]["params"][0]
            entry = base["state"].get(index, {})
            numel = lean.numel() + int(state[C.GROUP_PADDINGS][g])
            if key is not None and key in entry:
                leans[g] = entry[key].reshape(-1).narrow(0, 0, lean.numel())
            elif key is not None:   # a group without this state (Muon's groups beside AdamW's): none of it
                mappings[g] = {}
            cut[index] = _one_state(entry, numel)
        yield {**state, C.PARAM_SLICE_MAPPINGS: mappings, C.SINGLE_PARTITION_OF_FP32_GROUPS: leans,
               C.BASE_OPTIMIZER_STATE: {**base, "state": cut}}


def _zero3_windows(groups: list[dict[str, Any]], wanted: set[str], world: int) -> list[tuple[int, int]]:
    """(offset, numel) per sub-group of the chunk's partitions: the same on every rank, because
    each parameter takes ceil(numel / world) elements of every rank's flat."""
    windows = []
    for group in groups:
        offset, start, end = 0, None, 0
        for name, shape in group.items():
            chunk_numel = -(-math.prod(shape) // world)
            if name in wanted:
                start = offset if start is None else start
                end = offset + chunk_numel
            offset += chunk_numel
        windows.append((0, 0) if start is None else (start, end - start))
    return windows


def _zero3_states(saved: SavedLayout, windows: list[tuple[int, int]], key: str | None) -> Iterator[dict[str, Any]]:
    """Each rank's flat groups cut to the chunk's window, and only one per-element state: the
    masters, or `key` standing in their place."""
    for path in saved.optim_files:
        state = load_file(path, mmap=True)[C.OPTIMIZER_STATE_DICT]
        base = state[C.OPTIMIZER_STATE_DICT]
        indices = [index for group in base["param_groups"] for index in group["params"]]
        flats, cut = [], {}
        for k, (flat, window) in enumerate(zip(state[C.FP32_FLAT_GROUPS], windows)):
            entry = base["state"].get(indices[k], {})
            source = entry[key] if key is not None and key in entry else flat
            flats.append(source.reshape(-1).narrow(0, *window))
            cut[indices[k]] = _one_state(entry, flat.numel())
        yield {**state, C.FP32_FLAT_GROUPS: flats, C.OPTIMIZER_STATE_DICT: {**base, "state": cut}}


def _owned(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor saved alone. torch.save writes a view's whole storage (padding, neighbours) and a
    view of an mmap'd file keeps the file mapped, so it is copied unless it owns its storage exactly,
    as the exporters' torch.cat results do. One-element tensors (the step) are always copied: read
    from an mmap'd file they would pass the size test."""
    tensor = tensor.detach()
    exact = (tensor.numel() > 1 and tensor.is_contiguous() and tensor.storage_offset() == 0
             and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size())
    return tensor if exact else tensor.contiguous().clone()


def _write_params(writer: UniversalFolderWriter, full: FullOptimizerState, chunk: list[str], key: str | None,
                  shapes: dict[str, torch.Size], strict: bool, record: dict[str, list[int]]) -> None:
    """The chunk's files of one state: `fp32.pt` and `step.pt` (key None), else `<key>.pt`, from
    `full.fp32` ([Note: streaming conversion]); an MoE state read whole brings its moments along.
    `cat_dim` is the dimension a split parameter's tp pieces were joined along (DeepSpeed's meaning)."""
    for name in chunk:
        cat_dim = record.get(name, [0])[0]
        if key is not None and name not in full.fp32:
            continue   # its group holds no state `key`
        if name not in full.fp32:
            raise ValueError(f"parameter {name!r} of param_shapes has no fp32 partition in the optim files")
        value = full.fp32[name]
        if strict and value.shape != shapes[name]:
            raise ValueError(f"parameter {name!r}: merged {key or FP32} shape {tuple(value.shape)}, param_shapes "
                             f"says {tuple(shapes[name])}")
        writer.save(state_file(name, key or FP32), {PARAM: _owned(value), CAT_DIM: cat_dim})
        if key is not None:
            continue
        for moment_key, moment in full.moments.get(name, {}).items():
            writer.save(state_file(name, moment_key), {PARAM: _owned(moment), CAT_DIM: cat_dim})
        step = full.scalars.get(name, {}).get(STEP)
        if step is not None:
            writer.save(state_file(name, STEP), _owned(step) if torch.is_tensor(step) else step)


def _write_module_entries(writer: UniversalFolderWriter, source: CheckpointSource, shapes: dict[str, torch.Size]) -> None:
    """Entries of the module the optimizer does not hold (frozen params, buffers): fp32.pt only,
    a split frozen parameter joined from every tp rank's model file."""
    modules = [model_state.get(C.MODULE) or {} for model_state in source.model_states]
    for name, tensor in modules[0].items():
        if name in shapes or not torch.is_tensor(tensor) or tensor.numel() == 0:
            continue
        split = source.record.get(name)
        value = tensor if split is None else join_pieces([module[name] for module in modules], *split)
        writer.save(state_file(name, FP32), {PARAM: _owned(value.float())})


def _optimizer_state(saved: SavedLayout) -> dict[str, Any]:
    """Rank 0's optimizer state without its partitions, and `param_groups` at the top level: what
    DeepSpeed's stage-1/2 loader reads (loss scaler, clip_grad, ds_version, param_groups) and
    what its stage-3 loader reads (`optimizer_state_dict.state[0].step`, `.param_groups`)."""
    first = load_file(saved.optim_files[0], mmap=True)
    state = first[C.OPTIMIZER_STATE_DICT]
    base = state[C.BASE_OPTIMIZER_STATE] if saved.zero_stage <= 2 else state[C.OPTIMIZER_STATE_DICT]
    small = {key: value for key, value in state.items() if key not in _SHARDED_KEYS}
    scalars = {index: {key: _owned(value) if torch.is_tensor(value) else value for key, value in entry.items()
                       if not (torch.is_tensor(value) and value.dim() >= 1)}
               for index, entry in base["state"].items()}
    small[C.OPTIMIZER_STATE_DICT] = {"state": scalars, "param_groups": base["param_groups"]}
    small["param_groups"] = base["param_groups"]
    small.setdefault(C.ZERO_STAGE, saved.zero_stage)
    return zero_state_for_deepspeed(small)   # DeepSpeed's loaders use its loss-scaler object
