"""Point-to-point transfers between pipeline stages: activations forward, gradients back.

Sends are non-blocking (`isend`), receives blocking, between neighbouring stages (and last <->
first, for interleaved chunks). A blocking send waits until the peer posts its receive (gloo does:
measured, a send to a peer that receives 1 s later takes 1 s), so with blocking sends a stage that
finished a micro-batch idles until its neighbour is ready, which the schedule's theory does not
count. The send functions return their pending `Sends`; the executor waits on them later
(executor.py), keeping the tensors alive until then. DeepSpeed's sends block. The wire format is ours and simple: every activation transfer starts with a fixed
int64 header describing the tensors that follow, so shapes may change from one micro-batch to the
next (DeepSpeed caches the first shapes unless `dynamic_shape=True`, and sends the metadata with
its own pickled-object path otherwise):

    header = [num_tensors, (dtype_code, requires_grad, ndim, *shape) per tensor, 0-padding...]

Integer tensors (masks, position ids) cross without gradient. A gradient transfer needs no header:
the receiving stage sent the activations and knows which of them require grad and their shapes.
"""

from __future__ import annotations

from typing import Any

import torch

from zerospeed import comm

__all__ = ["HEADER_NUMEL", "Sends", "recv_activations", "recv_grads", "send_activations", "send_grads"]

HEADER_NUMEL = 256
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}


def _as_tuple(value: Any) -> tuple[torch.Tensor, ...]:
    tensors = value if isinstance(value, tuple) else (value,)
    for tensor in tensors:
        if not torch.is_tensor(tensor):
            raise TypeError(f"pipeline stages exchange tensors or tuples of tensors; got {type(tensor).__name__} "
                            "(pass other values inside a layer, or as tensors)")
    return tensors


def _header(tensors: tuple[torch.Tensor, ...], is_tuple: bool) -> torch.Tensor:
    fields = [len(tensors) if is_tuple else -1]
    for tensor in tensors:
        if tensor.dtype not in _CODE:
            raise TypeError(f"cannot send a {tensor.dtype} activation between pipeline stages")
        fields += [_CODE[tensor.dtype], int(tensor.requires_grad), tensor.dim(), *tensor.shape]
    if len(fields) > HEADER_NUMEL:
        raise ValueError(f"activation metadata needs {len(fields)} > {HEADER_NUMEL} header fields: "
                         "too many tensors or dimensions cross this stage boundary")
    return torch.tensor(fields + [0] * (HEADER_NUMEL - len(fields)), dtype=torch.int64)


Sends = list[tuple[Any, torch.Tensor]]   # (work, the tensor it reads), until waited on


def _isend(tensor: torch.Tensor, dst: int) -> tuple[Any, torch.Tensor]:
    return comm.isend(tensor, dst), tensor


def send_activations(value: Any, dst: int, device: torch.device) -> Sends:
    tensors = _as_tuple(value)
    sends = [_isend(_header(tensors, isinstance(value, tuple)).to(device), dst)]
    return sends + [_isend(tensor.detach().contiguous(), dst) for tensor in tensors]


def recv_activations(src: int, device: torch.device) -> Any:
    """The activations `src` sent; floating ones that required grad there require grad here."""
    header = torch.empty(HEADER_NUMEL, dtype=torch.int64, device=device)
    comm.recv(header, src)
    fields = header.tolist()
    count, is_tuple = (fields[0], True) if fields[0] >= 0 else (1, False)
    tensors, position = [], 1
    for _ in range(count):
        code, requires_grad, ndim = fields[position:position + 3]
        shape = fields[position + 3:position + 3 + ndim]
        position += 3 + ndim
        tensor = torch.empty(shape, dtype=_DTYPES[code], device=device)
        comm.recv(tensor, src)
        tensors.append(tensor.requires_grad_(bool(requires_grad) and tensor.is_floating_point()))
    return tuple(tensors) if is_tuple else tensors[0]


def grad_carrying(value: Any) -> list[torch.Tensor]:
    """The tensors of an activation that gradients flow back through (floating, requiring grad)."""
    return [t for t in _as_tuple(value) if t.is_floating_point() and t.requires_grad]


def send_grads(inputs: Any, dst: int) -> Sends:
    """Send the gradient of every grad-carrying input back to the stage that produced it."""
    sends = []
    for tensor in grad_carrying(inputs):
        grad = tensor.grad if tensor.grad is not None else torch.zeros_like(tensor)
        sends.append(_isend(grad.contiguous(), dst))
    return sends


def recv_grads(outputs: Any, src: int) -> list[torch.Tensor]:
    grads = []
    for tensor in grad_carrying(outputs):
        grad = torch.empty_like(tensor)
        comm.recv(grad, src)
        grads.append(grad)
    return grads
