"""Stage 1's gradients as views of the flat gradient buffer: autograd accumulates into it in place.

[Note: stage-1 gradients as views]
At stage 1 every param group has one full flat gradient buffer (`_FlatGroup.grads`, the group's
layout, padded), reduced at the boundary so that this rank's partition of it holds the averaged
gradients. Each trainable parameter's `.grad` is pointed at its slot in that buffer
(`layout.param_offsets`) when an accumulation window opens (`attach`, from the first micro-batch's
`prepare_backward`): autograd's gradient accumulation then adds each micro-batch's gradient straight
into the buffer, as it adds into any existing `.grad`, and the gradient hook only records the
arrival (and, with `overlap_comm` on the boundary micro-batch, hands the slot to the buckets). This
is stage 0's mechanism ([Note: gradients as bucket views] in runtime/overlapped_allreduce.py) on
stage 1's own buffer, which exists from the start: no memory is added. Per parameter and
micro-batch the add into the buffer moves from the hook (Python: a narrow, a reshape, an `add_`,
then `param.grad = None`) into autograd's own accumulation, in C++ (issue 33).

The bits are the old ones: the buffer is zeroed by `zero_grad` (and allocated zeroed) as before,
and the old hook added each micro-batch's gradient into it in the same order and dtype that
autograd's in-place accumulation now does (0 + g1, then + g2, ...); the reduction reads the same
buffer.

A `.grad` that is not its view when the hook runs or the boundary reduces (the user set it to None
or to another tensor mid-window, `module.zero_grad()`, a backward outside `engine.backward`, a
double backward whose accumulation is out of place) is copied into the view, or the view zeroed if
it is None, and `.grad` pointed at the view again: what `.grad` holds is the gradient, as in DDP and
at stage 0. After the boundary reduction the buffer holds this rank's reduced partition and other
ranks' stale slices, so every `.grad` is set to None there (`release`), as the old path left them
after each backward; `zero_grad` does too. Between the micro-batches of a window `.grad` is the
gradient accumulated so far, as DeepSpeed's stage 1 keeps it in `param.grad`.

Views need the buffer in the parameters' dtype and device (PyTorch refuses a `.grad` of another
dtype): with `data_types.grad_accum_dtype` other than the model's (bf16/fp16 parameters
accumulating in fp32) there are no views; the hook adds each gradient into the buffer and frees it,
as before. Stage 2 has no full buffer to point into (its gradients are bucketed and reduced every
backward) and keeps its path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["FlatGradViews"]


class FlatGradViews:
    """One param group's trainable parameters and their `.grad` slots in its flat gradient buffer."""

    def __init__(self, params: list[torch.Tensor], flat: torch.Tensor, offsets: Sequence[int]) -> None:
        self.params = params
        self.views = [flat.narrow(0, offset, param.numel()).view(param.shape) for param, offset in zip(params, offsets)]
        self.attached = False

    @staticmethod
    def possible(params: list[torch.Tensor], flat: torch.Tensor) -> bool:
        """Whether `.grad` may be a view of `flat`: the parameters' dtype and device."""
        return all(p.dtype == flat.dtype and p.device == flat.device for p in params)

    def attach(self) -> None:
        """A window opens: point each `.grad` at its view, copying in a gradient already there."""
        if self.attached:
            return
        for param, view in zip(self.params, self.views):
            grad = param.grad
            if grad is not view:
                if grad is not None:
                    _copy_into(view, grad)
                param.grad = view
        self.attached = True

    def adopt(self, index: int) -> torch.Tensor:
        """Parameter `index`'s view, made to hold its gradient (a foreign `.grad` copied in, None as zeros)."""
        param, view = self.params[index], self.views[index]
        if param.grad is not view:   # rare: [Note: stage-1 gradients as views]
            grad = param.grad
            if grad is None:
                _zero(view)
            else:
                _copy_into(view, grad)
            param.grad = view
        return view

    def adopt_all(self) -> None:
        for index in range(len(self.params)):
            self.adopt(index)

    def release(self) -> None:
        """The window is over (reduced, or zero_grad): every `.grad` is None until the next one."""
        for param in self.params:
            param.grad = None
        self.attached = False


@torch.no_grad()
def _copy_into(view: torch.Tensor, grad: torch.Tensor) -> None:
    view.copy_(grad)


@torch.no_grad()
def _zero(view: torch.Tensor) -> None:
    view.zero_()
