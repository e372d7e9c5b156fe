"""Read slices of tensors out of a ``.safetensors`` file with plain file reads (no memory map).

[Note: why not safe_open]
``safetensors.safe_open`` memory-maps the file; every page a slice touches (all of them for a
slice along the last dim) then counts in the process's resident memory until the file is
closed, so a rank reading "only its half" still shows a whole model's pages. This reader parses
the header (8-byte little-endian length, then JSON: dtype, shape, data_offsets per tensor) and
reads each contiguous run of the slice straight into the output tensor with ``readinto``: a rank's
memory grows by the slices it keeps and nothing else (the kernel's page cache is shared, not
this process's).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["SafetensorsSlices"]

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class SafetensorsSlices:
    """One open ``.safetensors`` file: its tensors' shapes, and reads of whole tensors or of one
    contiguous range along one dimension."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file = open(path, "rb")  # noqa: SIM115 - closed by close() / the context manager
        (header_len,) = struct.unpack("<Q", self._file.read(8))
        header: dict[str, Any] = json.loads(self._file.read(header_len))
        header.pop("__metadata__", None)
        self._data_start = 8 + header_len
        self._header = header

    def __enter__(self) -> SafetensorsSlices:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()

    def keys(self) -> Iterator[str]:
        return iter(self._header)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._header[key]["shape"])

    def read(self, key: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The tensor ``key``, or its ``index``: full slices except one ``slice(start, stop)``."""
        info = self._header[key]
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{self.path}: tensor {key} has dtype {info['dtype']}, which zerospeed cannot read")
        dtype, shape = _DTYPES[info["dtype"]], tuple(info["shape"])
        begin = self._data_start + info["data_offsets"][0]
        if index is None or not shape:   # the whole tensor: one run
            out = torch.empty(shape, dtype=dtype)
            self._read_runs(key, out, begin, 1, out.numel() * out.element_size(), 0)
            return out
        dim, start, stop = _the_split(shape, index)
        out = torch.empty((*shape[:dim], stop - start, *shape[dim + 1:]), dtype=dtype)
        inner = math.prod(shape[dim + 1:]) * out.element_size()
        # one contiguous run per index of the leading dims, each a row of the full tensor apart
        self._read_runs(key, out, begin + start * inner, math.prod(shape[:dim]), (stop - start) * inner,
                        shape[dim] * inner)
        return out

    def _read_runs(self, key: str, out: torch.Tensor, first: int, count: int, run: int, stride: int) -> None:
        if out.numel() == 0:
            return
        target = out.view(-1).view(torch.uint8).numpy().data
        for i in range(count):
            self._file.seek(first + i * stride)
            if self._file.readinto(target[i * run:(i + 1) * run]) != run:
                raise ValueError(f"{self.path}: tensor {key} is truncated")


def _the_split(shape: tuple[int, ...], index: tuple[slice, ...]) -> tuple[int, int, int]:
    """(dim, start, stop) of the one sliced dimension; the whole tensor as dim 0 when none is."""
    split = [(d, s) for d, s in enumerate(index) if s != slice(None)]
    if len(split) > 1:
        raise ValueError(f"only one sliced dimension is supported, got {index}")
    if not split:
        return 0, 0, shape[0]
    dim, sl = split[0]
    return dim, sl.start or 0, shape[dim] if sl.stop is None else sl.stop
