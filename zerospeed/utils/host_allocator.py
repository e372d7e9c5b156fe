"""glibc's dynamic mmap threshold, settled once per process at engine start when asked to.

[Note: glibc mmap threshold]
glibc's malloc serves a block above `M_MMAP_THRESHOLD` (128 KiB at start) with a fresh `mmap`,
whose pages the kernel faults in and zeroes on first touch, and returns it to the system on free.
The threshold is dynamic: freeing a mapped block of up to 32 MiB raises it to that block's size
(and the heap's trim threshold to twice that), after which blocks of that size are reused from
the heap. A training process allocates the same activations, gradients and buffers of a few MiB
every step, so where its threshold ends up, and when, decides whether each step re-faults tens of
MiB or reuses them: it depended on which block happened to be freed first, differed between ranks
and between runs, and showed as bursts of 4-40k minor faults on some steps and none on others
(issue 21: stage 0's step-time jitter on the wide4 GPT, 40k faults a step on wide10 once stage 0's
own buffers stopped raising the threshold by accident).

With `ZS_SETTLE_MMAP_THRESHOLD=1`, `settle_mmap_threshold` maps and frees one untouched block just
under glibc's ceiling at engine start, so the threshold starts where a long run would take it
anyway (32 MiB, trim 64 MiB) on every rank. Only the starting point moves: glibc's own dynamic
rule is kept, and a threshold the user fixed through `MALLOC_MMAP_THRESHOLD_` (which turns the
dynamic rule off) is left alone, as is every non-glibc platform.

It is off by default because it trades memory for faults: blocks up to 32 MiB freed into the heap
stay resident and fragment it. Measured (docs/benchmarks.md): wide10 stage 0 3k faults a step
instead of 10-40k, but the Ulysses benchmark's sp 2 peak at 16k tokens 920 MiB instead of 861,
and peak RSS is what decides whether a model fits. DeepSpeed leaves the allocator alone too.
"""

from __future__ import annotations

import functools
import os
import platform

import torch

__all__ = ["settle_mmap_threshold"]

# glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit platforms: freed mapped blocks above it do not move
# the threshold, so the block stays a page below it (its header included).
_GLIBC_DYNAMIC_CEILING_BYTES = 32 << 20
_BLOCK_BYTES = _GLIBC_DYNAMIC_CEILING_BYTES - (64 << 10)


@functools.cache
def settle_mmap_threshold() -> bool:
    """Raise glibc's dynamic mmap threshold to its ceiling once per process if
    `ZS_SETTLE_MMAP_THRESHOLD=1`; True if it was done."""
    if os.environ.get("ZS_SETTLE_MMAP_THRESHOLD", "0") != "1" or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    # Mapped, never touched (no page is faulted in), then unmapped: free() moves the threshold.
    block = torch.empty(_BLOCK_BYTES, dtype=torch.uint8)
    del block
    return True
