"""`ReusedBuffers`: a fixed set of flat buffers, each allocated on first use and kept for the run.

[Note: reused flat buffers]
Gradient reductions copy gradients into flat buffers (stage 3's slabs; stage 0's buckets when they
are reduced in another dtype than the gradients'). A fresh buffer per reduction and step is, on a
CPU, mapped and first-touched anew whenever glibc has given the previous one back to the system:
thousands of minor page faults on some steps and none on others, which was much of the step-time
jitter of issue 21. So both reducers take their buffers from here: buffer `i` is allocated once, at
its use's size, and the same memory serves every later step.
The reducer decides which buffer a reduction uses and must not reuse one whose reduction is still
in flight; both keep two, taking turns, and wait for the older reduction before refilling its buffer.
All buffers live on one device, the first one's, so a stand-in gradient from elsewhere (a zero on
the host) is copied across rather than splitting the set.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["ReusedBuffers"]


class ReusedBuffers:
    """`len(numels)` flat buffers of `dtype`; buffer `i` holds `numels[i]` elements."""

    def __init__(self, numels: Sequence[int], dtype: torch.dtype) -> None:
        self.numels = list(numels)
        self.dtype = dtype
        self._buffers: list[torch.Tensor | None] = [None] * len(self.numels)

    def __len__(self) -> int:
        return len(self.numels)

    def get(self, index: int, device: torch.device) -> torch.Tensor:
        """Buffer `index`, allocated now on its first use (on `device`, or where the others are)."""
        buffer = self._buffers[index]
        if buffer is None:
            placed = next((b.device for b in self._buffers if b is not None), device)
            buffer = self._buffers[index] = torch.empty(self.numels[index], dtype=self.dtype, device=placed)
        return buffer

    def allocated(self) -> list[torch.Tensor]:
        return [b for b in self._buffers if b is not None]

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.allocated())
