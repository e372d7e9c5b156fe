"""`CheckpointReader`: a tag directory opened for loading, checked against its manifest first.

Every load starts here (the engine's, the pipeline's, MoE's expert files, AutoTP's reshard): the
manifest's every listed file must be present at its recorded size before any file is read, so a
missing file is refused by the name the manifest gives it, not by what a later file search fails
to find; each file read through `load` is checked against its sha256 the first time. A directory
without a manifest (written by DeepSpeed) loads unverified, with one warning.
"""

from __future__ import annotations

import os
from typing import Any

from zerospeed.checkpoint.manifest import load_file, verify_files
from zerospeed.utils.logging import logger

__all__ = ["CheckpointReader"]


class CheckpointReader:
    def __init__(self, tag_dir: str) -> None:
        self.tag_dir = tag_dir
        self.has_manifest = verify_files(tag_dir, checksum=False)   # raises, naming a missing or short file
        if not self.has_manifest:
            logger.warning(f"checkpoint {tag_dir} has no manifest (not written by zerospeed): loading unverified")
        self._checksummed: set[str] = set()

    def path(self, name: str) -> str:
        return os.path.join(self.tag_dir, name)

    def load(self, path: str) -> Any:
        """`path` (a file of this tag directory) checked against its sha256, then loaded
        weights-only; the same signature as `manifest.load_file`, for the loaders handed one."""
        name = os.path.relpath(path, self.tag_dir)
        if self.has_manifest and name not in self._checksummed:
            verify_files(self.tag_dir, [name])
            self._checksummed.add(name)
        return load_file(path)
