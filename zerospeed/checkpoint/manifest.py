"""The manifest of a checkpoint tag directory, and verified, weights-only loading of its files.

Every file a save writes is listed in `<tag>/zs_manifest.json` with its size and sha256. Each rank
records the files it wrote in a small part file; rank 0 merges the parts after the barrier, so no
collective carries file lists. Loading checks the files it is about to read against the manifest
and names the one that is missing, truncated or corrupt. A directory without a manifest
(written by DeepSpeed) loads unverified, with a warning.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import pickle
from typing import Any

import torch

from zerospeed.checkpoint.safe_enums import load_deepspeed_file
from zerospeed.checkpoint.durable import write_text_durably
from zerospeed.checkpoint.layout import MANIFEST

__all__ = ["CheckpointIntegrityError", "file_entry", "load_file", "read_manifest", "verify_files",
           "write_manifest_part", "merge_manifest_parts", "ALLOW_PICKLE_ENV"]

MANIFEST_VERSION = 1
ALLOW_PICKLE_ENV = "ZEROSPEED_CHECKPOINT_ALLOW_PICKLE"
_PART_GLOB = ".manifest_part_rank*.json"
_CHUNK_BYTES = 8 * 1024 * 1024


class CheckpointIntegrityError(ValueError):
    """A checkpoint file is missing, truncated or corrupt; the message names it."""


def file_entry(path: str) -> dict[str, Any]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK_BYTES):
            digest.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": digest.hexdigest()}


def write_manifest_part(tmp_dir: str, rank: int, entries: dict[str, dict[str, Any]]) -> None:
    write_text_durably(os.path.join(tmp_dir, f".manifest_part_rank{rank}.json"), json.dumps(entries))


def merge_manifest_parts(tmp_dir: str, tag: str, world_size: int) -> dict[str, Any]:
    files: dict[str, Any] = {}
    parts = glob.glob(os.path.join(tmp_dir, _PART_GLOB))
    if len(parts) != world_size:
        raise RuntimeError(f"checkpoint {tag}: expected {world_size} manifest parts in {tmp_dir}, found {len(parts)}")
    for part in parts:
        with open(part) as handle:
            files.update(json.load(handle))
    from zerospeed.version import __version__

    # `ds_version` in the files is the DeepSpeed format followed; who wrote them is recorded here
    manifest = {"version": MANIFEST_VERSION, "tag": tag, "writer": f"zerospeed {__version__}",
                "files": dict(sorted(files.items()))}
    write_text_durably(os.path.join(tmp_dir, MANIFEST), json.dumps(manifest, indent=1))
    for part in parts:
        os.remove(part)
    return manifest


def read_manifest(tag_dir: str) -> dict[str, Any] | None:
    path = os.path.join(tag_dir, MANIFEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as handle:
            return json.load(handle)
    except (OSError, ValueError) as error:  # JSONDecodeError and UnicodeDecodeError (a flipped bit) are ValueErrors
        raise CheckpointIntegrityError(f"checkpoint manifest {path} is unreadable: {error}") from error


def verify_files(tag_dir: str, names: list[str] | None = None, checksum: bool = True) -> bool:
    """Check `names` (default: every listed file) against the manifest. False when there is none."""
    manifest = read_manifest(tag_dir)
    if manifest is None:
        return False
    listed = manifest["files"]
    for name in names if names is not None else list(listed):
        path = os.path.join(tag_dir, name)
        if name not in listed:
            raise CheckpointIntegrityError(f"checkpoint file {path} is not listed in {MANIFEST}")
        if not os.path.exists(path):
            raise CheckpointIntegrityError(f"checkpoint file {path} is missing")
        expected = listed[name]
        size = os.path.getsize(path)
        if size != expected["size"]:
            kind = "truncated" if size < expected["size"] else "larger than recorded"
            raise CheckpointIntegrityError(f"checkpoint file {path} is {kind}: {size} bytes, "
                                           f"the manifest records {expected['size']}")
        if checksum and file_entry(path)["sha256"] != expected["sha256"]:
            raise CheckpointIntegrityError(f"checkpoint file {path} is corrupt: its sha256 differs from the manifest")
    return True


def load_file(path: str, allow_unpickling: bool | None = None, mmap: bool = False) -> Any:
    """torch.load with weights_only=True (DeepSpeed's checkpoint classes mapped by
    deepspeed_compat.py); a file that needs any other unpickling is refused unless the caller
    opts in (argument, or ZEROSPEED_CHECKPOINT_ALLOW_PICKLE=1)."""
    if allow_unpickling is None:
        allow_unpickling = os.environ.get(ALLOW_PICKLE_ENV, "") == "1"
    if not os.path.exists(path):
        raise CheckpointIntegrityError(f"checkpoint file {path} is missing")
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except pickle.UnpicklingError:   # a DeepSpeed file: its four classes as inert stand-ins
            return load_deepspeed_file(path, mmap=mmap)
    except pickle.UnpicklingError as error:
        if not allow_unpickling:
            raise ValueError(f"checkpoint file {path} needs arbitrary unpickling (it stores Python objects, "
                             f"not only tensors and plain types); refusing it. If you trust its origin, set "
                             f"{ALLOW_PICKLE_ENV}=1 or pass allow_unpickling=True.\n{error}") from error
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except (RuntimeError, EOFError, OSError) as error:
        raise CheckpointIntegrityError(f"checkpoint file {path} is unreadable (truncated or corrupt): {error}") from error
