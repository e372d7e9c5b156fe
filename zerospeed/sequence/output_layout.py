"""The attention output kept for backward in one layout only (Ulysses).

[Note: attention output in one layout]
Under Ulysses the local attention returns its output in the head layout ``[b, s, H/P, d]`` (whole
sequence, a block of heads) and the output exchange turns it into the sequence layout ``[b, s/P,
H, d]``. Autograd would keep both: the attention kernel saves its output for its own backward
(flash attention needs it), and the next projection saves its input, the exchanged output. The
two hold the same values, so this is one activation of ``s/P x H x d`` per layer that sp 1 does
not pay (measured: the only saved tensor that grows under Ulysses, benchmarks/sp_memory_phases.py).

`SingleLayoutOutput` is entered around the local attention; it wraps every tensor autograd saves
there. After the output exchange, `keep_exchanged_only` finds the saved tensors that share the
attention output's storage and replaces them by a recipe: in backward, the exchanged output goes
through the forward exchange again (a permutation, so the values are exact) and the saved view is
rebuilt on the result. Cost: one more all-to-all of the output per layer in backward. Every rank
of the group runs the same backward graph, so the extra collective lines up on all of them. A
saved tensor that does not share the output's storage (q, k, v, the log-sum-exp, a kernel's own
copy) is kept as it is; an output that is not one dense block (a kernel that returns a view into
something larger) keeps everything, so the saving is skipped, never wrong. Under other saved-tensor
hooks (non-reentrant activation checkpointing recomputes the attention anyway) it does nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType

import torch

__all__ = ["SingleLayoutOutput"]


class _Rebuilt:
    """The head-layout output, rebuilt from the exchanged one at most once per backward graph."""

    def __init__(self, exchanged: torch.Tensor, to_heads: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.exchanged, self.to_heads = exchanged, to_heads
        self.version = exchanged._version
        self.value: torch.Tensor | None = None

    def get(self) -> torch.Tensor:
        if self.value is None:
            if self.exchanged._version != self.version:
                raise RuntimeError("the exchanged attention output was modified in place after the forward; "
                                   "Ulysses rebuilds the attention's saved output from it in backward")
            with torch.no_grad():
                self.value = self.to_heads(self.exchanged).contiguous()
        return self.value


class _Saved:
    """What autograd holds for one saved tensor: the tensor, or a view of a `_Rebuilt` output."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.view: tuple[torch.Size, tuple[int, ...], int] | None = None
        self.source: _Rebuilt | None = None

    def defer(self, source: _Rebuilt) -> None:
        assert self.tensor is not None
        self.view = (self.tensor.shape, self.tensor.stride(), int(self.tensor.storage_offset()))
        self.source, self.tensor = source, None

    def unpack(self) -> torch.Tensor:
        if self.tensor is not None:
            return self.tensor
        assert self.source is not None and self.view is not None
        shape, stride, offset = self.view
        return self.source.get().as_strided(shape, stride, offset)


def _dense_block(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is all of its storage, in order (so a contiguous copy has the same layout)."""
    return (tensor.is_contiguous() and tensor.storage_offset() == 0
            and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size())


class SingleLayoutOutput:
    """``with SingleLayoutOutput() as saved: out = attention(...)``, then, after the exchange,
    ``saved.keep_exchanged_only(out, exchanged, to_heads)`` ([Note: attention output in one layout])."""

    def __init__(self) -> None:
        self._saved: list[_Saved] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _Saved.unpack)
        self._active = False

    def _pack(self, tensor: torch.Tensor) -> _Saved:
        saved = _Saved(tensor)
        self._saved.append(saved)
        return saved

    def __enter__(self) -> SingleLayoutOutput:
        # Hooks already in place (non-reentrant activation checkpointing, activation offload) decide
        # what is kept; ours would take the attention's tensors away from them, so step aside.
        top = torch._C._autograd._top_saved_tensors_default_hooks
        self._active = top(False) is None
        if self._active:
            self._hooks.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if self._active:
            self._hooks.__exit__(kind, error, traceback)

    def keep_exchanged_only(self, output: torch.Tensor, exchanged: torch.Tensor,
                            to_heads: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Saved tensors sharing ``output``'s storage are rebuilt from ``exchanged`` in backward,
        ``to_heads(exchanged)`` giving back a tensor equal to ``output`` (its shape, contiguous)."""
        saved, self._saved = self._saved, []
        if not self._active or not torch.is_grad_enabled() or not _dense_block(output):
            return
        storage = output.untyped_storage().data_ptr()
        source = _Rebuilt(exchanged, to_heads)
        for item in saved:
            tensor = item.tensor
            if tensor is not None and tensor.dtype == output.dtype and tensor.untyped_storage().data_ptr() == storage:
                item.defer(source)
