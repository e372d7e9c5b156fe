#!/usr/bin/env python
"""Merge a ZeRO checkpoint's shards into full fp32 weights: one state dict, or files for Hugging Face.

    python zero_to_fp32.py <checkpoint_dir> <output_dir> [--max_shard_size 5GB] [--safe_serialization]
                           [-t TAG] [--exclude_frozen_parameters] [-d]

`convert_zero_checkpoint_to_state_dict(..., dtype=...)` (and `zero_to_torch.py --dtype`, its sibling
in the checkpoint directory) writes the floating-point tensors as fp32, fp16 or bf16 instead.

Standalone: torch, the standard library and (for --safe_serialization) safetensors, nothing else,
because a copy of this file is written into every checkpoint directory.

[Note: bounded memory]
The input files are opened with mmap (nothing is read until a tensor is touched; the optimizer
moments never are). Each output tensor is a `_Source`: a shape plus a function that builds it
from the mapped partitions. The shard plan needs only the shapes, so files are written one shard
at a time and each parameter is materialized once, just before its shard is saved; the inputs are
re-mapped for every shard (touched pages stay resident while mapped): peak memory is about one
output shard plus that shard's input pages, not the model size.

Layouts read (DeepSpeed's `deepspeed/utils/zero_to_fp32.py::_get_fp32_state_dict_from_zero2_checkpoint`
and `_get_fp32_state_dict_from_zero3_checkpoint`): stage 1/2 (lean fp32 partitions concatenated in rank order, cut
by `param_shapes`), stage 3 (each parameter split into ceil(numel/W) chunks per rank),
zerospeed's stage 0 (no optim files: fp32 masters or fp32 module weights from the model file),
and pipeline checkpoints of either library ([Note: pipeline checkpoints]).

[Note: MoE checkpoints in zero_to_fp32]
A Mixture-of-Experts checkpoint (zerospeed/checkpoint/moe_checkpoint.py) keeps each expert in its
own `layer_<l>_expert_<e>_mp_rank_00_model_states.pt`, under its global id; the model-states file
and the ZeRO partitions hold the rest. At stage 1/2 the expert param groups are partitioned over
the expert-data-parallel group, and every rank's file describes only its own experts under local
ids, so the partitions cannot be concatenated across all ranks like the other groups. Instead each
expert-parallel rank's experts are merged from the files of the ranks that hold them (its
expert-data-parallel group, in order: zerospeed records these rank lists per ep size in
`zs_moe_expert_data_ranks`; otherwise DeepSpeed's default layout, where rank r holds ep rank
r % ep_size's experts), and their local ids become global ones (ep rank x local experts + local
id). So the experts' values are the fp32 masters, also in bf16/fp16 training; at stage 3 (ours)
the expert partitions are ceil(numel / expert-data-parallel size) per rank, at stage 0 the masters
are in the `expp_rank_<p>` files. Entries the optimizer does not hold (frozen experts) come from the
expert files (the module's weights, upcast). DeepSpeed 0.19.8's own script fails on such
checkpoints.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import math
import os
import pickle
import re
from collections import OrderedDict
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch.amp.grad_scaler import OptState

__all__ = ["OUTPUT_DTYPE_NAMES", "get_fp32_state_dict_from_zero_checkpoint", "convert_zero_checkpoint_to_state_dict",
           "convert_zero_checkpoint_to_fp32_state_dict",
           "load_state_dict_from_zero_checkpoint", "get_model_state_file", "get_model_state_files",
           "get_optim_files"]

_MANIFEST = "zs_manifest.json"
_MP_RANK = re.compile(r"^(?:zero_pp_rank_\d+_)?mp_rank_(\d+)_model_states\.pt$")
_EXPERT_FILE = re.compile(r"(layer_\d+_)?expert_\d+_mp_rank_\d+_model_states\.pt")
_EXPERT_KEY = ".deepspeed_moe.experts.deepspeed_experts."
_ALLOW_PICKLE_ENV = "ZEROSPEED_CHECKPOINT_ALLOW_PICKLE"
debug = False
# the names `--dtype` and `dtype=` accept (DeepSpeed 0.19.8's spellings)
OUTPUT_DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
                      "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


class _Source:
    def __init__(self, shape: torch.Size, dtype: torch.dtype, build: Callable[[], torch.Tensor],
                 alias_of: str | None = None) -> None:
        self.shape, self.dtype, self.build, self.alias_of = torch.Size(shape), dtype, build, alias_of

    @property
    def nbytes(self) -> int:
        return 0 if self.alias_of else math.prod(self.shape) * self.dtype.itemsize


# Builders of `_Source`s (bound with functools.partial, so each holds its own arguments).
def _float_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float().clone()


def _copy_as(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype).clone()


def _build_as(source: _Source, dtype: torch.dtype) -> torch.Tensor:
    return source.build().to(dtype)


def _never_built() -> torch.Tensor:
    raise AssertionError("an alias is written as its owner's tensor, never built")


def _lean_param(leans: list[torch.Tensor], offset: int, numel: int, shape: torch.Size) -> torch.Tensor:
    return _cat(_narrow_across(leans, offset, numel), torch.Size(shape))


def _from_fragments(fragments: list[torch.Tensor], shape: torch.Size) -> torch.Tensor:
    return torch.cat([x.float() for x in fragments]).narrow(0, 0, math.prod(shape)).view(shape)


def _match(pattern: re.Pattern[str], path: str) -> re.Match[str]:
    found = pattern.search(path)
    if found is None:
        raise ValueError(f"unexpected checkpoint file name {path} (expected to match {pattern.pattern})")
    return found


def _natural_key(path: str) -> list[object]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path)]


class _DeepSpeedObject:
    """Inert stand-in for the classes DeepSpeed pickles into its optim files (only their fields
    are kept; ZeroStageEnum is an int): read without arbitrary unpickling or importing DeepSpeed."""


class _DeepSpeedStage(int):
    pass


class _OffloadDevice(str):
    pass


# [Note: enum members by name] Some Pythons (Debian 12's 3.11.2) pickle an Enum member as
# `getattr(EnumClass, "name")`. getattr itself stays refused; `_enum_member` answers in its place
# and returns a member only for these classes and names (zerospeed/checkpoint/safe_enums.py has
# the same rule; a test holds both to the same members).
_ENUM_MEMBERS: dict[type, dict[str, object]] = {
    _DeepSpeedStage: {"disabled": 0, "optimizer_states": 1, "gradients": 2, "weights": 3, "max_stage": 3},
    _OffloadDevice: {"none": "none", "cpu": "cpu", "nvme": "nvme"},
    OptState: {state.name: state.value for state in OptState},
}


def _enum_member(owner: Any, name: Any) -> object:
    members = _ENUM_MEMBERS.get(owner) if isinstance(owner, type) else None
    if members is None or type(name) is not str or name not in members:
        what = f"class {owner.__qualname__}" if isinstance(owner, type) else f"a {type(owner).__qualname__} object"
        raise pickle.UnpicklingError(f"refusing getattr({what}, {name!r:.60}): a weights-only load allows "
                                     f"getattr only to read a member of an allowlisted enum")
    return OptState[name] if owner is OptState else owner(members[name])


_DEEPSPEED_GLOBALS: list[Any] = [(type(name, (_DeepSpeedObject,), {}), f"{module}.{name}") for module, name in (
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"), ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"))] + [
    (_DeepSpeedStage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (_DeepSpeedStage, "zerospeed.runtime.zero.config.ZeroStageEnum"),
    (_OffloadDevice, "deepspeed.runtime.zero.offload_config.OffloadDeviceEnum"),
    (_OffloadDevice, "zerospeed.runtime.zero.offload.config.OffloadDeviceEnum"),
    (OptState, "torch.amp.grad_scaler.OptState"), (_enum_member, "builtins.getattr")]


def _load(path: str) -> dict:
    try:
        with torch.serialization.safe_globals(_DEEPSPEED_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # noqa: BLE001 - name the file, whatever torch raised
        if "Weights only load failed" in str(error) and os.environ.get(_ALLOW_PICKLE_ENV) == "1":
            return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        raise ValueError(f"cannot read checkpoint file {path} (missing, truncated, corrupt, or it needs "
                         f"unpickling: set {_ALLOW_PICKLE_ENV}=1 only if you trust it): {error}") from error


def _verify(tag_dir: str, paths: list[str]) -> None:
    manifest_path = os.path.join(tag_dir, _MANIFEST)
    if not os.path.exists(manifest_path):
        return
    with open(manifest_path) as handle:
        listed = json.load(handle)["files"]
    for path in paths:
        name = os.path.basename(path)
        if name not in listed:
            continue
        if os.path.getsize(path) != listed[name]["size"]:
            raise ValueError(f"checkpoint file {path} is truncated or overwritten: {os.path.getsize(path)} "
                             f"bytes, the manifest records {listed[name]['size']}")
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            while chunk := handle.read(8 << 20):
                digest.update(chunk)
        if digest.hexdigest() != listed[name]["sha256"]:
            raise ValueError(f"checkpoint file {path} is corrupt: its sha256 differs from the manifest")
    for name in listed:
        if name.endswith(".pt") and not os.path.exists(os.path.join(tag_dir, name)):
            raise ValueError(f"checkpoint file {os.path.join(tag_dir, name)} is missing")


def _tag_dir(checkpoint_dir: str, tag: str | None) -> str:
    if tag is None:
        latest = os.path.join(checkpoint_dir, "latest")
        if not os.path.isfile(latest):
            raise ValueError(f"Unable to find 'latest' file at {latest}")
        try:  # binary junk in `latest` is a damaged file: name it
            with open(latest, "rb") as handle:
                tag = handle.read(4097).decode("utf-8").strip()
        except UnicodeDecodeError as error:
            raise ValueError(f"checkpoint file {latest} is unreadable: {error}") from error
        if not tag or not tag.isprintable():
            raise ValueError(f"checkpoint file {latest} is corrupt: it should hold one tag name, it holds {tag[:80]!r}")
    tag_dir = os.path.join(checkpoint_dir, tag)
    moved_aside = os.path.join(checkpoint_dir, f".{tag}.old")  # a save of the same tag was killed mid-rename
    if not os.path.isdir(tag_dir) and os.path.isdir(moved_aside):
        tag_dir = moved_aside
    if not os.path.isdir(tag_dir):
        raise FileNotFoundError(f"Directory '{tag_dir}' doesn't exist")
    return tag_dir


def _merged_shapes(param_shapes) -> OrderedDict:
    groups = param_shapes if isinstance(param_shapes, list) else [param_shapes]
    return OrderedDict((name, torch.Size(shape)) for group in groups for name, shape in group.items())


def _narrow_across(tensors: list[torch.Tensor], offset: int, numel: int) -> list[torch.Tensor]:
    """Elements [offset, offset + numel) of the concatenation of `tensors`, as pieces."""
    pieces = []
    for tensor in tensors:
        if numel <= 0:
            break
        if offset >= tensor.numel():
            offset -= tensor.numel()
            continue
        take = min(numel, tensor.numel() - offset)
        pieces.append(tensor.narrow(0, offset, take))
        offset, numel = 0, numel - take
    if numel > 0:
        raise ValueError("the fp32 partitions hold fewer elements than param_shapes needs: checkpoint is damaged")
    return pieces


def _copy_prefix(pieces: list[torch.Tensor], numel: int) -> torch.Tensor:
    """The first `numel` elements of the concatenated pieces, as fp32, in one copy (stage 3's
    per-rank chunks end in padding that is dropped here)."""
    out = torch.empty(numel, dtype=torch.float32)
    filled = 0
    for piece in pieces:
        take = min(piece.numel(), numel - filled)
        if take <= 0:
            break
        out.narrow(0, filled, take).copy_(piece.reshape(-1).narrow(0, 0, take))
        filled += take
    return out


def _cat(pieces: list[torch.Tensor], shape: torch.Size) -> torch.Tensor:
    return torch.cat([p.float() for p in pieces]).view(shape) if pieces else torch.empty(shape)


class _ZeroCheckpoint:
    """The `_Source`s of one tag directory, in the module's state-dict order."""

    def __init__(self, tag_dir: str, exclude_frozen_parameters: bool, verify: bool = True,
                 stage_files: tuple[str, list[str], dict] | None = None, mp_rank: int | None = None) -> None:
        """`stage_files` (pipeline checkpoints): one stage's model file, its optim files and its
        model state with `module` filled from the layer files, instead of the whole directory.
        `mp_rank`: only that model-parallel rank's files (one tp rank of an AutoTP checkpoint)."""
        self.tag_dir, self.exclude_frozen = tag_dir, exclude_frozen_parameters
        self.expert_files: list[str] = []
        self.expert_order: list[str] = []
        if stage_files is not None:
            self.model_files, self.optim_files, self.model0 = [stage_files[0]], stage_files[1], stage_files[2]
            self.sources: OrderedDict[str, _Source] = OrderedDict()
            return
        mp = "" if mp_rank is None else f"mp_rank_{mp_rank:02d}_"
        model_files = sorted(glob.glob(os.path.join(tag_dir, f"*{mp}model_states.pt")), key=_natural_key)
        self.expert_files = [f for f in model_files if _EXPERT_FILE.fullmatch(os.path.basename(f))]
        self.model_files = [f for f in model_files if f not in self.expert_files]
        self.optim_files = [f for f in sorted(glob.glob(os.path.join(tag_dir, f"*{mp}optim_states.pt")),
                                              key=_natural_key)
                            if not os.path.basename(f).startswith("expp_rank_")]   # stage 0 MoE: per ep rank
        if not self.model_files:
            raise FileNotFoundError(f"no *_model_states.pt file in {tag_dir}")
        if verify:
            _verify(tag_dir, self.model_files + self.optim_files + self.expert_files)
        self.model0 = _load(self.model_files[0])
        self.sources = OrderedDict()

    def collect(self) -> OrderedDict:
        stage = self._read_optim_files()
        if stage == 0:
            self._stage0_params()
        elif stage in (1, 2):
            self._zero12_params()
        else:
            self._zero3_params()
        self._experts(stage)
        self._buffers()
        self._shared()
        return self._in_module_order()

    def _read_optim_files(self) -> int:
        if not self.optim_files:
            return 0
        self.optim = []
        for path in self.optim_files:
            state = _load(path)["optimizer_state_dict"]
            if "zero_stage" not in state:
                raise ValueError(f"{path} is not a zero checkpoint (no 'zero_stage')")
            self.optim.append(state)
        stage = int(self.optim[0]["zero_stage"])
        counts = self.optim[0]["partition_count"]
        self.world_size = int(max(counts) if isinstance(counts, list) else counts)
        if len(self.optim) != self.world_size:
            raise ValueError(f"Expected {self.world_size} of '*_optim_states.pt' under '{self.tag_dir}' but found "
                             f"{len(self.optim)} files. Possibly due to an overwrite of an old checkpoint, "
                             "or a checkpoint didn't get saved by one or more processes.")
        if debug:
            print(f"zero stage {stage}, dp world size {self.world_size}, {len(self.optim)} optim files")
        return stage

    def _stage0_params(self) -> None:
        module = self.model0["module"]
        shapes = _merged_shapes(self.model0.get("param_shapes") or [])
        optimizer = self.model0.get("optimizer") or {}
        groups = optimizer.get("fp32_groups") or []
        if groups and isinstance(groups[0], (list, tuple)):   # DeepSpeed's shape: a list per param group
            groups = [master for group in groups for master in group]
        masters = dict(zip(shapes, groups))
        for name, tensor in module.items():
            if name in self.model0.get("buffer_names", []) or name in (self.model0.get("shared_params") or {}):
                continue
            if tensor.numel() == 0:
                raise ValueError(f"tensor {name!r} in {self.model_files[0]} is empty: this model file holds no "
                                 "weights (a ZeRO-3 model file without its optim files?)")
            frozen = shapes and name not in shapes
            if frozen and self.exclude_frozen:
                continue
            source = masters.get(name, tensor)
            self.sources[name] = _Source(tensor.shape, torch.float32, partial(_float_copy, source))

    def _zero12_params(self) -> None:
        for g, shapes in enumerate(self.model0["param_shapes"]):
            if self.expert_files and shapes and all(_EXPERT_KEY in name for name in shapes):
                # an expert group: [Note: MoE checkpoints in zero_to_fp32]
                counts = self.optim[0]["partition_count"]
                expert_world = int(counts[g] if isinstance(counts, list) else counts)
                for ep_rank, ranks in enumerate(self._expert_rank_lists(expert_world)):
                    self._zero12_group(g, shapes, [self.optim[r] for r in ranks], len(ranks),
                                       self._globalizer(shapes, ep_rank))
                continue
            self._zero12_group(g, shapes, self.optim, self.world_size, lambda name: name)
        self._frozen_full(self.model0)

    def _zero12_group(self, g: int, shapes: dict, states: list, world_size: int,
                      rename: Callable[[str], str]) -> None:
        """Group g's parameters from the lean partitions of `states` (its ranks, in partition order)."""
        leans = [state["single_partition_of_fp32_groups"][g] for state in states]
        paddings = [state.get("param_alignment_paddings", [[]] * (g + 1))[g] for state in states][0]
        offset = 0
        for k, (name, shape) in enumerate(shapes.items()):
            numel = math.prod(shape)
            self.sources[rename(name)] = _Source(shape, torch.float32, partial(_lean_param, leans, offset, numel, shape))
            offset += numel + (int(paddings[k]) if k < len(paddings) else 0)
        available = sum(t.numel() for t in leans)
        align = 2 * world_size
        if -(-offset // align) * align != -(-available // align) * align:
            raise ValueError(f"group {g}: consumed {offset} numels out of {available} - something is wrong")

    def _expert_rank_lists(self, expert_world: int) -> list[list[int]]:
        """For each expert-parallel rank, the ranks holding its experts, in expert-data-parallel order
        ([Note: MoE checkpoints in zero_to_fp32])."""
        return self._rank_lists_of_size(self.world_size // expert_world, self.world_size)

    def _rank_lists_of_size(self, ep_size: int, world_size: int) -> list[list[int]]:
        recorded = (self.model0.get("zs_moe_expert_data_ranks") or {}).get(ep_size)
        if recorded is not None:
            return [list(ranks) for ranks in recorded]
        return [[ep_rank + ep_size * i for i in range(world_size // ep_size)] for ep_rank in range(ep_size)]

    @staticmethod
    def _globalizer(local_names, ep_rank: int) -> Callable[[str], str]:
        """local expert name -> global: `...deepspeed_experts.<l>.` -> `<ep_rank * local experts + l>`,
        the local experts of each MoE layer counted from the names (every rank holds the same count)."""
        per_layer: dict[str, int] = {}
        for name in local_names:
            if _EXPERT_KEY in name:
                prefix, tail = name.split(_EXPERT_KEY, 1)
                per_layer[prefix] = max(per_layer.get(prefix, 0), int(tail.split(".", 1)[0]) + 1)

        def rename(name: str) -> str:
            if _EXPERT_KEY not in name:
                return name
            prefix, tail = name.split(_EXPERT_KEY, 1)
            local, rest = tail.split(".", 1)
            return f"{prefix}{_EXPERT_KEY}{ep_rank * per_layer[prefix] + int(local)}.{rest}"
        return rename

    def _frozen_full(self, model_state: dict) -> None:
        if self.exclude_frozen:
            return
        fragments = model_state.get("frozen_param_fragments")
        if fragments is None:
            fragments = self._frozen_from_module(model_state)
        for name, tensor in fragments.items():
            self.sources[name] = _Source(tensor.shape, torch.float32, partial(_float_copy, tensor))

    def _frozen_from_module(self, model_state: dict) -> dict:
        """DeepSpeed writes no frozen fragments at stage 1 (its converter then drops frozen
        params); their values are in the model file's `module`: every entry that is neither a
        trainable param, a buffer nor a tied alias."""
        trainable = _merged_shapes(model_state.get("param_shapes") or [])
        skip = set(model_state.get("buffer_names", [])) | set(model_state.get("shared_params") or {})
        return {name: tensor for name, tensor in model_state["module"].items()
                if name not in trainable and name not in skip and tensor.numel() > 0}

    def _zero3_params(self) -> None:
        world_size = self.world_size
        flats = [state["fp32_flat_groups"] for state in self.optim]
        offset, expert_world = 0, self._expert_partition_count()
        all_shapes = _merged_shapes(self.model0["param_shapes"])
        expert_ranks = self._expert_rank_lists(expert_world) if expert_world else []
        renames = [self._globalizer(all_shapes, ep_rank) for ep_rank in range(len(expert_ranks))]
        for name, shape in all_shapes.items():
            numel = math.prod(shape)
            if expert_world and _EXPERT_KEY in name:   # partitioned over its expert-data-parallel group
                self._zero3_expert(name, shape, offset, [[flats[r] for r in ranks] for ranks in expert_ranks], renames)
                offset += -(-numel // expert_world)
                continue
            psize = -(-numel // world_size)

            def build(o=offset, n=numel, p=psize, s=shape):
                pieces = [piece for rank_flat in flats for piece in _narrow_across(rank_flat, o, p)]
                return _copy_prefix(pieces, n).view(s)

            self.sources[name] = _Source(shape, torch.float32, build)
            offset += psize
        available = sum(t.numel() for t in flats[0])
        if offset != available:
            raise ValueError(f"consumed {offset} numels per rank out of {available} - something is wrong")
        self._zero3_frozen()

    def _zero3_expert(self, name: str, shape: torch.Size, offset: int, flats_per_ep_rank: list[list],
                      renames: list[Callable[[str], str]]) -> None:
        """Every expert-parallel rank's copy of expert parameter `name` (local id), under its global id:
        chunks of ceil(numel / expert-data-parallel size) from that ep rank's ranks, in order."""
        numel = math.prod(shape)
        for flats, rename in zip(flats_per_ep_rank, renames):
            chunk = -(-numel // len(flats))

            def build(o=offset, n=numel, p=chunk, s=shape, f=flats):
                return _copy_prefix([piece for rank_flat in f for piece in _narrow_across(rank_flat, o, p)], n).view(s)

            self.sources[rename(name)] = _Source(shape, torch.float32, build)

    def _expert_partition_count(self) -> int:
        """Stage 3 with MoE: the expert-data-parallel size each expert parameter is partitioned over
        (zerospeed records the expert-parallel size in `zs_moe_ep_sizes`); 0 without experts."""
        if not self.expert_files:
            return 0
        sizes = set((self.model0.get("zs_moe_ep_sizes") or {}).values())
        if len(sizes) != 1:
            raise ValueError(f"{self.model_files[0]}: a stage-3 MoE checkpoint needs exactly one expert-parallel "
                             f"size in 'zs_moe_ep_sizes' to be merged, found {sorted(sizes)}")
        return self.world_size // int(sizes.pop())

    def _zero3_frozen(self) -> None:
        shapes = self.model0.get("frozen_param_shapes")
        if self.exclude_frozen or not shapes:
            return
        models = [self.model0] + [_load(path) for path in self.model_files[1:]]
        for name, shape in shapes.items():
            fragments = [m["frozen_param_fragments"][name] for m in models]
            self.sources[name] = _Source(shape, torch.float32, partial(_from_fragments, fragments, shape))

    def _experts(self, stage: int) -> None:
        """Every expert under its global id: the fp32 masters read above (stage 0: from the
        `expp_rank` files), the rest (frozen experts) from the expert files ([Note: MoE checkpoints
        in zero_to_fp32])."""
        if stage == 0:
            self._stage0_expert_masters()
        for path in self.expert_files:
            for name, tensor in _load(path).items():
                self.expert_order.append(name)   # module order within each expert, experts by global id
                if name in self.sources or (self.exclude_frozen and name not in self.trainable_experts):
                    continue
                self.sources[name] = _Source(tensor.shape, torch.float32, partial(_float_copy, tensor))

    def _stage0_expert_masters(self) -> None:
        """Stage 0 in fp16/bf16: each `expp_rank_<p>` file holds the fp32 masters of ep rank p's
        parameters (fp32 training keeps none: the expert files are exact there)."""
        names = list(_merged_shapes(self.model0.get("param_shapes") or []))
        files = sorted(glob.glob(os.path.join(self.tag_dir, "expp_rank_*_optim_states.pt")), key=_natural_key)
        sizes = set((self.model0.get("zs_moe_ep_sizes") or {}).values())
        if len(sizes) != 1 or not files:
            return   # several expert-parallel sizes (or none recorded): the expert files' weights
        ep_size = sizes.pop()
        # File p was written by the first rank holding ep rank p's experts of the *largest* created ep
        # size (one file per its ep rank); that rank's experts are those of its ep rank in `ep_size`.
        recorded = self.model0.get("zs_moe_expert_data_ranks") or {}
        world_size = sum(len(ranks) for ranks in next(iter(recorded.values()))) if recorded else len(files)
        writers = [ranks[0] for ranks in self._rank_lists_of_size(len(files), world_size)]
        ep_rank_of = {r: p for p, ranks in enumerate(self._rank_lists_of_size(ep_size, world_size)) for r in ranks}
        for path in files:
            optimizer = _load(path).get("optimizer") or {}
            masters = optimizer.get("fp32_groups") or []
            if masters and isinstance(masters[0], (list, tuple)):
                masters = [master for group in masters for master in group]
            if not masters or "param_names" not in optimizer:
                continue
            flags = [flag for group in optimizer["trainable"] for flag in group]
            trainable = [n for group in optimizer["param_names"] for n in group]
            trainable = [n for n, flag in zip(trainable, flags) if flag]
            writer = writers[int(_match(re.compile(r"expp_rank_(\d+)_"), path).group(1))]
            rename = self._globalizer(names, ep_rank_of[writer])
            for name, master in zip(trainable, masters):
                if _EXPERT_KEY in name:
                    self.sources[rename(name)] = _Source(master.shape, torch.float32, partial(_float_copy, master))

    @property
    def trainable_experts(self) -> set[str]:
        """Global names whose local name is a trainable param (param_shapes names rank 0's experts)."""
        local = {re.sub(r"deepspeed_experts\.\d+\.", "deepspeed_experts.*.", n)
                 for n in _merged_shapes(self.model0.get("param_shapes") or [])}
        return {n for path in self.expert_files for n in _load(path)
                if re.sub(r"deepspeed_experts\.\d+\.", "deepspeed_experts.*.", n) in local}

    def _buffers(self) -> None:
        module = self.model0["module"]
        for name in self.model0.get("buffer_names", []):
            tensor = module[name]
            dtype = torch.float32 if tensor.is_floating_point() else tensor.dtype
            self.sources[name] = _Source(tensor.shape, dtype, partial(_copy_as, tensor, dtype))

    def _shared(self) -> None:
        for alias, owner in (self.model0.get("shared_params") or {}).items():
            if owner in self.sources:
                self.sources[alias] = _Source(self.sources[owner].shape, torch.float32, _never_built, alias_of=owner)

    def _in_module_order(self) -> OrderedDict:
        if not any(s.nbytes for s in self.sources.values()) and not any(
                math.prod(s.shape) for s in self.sources.values()):
            raise ValueError(f"checkpoint {self.tag_dir} holds no parameter data (all tensors empty)")
        order = []
        for name in self.model0["module"]:   # an MoE layer's experts follow its gate, as in the module
            if name in self.sources:
                order.append(name)
            if ".deepspeed_moe.gate." in name:
                prefix = name.split(".deepspeed_moe.gate.")[0] + _EXPERT_KEY
                experts = [n for n in self.expert_order if n in self.sources]
                experts += [n for n in self.sources if n not in set(experts)]
                order += [n for n in experts if n.startswith(prefix) and n not in order]
        order += [name for name in self.sources if name not in set(order)]
        return OrderedDict((name, self.sources[name]) for name in order)


_LAYER_FILE = re.compile(r"layer_(\d+)(-model_\d+)?-model_states\.pt$")


class _PipelineCheckpoint:
    """[Note: pipeline checkpoints] A pipeline checkpoint (DeepSpeed's layout, either library's)
    holds each layer's weights in `layer_XX-model_states.pt` (global layer index, model dtype), one
    `mp_rank_SS_model_states.pt` per stage with `module: None`, and the stage's optimizer files
    (`*_mp_rank_SS_optim_states.pt`, fp32 masters at ZeRO 1/2). Output: the state dict of the
    whole PipelineModule, as one stage holding every layer names it (`<layer index>.<name>`, tied
    modules once as `tied_modules.<key>.<name>`). Each stage is read as a small ZeRO checkpoint
    whose `module` is rebuilt from the layer files, so the fp32 values are the masters wherever
    the optimizer holds them; frozen weights and buffers come from the layer files. A layer file
    names no key: a layer is a tied module when its names are unknown as `<index>.<name>` but
    known, in some stage's model file, under exactly one `tied_modules.<key>.`. DeepSpeed's stage-0
    model files list no parameter names: there every layer file is read as `<index>.<name>` (a
    tied module then appears under the index of each layer file that holds it)."""

    def __init__(self, tag_dir: str, layer_files: list[str], exclude_frozen_parameters: bool, verify: bool) -> None:
        self.tag_dir, self.exclude_frozen = tag_dir, exclude_frozen_parameters
        self.layer_files = sorted(layer_files, key=_natural_key)
        sliced = [path for path in self.layer_files if _match(_LAYER_FILE, path).group(2)]
        if sliced:
            raise ValueError(f"{sliced[0]} is a tensor-parallel slice: merging tensor-parallel pipeline "
                             "checkpoints is not supported")
        self.stage_files = sorted(glob.glob(os.path.join(tag_dir, "mp_rank_*_model_states.pt")), key=_natural_key)
        if not self.stage_files:
            raise FileNotFoundError(f"pipeline checkpoint {tag_dir} has layer files but no mp_rank_*_model_states.pt")
        optim = sorted(glob.glob(os.path.join(tag_dir, "*_optim_states.pt")), key=_natural_key)
        if verify:
            _verify(tag_dir, self.layer_files + self.stage_files + optim)
        self.stages = [_load(path) for path in self.stage_files]

    @staticmethod
    def _names(model_state: dict) -> set[str]:
        names = set(_merged_shapes(model_state.get("param_shapes") or []))
        names |= set(model_state.get("buffer_names") or []) | set(model_state.get("frozen_param_shapes") or {})
        return names | set(model_state.get("shared_params") or {})

    def _whole_module(self, known: set[str]) -> OrderedDict:
        tied_keys = sorted({name.split(".")[1] for name in known if name.startswith("tied_modules.")})
        tied: OrderedDict = OrderedDict()
        layers: OrderedDict = OrderedDict()
        for path in self.layer_files:
            index, state = int(_match(_LAYER_FILE, path).group(1)), _load(path)
            if any(f"{index}.{name}" in known for name in state) or not tied_keys:
                layers.update((f"{index}.{name}", tensor) for name, tensor in state.items())
                continue
            keys = [key for key in tied_keys if any(f"tied_modules.{key}.{name}" in known for name in state)]
            if len(keys) > 1:
                raise ValueError(f"{path}: its names fit the tied modules {keys}; cannot tell which it holds")
            prefix = f"tied_modules.{keys[0]}." if keys else f"{index}."
            target = tied if keys else layers
            for name, tensor in state.items():
                target.setdefault(prefix + name, tensor)   # a tied module's copies are equal: keep the first
        tied.update(layers)
        return tied

    def collect(self) -> OrderedDict:
        known = set().union(*(self._names(state) for state in self.stages))
        module = self._whole_module(known)
        sources: OrderedDict[str, _Source] = OrderedDict()
        buffers: set[str] = set()
        for path, state in zip(self.stage_files, self.stages):
            if not state.get("param_shapes"):   # DeepSpeed at stage 0 lists no names: the layer files are all
                continue
            stage_rank = _match(re.compile(r"mp_rank_(\d+)_model_states"), path).group(1)
            optim = sorted(glob.glob(os.path.join(self.tag_dir, f"*_mp_rank_{stage_rank}_optim_states.pt")),
                           key=_natural_key)
            names = self._names(state)
            stage_state = dict(state, module=OrderedDict((n, t) for n, t in module.items() if n in names))
            buffers |= set(state.get("buffer_names") or [])
            part = _ZeroCheckpoint(self.tag_dir, self.exclude_frozen, stage_files=(path, optim, stage_state))
            for name, source in part.collect().items():
                sources.setdefault(name, source)
        listed = any(state.get("param_shapes") for state in self.stages)
        for name, tensor in module.items():   # what no stage lists: frozen weights, or all (DeepSpeed, stage 0)
            if name not in sources and not (self.exclude_frozen and listed and name not in buffers):
                dtype = torch.float32 if tensor.is_floating_point() else tensor.dtype
                sources[name] = _Source(tensor.shape, dtype, partial(_copy_as, tensor, dtype))
        order = [name for name in module if name in sources] + [name for name in sources if name not in module]
        return OrderedDict((name, sources[name]) for name in order)


def _sources(checkpoint_dir: str, tag: str | None, exclude_frozen_parameters: bool,
             verify: bool = True) -> OrderedDict:
    tag_dir = _tag_dir(checkpoint_dir, tag)
    layer_files = [p for p in glob.glob(os.path.join(tag_dir, "layer_*model_states.pt")) if _LAYER_FILE.search(p)]
    if layer_files:
        return _PipelineCheckpoint(tag_dir, layer_files, exclude_frozen_parameters, verify).collect()
    first = sorted(glob.glob(os.path.join(tag_dir, "*_model_states.pt")), key=_natural_key)
    record = _load(first[0]).get("autotp_shards") if first else None
    if not record:
        return _ZeroCheckpoint(tag_dir, exclude_frozen_parameters, verify).collect()
    return _merge_tp_ranks(tag_dir, exclude_frozen_parameters, verify, record)


def _merge_tp_ranks(tag_dir: str, exclude_frozen: bool, verify: bool, record: dict) -> OrderedDict:
    """An AutoTP checkpoint (zerospeed's, it records `autotp_shards`: name -> [dim, fused parts]):
    each tp rank's files give its pieces; split parameters are joined part by part along `dim`."""
    # stage 0-2: `mp_rank_XX_model_states.pt`; stage 3: one `zero_pp_rank_D_mp_rank_XX_...` per dp rank
    tp_size = len({match.group(1) for path in glob.glob(os.path.join(tag_dir, "*mp_rank_*_model_states.pt"))
                   if (match := _MP_RANK.search(os.path.basename(path)))})
    ranks = [_ZeroCheckpoint(tag_dir, exclude_frozen, verify, mp_rank=r).collect() for r in range(tp_size)]
    merged = OrderedDict(ranks[0])
    for name, (dim, parts) in record.items():
        if name not in merged:
            continue
        pieces = [sources[name] for sources in ranks]
        shape = list(pieces[0].shape)
        shape[dim] *= tp_size

        def build(pieces=pieces, dim=dim, parts=parts) -> torch.Tensor:
            chunks = [piece.build().chunk(parts, dim=dim) for piece in pieces]
            return torch.cat([torch.cat([c[p] for c in chunks], dim=dim) for p in range(parts)], dim=dim)

        merged[name] = _Source(torch.Size(shape), pieces[0].dtype, build)
    return merged


def _materialize(sources: OrderedDict, names: list[str]) -> OrderedDict:
    tensors: OrderedDict = OrderedDict()
    for name in names:
        source = sources[name]
        if source.alias_of is None:
            tensors[name] = source.build()
    for name in names:
        if sources[name].alias_of is not None:
            tensors[name] = tensors[sources[name].alias_of]
    return tensors


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False) -> OrderedDict:
    """The whole fp32 state dict (params, buffers, tied aliases) on CPU."""
    sources = _sources(checkpoint_dir, tag, exclude_frozen_parameters)
    return _materialize(sources, list(sources))


def parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?I?B)?\s*", size.upper())
    if not match:
        raise ValueError(f"max_shard_size {size!r} is not a size like '5GB' or '500MiB'")
    units = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    return int(float(match.group(1)) * units[match.group(2) or "B"])


def plan_shards(sources: OrderedDict, max_shard_bytes: int | None) -> list[list[str]]:
    """Hugging Face's greedy split: a new shard when the next tensor would overflow; aliases ride along."""
    shards: list[list[str]] = [[]]
    size = 0
    shard_of: dict[str, int] = {}
    for name, source in sources.items():
        if source.alias_of is not None:
            continue
        if max_shard_bytes is not None and shards[-1] and size + source.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        shard_of[name] = len(shards) - 1
        size += source.nbytes
    for name, source in sources.items():
        if source.alias_of is not None:
            shards[shard_of[source.alias_of]].append(name)
    return shards


def _output_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype or one of OUTPUT_DTYPE_NAMES (optionally spelled `torch.<name>`)."""
    resolved = OUTPUT_DTYPE_NAMES.get(dtype.lower().removeprefix("torch.")) if isinstance(dtype, str) else dtype
    if resolved not in OUTPUT_DTYPE_NAMES.values():
        raise ValueError(f"Unsupported output dtype {dtype!r}. Choose one of: {', '.join(sorted(OUTPUT_DTYPE_NAMES))}")
    return resolved  # type: ignore[return-value]


def _cast(sources: OrderedDict, dtype: torch.dtype) -> OrderedDict:
    """Floating-point entries built in `dtype` (shard sizes follow it); integer and bool buffers keep theirs."""
    if dtype == torch.float32:
        return sources
    cast: OrderedDict = OrderedDict()
    for name, source in sources.items():
        if source.alias_of is not None or not source.dtype.is_floating_point:
            cast[name] = source
        else:
            cast[name] = _Source(source.shape, dtype, partial(_build_as, source, dtype))
    return cast


def convert_zero_checkpoint_to_state_dict(checkpoint_dir: str, output_dir: str,
                                          dtype: torch.dtype | str = torch.float32, max_shard_size="5GB",
                                          safe_serialization: bool = False, tag: str | None = None,
                                          exclude_frozen_parameters: bool = False) -> None:
    """Write `pytorch_model.bin` / `model.safetensors`, or shards plus the HF index, one shard at a time,
    floating-point tensors in `dtype` (fp32, fp16 or bf16)."""
    dtype = _output_dtype(dtype)

    def sources_of(verify: bool) -> OrderedDict:
        sources = _cast(_sources(checkpoint_dir, tag, exclude_frozen_parameters, verify), dtype)
        if safe_serialization:  # safetensors refuses shared storage; HF re-ties the aliases on load
            sources = OrderedDict((n, s) for n, s in sources.items() if s.alias_of is None)
        return sources

    sources = sources_of(verify=True)
    shards = plan_shards(sources, None if max_shard_size is None else parse_size(max_shard_size))
    total_bytes = sum(sources[name].nbytes for shard in shards for name in shard)
    stem, ext = ("model", "safetensors") if safe_serialization else ("pytorch_model", "bin")
    names = [f"{stem}.{ext}"] if len(shards) == 1 else [
        f"{stem}-{i + 1:05d}-of-{len(shards):05d}.{ext}" for i in range(len(shards))]
    os.makedirs(output_dir, exist_ok=True)
    weight_map = {}
    for index, (file_name, shard) in enumerate(zip(names, shards)):
        if index > 0:
            # Re-map the inputs for every shard: the pages the previous shard touched are mapped
            # (and counted as resident) until their mapping goes, so dropping it bounds the peak
            # to about one shard of input plus one of output. Verified once, on the first open.
            del sources
            sources = sources_of(verify=False)
        tensors = _materialize(sources, shard)
        if debug:
            print(f"writing {file_name}: {len(tensors)} tensors")
        _save(tensors, os.path.join(output_dir, file_name), safe_serialization)
        weight_map.update({name: file_name for name in tensors})
        del tensors
    if len(shards) > 1:
        index_json = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        with open(os.path.join(output_dir, f"{stem}.{ext}.index.json"), "w") as handle:
            handle.write(json.dumps(index_json, indent=2, sort_keys=True) + "\n")


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str, output_dir: str, max_shard_size="5GB",
                                               safe_serialization: bool = False, tag: str | None = None,
                                               exclude_frozen_parameters: bool = False) -> None:
    """`convert_zero_checkpoint_to_state_dict` in fp32."""
    convert_zero_checkpoint_to_state_dict(checkpoint_dir, output_dir, torch.float32, max_shard_size,
                                          safe_serialization, tag, exclude_frozen_parameters)


def _save(tensors: OrderedDict, path: str, safe_serialization: bool) -> None:
    if safe_serialization:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata={"format": "pt"})
    else:
        torch.save(tensors, path)


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: str, tag: str | None = None):
    """Load the merged fp32 weights into `model` (moved to CPU, strict=False) and return it."""
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state_dict, strict=False)
    return model


def get_model_state_file(checkpoint_dir: str, zero_stage: int) -> str:
    """The tag directory's model-states file that carries the client state (Lightning reads it)."""
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"Directory '{checkpoint_dir}' doesn't exist")
    name = "zero_pp_rank_0_mp_rank_00_model_states.pt" if int(zero_stage) == 3 else "mp_rank_00_model_states.pt"
    path = os.path.join(checkpoint_dir, name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"can't find model states file at '{path}'")
    return path


def _files_matching(checkpoint_dir: str, pattern: str) -> list[str]:
    found = sorted(glob.glob(os.path.join(checkpoint_dir, pattern)), key=_natural_key)
    if not found:
        raise FileNotFoundError(f"can't find {pattern} files in directory '{checkpoint_dir}'")
    return found


def get_optim_files(checkpoint_dir: str) -> list[str]:
    """Every rank's `*_optim_states.pt` in the tag directory, in rank order."""
    return _files_matching(checkpoint_dir, "*_optim_states.pt")


def get_model_state_files(checkpoint_dir: str) -> list[str]:
    """Every `*_model_states.pt` in the tag directory, in rank order."""
    return _files_matching(checkpoint_dir, "*_model_states.pt")


def main(argv: list[str] | None = None) -> None:
    global debug
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint_dir", help="the folder holding 'latest' and the tag folders")
    parser.add_argument("output_dir", help="where pytorch_model.bin / model.safetensors (or shards) go")
    parser.add_argument("--max_shard_size", default="5GB", help="largest output shard, e.g. 5GB, 500MiB")
    parser.add_argument("--safe_serialization", action="store_true", help="write safetensors")
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: the 'latest' file)")
    parser.add_argument("--exclude_frozen_parameters", action="store_true")
    parser.add_argument("-d", "--debug", action="store_true")
    args = parser.parse_args(argv)
    debug = args.debug
    convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_dir, args.max_shard_size,
                                               args.safe_serialization, args.tag, args.exclude_frozen_parameters)


if __name__ == "__main__":
    main()
