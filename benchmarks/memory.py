"""Memory probes for the training benchmark: peak RSS per phase and the live tensor state.

Peak per phase: Linux keeps a high-water mark of the resident set (VmHWM, what ru_maxrss reports)
and resets it to the current RSS when "5" is written to /proc/self/clear_refs. Resetting at each
phase boundary and reading VmHWM at the next gives the exact peak inside that phase (no sampling
thread that could miss a short-lived buffer or steal the rank's only core).

Model state: every live CPU tensor the garbage collector can see (parameters, gradients,
optimizer state, flat and bucket buffers held by Python objects), each storage once. Tensors held
only by C++ (autograd's saved activations) are not counted. `resident`
counts only pages the process has touched (mincore), so a large preallocated buffer that was never
written shows in `allocated` but not in `resident`.
"""

from __future__ import annotations

import ctypes
import gc
import mmap
import resource
import warnings

import torch

_MIB = 2.0 ** 20


class PeakRss:
    """High-water mark of the resident set between `reset()` and `read_mib()`."""

    def __init__(self) -> None:
        try:
            self._reset()
            self.per_phase = True
        except OSError:  # not Linux >= 4.0: only the whole-run peak (ru_maxrss)
            self.per_phase = False

    @staticmethod
    def _reset() -> None:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")

    def reset(self) -> None:
        if self.per_phase:
            self._reset()

    def read_mib(self) -> float:
        if not self.per_phase:
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
        with open("/proc/self/status") as handle:
            line = next(line for line in handle if line.startswith("VmHWM:"))
        return int(line.split()[1]) / 1024.0


def _resident_fraction(libc: ctypes.CDLL, address: int, num_bytes: int) -> float:
    page = mmap.PAGESIZE
    start = address - address % page
    num_pages = (address + num_bytes - start + page - 1) // page
    vector = (ctypes.c_ubyte * num_pages)()
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(num_pages * page), vector) != 0:
        return 1.0
    return sum(v & 1 for v in vector) / num_pages


def live_tensor_mib() -> tuple[float, float]:
    """(resident MiB, allocated MiB) of the distinct CPU tensor storages reachable from Python."""
    libc = ctypes.CDLL(None, use_errno=True)
    storages: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance() on deprecated module attributes warns
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in tensors:
        if obj.device.type != "cpu" or obj.is_sparse:
            continue
        try:  # a wrapper (DTensor: its local tensor counts) or a freed storage (FSDP2's unsharded) raise
            storage = obj.untyped_storage()
            address, num_bytes = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):
            continue
        if address and num_bytes:
            storages[address] = num_bytes
    allocated = sum(storages.values())
    resident = sum(n * _resident_fraction(libc, ptr, n) for ptr, n in storages.items())
    return resident / _MIB, allocated / _MIB


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def malloc_heap_mib() -> tuple[float, float] | None:
    """(heap MiB, free MiB inside it) over all of glibc's arenas (mallinfo2, glibc >= 2.33), or
    None elsewhere. Freed heap stays resident until glibc trims it: a heap that grows while its
    live part does not is RSS no tensor accounts for (issue 33: gloo's all-gather staging)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return None
    info = libc.mallinfo2()
    return info.arena / _MIB, info.fordblks / _MIB


class StateProbe:
    """Takes `live_tensor_mib()` once, at its first call after `arm()` (a step post-hook of the
    torch optimizer)."""

    def __init__(self) -> None:
        self.armed = False
        self.mib = (0.0, 0.0)

    def arm(self) -> None:
        self.armed = True

    def __call__(self, *_: object) -> None:
        if self.armed:
            self.armed = False
            self.mib = live_tensor_mib()
