"""The crash-safe write of one universal folder ([Note: atomic save] in checkpoint/atomic.py, for one process).

[Note: atomic universal folder]
    1. `<parent>/.<name>.tmp` is created afresh (a stale one from a killed conversion is removed);
    2. every file is written there, fsynced, and recorded (size, sha256);
    3. the manifest `zs_manifest.json` is written, then the directory is renamed to `<parent>/<name>`
       (an existing folder of that name is first moved to `.<name>.old`, removed afterwards);
    4. `latest_universal` is replaced through a temporary file, last.
A kill at any point leaves `latest_universal` absent or naming a complete folder: its earlier
value keeps pointing at the complete earlier folder until step 4, and `<name>` only ever appears
by renaming a finished temporary directory. Tests kill the converter for real at the points
named by `crash_point` (universal_mid_params, universal_before_rename, universal_before_latest).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch

from zerospeed.checkpoint.atomic import crash_point
from zerospeed.checkpoint.durable import fsync_dir, write_text_durably
from zerospeed.checkpoint.deepspeed_compat import save_with_deepspeed_names
from zerospeed.checkpoint.manifest import file_entry, merge_manifest_parts, write_manifest_part
from zerospeed.checkpoint.universal.layout import LATEST_UNIVERSAL

__all__ = ["UniversalFolderWriter"]


class UniversalFolderWriter:
    """Writes `output_folder` through a temporary sibling; `commit` moves it in and points
    `latest_universal` at it. Paths given to `save` / `copy` are relative to the folder."""

    def __init__(self, output_folder: str) -> None:
        output_folder = os.path.abspath(output_folder.rstrip(os.sep))
        self.parent, self.name = os.path.split(output_folder)
        self.final_dir = output_folder
        self.tmp_dir = os.path.join(self.parent, f".{self.name}.tmp")
        self._entries: dict[str, dict[str, Any]] = {}

    def begin(self) -> UniversalFolderWriter:
        os.makedirs(self.parent, exist_ok=True)
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
        os.makedirs(self.tmp_dir)
        return self

    def save(self, relative: str, obj: Any, deepspeed_names: bool = False) -> None:
        """torch.save into the folder; `deepspeed_names`: pickled stand-ins under DeepSpeed's class paths."""
        path = self._prepare(relative)
        with open(path, "wb") as handle:
            if deepspeed_names:
                save_with_deepspeed_names(obj, handle)
            else:
                torch.save(obj, handle)
            handle.flush()
            os.fsync(handle.fileno())
        self._entries[relative] = file_entry(path)

    def copy(self, source: str, relative: str) -> None:
        path = self._prepare(relative)
        shutil.copyfile(source, path)
        with open(path, "rb+") as handle:
            os.fsync(handle.fileno())
        self._entries[relative] = file_entry(path)

    def _prepare(self, relative: str) -> str:
        path = os.path.join(self.tmp_dir, relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return path

    def commit(self) -> None:
        crash_point("universal_before_rename")
        write_manifest_part(self.tmp_dir, 0, self._entries)
        merge_manifest_parts(self.tmp_dir, self.name, 1)
        fsync_dir(self.tmp_dir)
        old = os.path.join(self.parent, f".{self.name}.old")
        if os.path.isdir(self.final_dir):
            shutil.rmtree(old, ignore_errors=True)
            os.rename(self.final_dir, old)
        os.rename(self.tmp_dir, self.final_dir)
        fsync_dir(self.parent)
        shutil.rmtree(old, ignore_errors=True)
        crash_point("universal_before_latest")
        write_text_durably(os.path.join(self.parent, LATEST_UNIVERSAL), self.name)

    def abort(self) -> None:
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
