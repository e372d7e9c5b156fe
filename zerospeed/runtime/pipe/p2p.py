"""Point-to-point transfers between pipeline stages: activations forward, gradients back.

Sends are non-blocking (`isend`), receives blocking, between neighbouring stages (and last <->
first, for interleaved chunks). A blocking send waits until the peer posts its receive (gloo does:
measured, a send to a peer that receives 1 s later takes 1 s), so with blocking sends a stage that
finished a micro-batch idles until its neighbour is ready, which the schedule's theory does not
count. The send functions return their pending `Sends`; the executor waits on them later
(executor.py), keeping the tensors alive until then. DeepSpeed's sends block. Both modes are
proven deadlock-free for every schedule by the simulator ([Note: send modes] in simulator.py);
blocking sends did not cost measurably less CPU here (gloo's transport thread does the same
writes either way: the write waits for the receiver's "ready" notice in both; A/B in
docs/benchmarks.md), so the sends stay non-blocking.

[Note: one message per activation transfer]
The wire format is ours. An activation transfer is one message, a byte buffer: a fixed int64
header describing the tensors, then each tensor's bytes at an offset aligned to 64 bytes (the
CPU allocator's alignment, so kernels see the same alignment as in a fresh tensor):

    header = [num_tensors, (dtype_code, requires_grad, ndim, *shape) per tensor, 0-padding...]

The receiver must post a receive of the right size, so each side remembers, per peer, the size
of the last message (`MessageSizes`; a bare header before the first). When the sender's next
message has another size (shapes changed), it first sends an announcement: the new header alone,
padded to the size the receiver expects; the receiver sees that the header's size differs from
the message's and receives again at the new size. Shapes may so change from any micro-batch to
the next, at the cost of one more message only when they do. Over gloo a message costs far more
CPU than its bytes (its rendezvous wakes both sides' transport threads), so a header in a message
of its own on every transfer cost the receiving stage measurably more CPU than the copy into one
buffer does (docs/benchmarks.md). DeepSpeed sends the shapes once and caches them unless
`dynamic_shape=True`.

Integer tensors (masks, position ids) cross without gradient. A gradient transfer needs no header:
the receiving stage sent the activations and knows which of them require grad and their shapes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import torch

from zerospeed import comm

__all__ = ["HEADER_NUMEL", "MessageSizes", "Sends", "recv_activations", "recv_grads", "send_activations",
           "send_grads"]

HEADER_NUMEL = 256
_HEADER_BYTES = HEADER_NUMEL * 8
_ALIGN_BYTES = 64
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


def _header(tensors: tuple[torch.Tensor, ...], is_tuple: bool) -> tuple[torch.Tensor, list[_Slot], int]:
    """The header of `tensors`, with the layout it describes."""
    signature = tuple((t.dtype, t.requires_grad, tuple(t.shape)) for t in tensors)
    return _header_of(signature, is_tuple)


@functools.lru_cache(maxsize=64)
def _header_of(signature: tuple[tuple[torch.dtype, bool, tuple[int, ...]], ...],
               is_tuple: bool) -> tuple[torch.Tensor, list[_Slot], int]:
    """Cached per signature: a stage sends the same shapes on every micro-batch, and building the
    header tensor costs more than the message copy (measured: 30 us against 21 us for 128 KiB).
    Callers only read the returned tensor and list."""
    fields = [len(signature) if is_tuple else -1]
    for dtype, requires_grad, shape in signature:
        if dtype not in _CODE:
            raise TypeError(f"cannot send a {dtype} activation between pipeline stages")
        fields += [_CODE[dtype], int(requires_grad), len(shape), *shape]
    if len(fields) > HEADER_NUMEL:
        raise ValueError(f"activation metadata needs {len(fields)} > {HEADER_NUMEL} header fields: "
                         "too many tensors or dimensions cross this stage boundary")
    fields += [0] * (HEADER_NUMEL - len(fields))
    _, slots, message_bytes = _layout(fields)
    return torch.tensor(fields, dtype=torch.int64), slots, message_bytes


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where one tensor of an activation message lies."""

    dtype: torch.dtype
    shape: list[int]
    requires_grad: bool
    offset: int
    nbytes: int


def _layout(fields: list[int]) -> tuple[bool, list[_Slot], int]:
    """(is_tuple, each tensor's slot, message bytes) that a header describes."""
    count, is_tuple = (fields[0], True) if fields[0] >= 0 else (1, False)
    slots, position, offset = [], 1, _HEADER_BYTES
    for _ in range(count):
        code, requires_grad, ndim = fields[position:position + 3]
        shape = fields[position + 3:position + 3 + ndim]
        position += 3 + ndim
        dtype = _DTYPES[code]
        nbytes = math.prod(shape) * dtype.itemsize
        slots.append(_Slot(dtype, shape, bool(requires_grad), offset, nbytes))
        offset += -(-nbytes // _ALIGN_BYTES) * _ALIGN_BYTES
    return is_tuple, slots, offset


def _view(message: torch.Tensor, slot: _Slot) -> torch.Tensor:
    return message[slot.offset:slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)


Sends = list[tuple[Any, torch.Tensor]]   # (work, the tensor it reads), until waited on
MessageSizes = dict[int, int]            # peer rank -> bytes of the next activation message from / to it


def _isend(tensor: torch.Tensor, dst: int) -> tuple[Any, torch.Tensor]:
    return comm.isend(tensor, dst), tensor


def send_activations(value: Any, dst: int, device: torch.device, sizes: MessageSizes) -> Sends:
    """Send `value` to `dst` as one message ([Note: one message per activation transfer]); `sizes`
    is this stage's record of what it sent each peer, updated."""
    tensors = _as_tuple(value)
    header, slots, message_bytes = _header(tensors, isinstance(value, tuple))
    sends = []
    expected = sizes.get(dst, _HEADER_BYTES)
    if message_bytes != expected:
        announcement = torch.zeros(expected, dtype=torch.uint8, device=device)
        announcement[:_HEADER_BYTES].view(torch.int64).copy_(header)
        sends.append(_isend(announcement, dst))
        sizes[dst] = message_bytes
    message = torch.empty(message_bytes, dtype=torch.uint8, device=device)
    message[:_HEADER_BYTES].view(torch.int64).copy_(header)
    for tensor, slot in zip(tensors, slots):
        _view(message, slot).copy_(tensor.detach())
    return sends + [_isend(message, dst)]


def recv_activations(src: int, device: torch.device, sizes: MessageSizes) -> Any:
    """The activations `src` sent, as views of the received message; floating ones that required
    grad there require grad here. `sizes` is this stage's record of what each peer sent, updated."""
    expected = sizes.get(src, _HEADER_BYTES)
    message = torch.empty(expected, dtype=torch.uint8, device=device)
    comm.recv(message, src)
    is_tuple, slots, message_bytes = _layout(message[:_HEADER_BYTES].view(torch.int64).tolist())
    if message_bytes != expected:   # an announcement: the activations follow at their size
        sizes[src] = message_bytes
        message = torch.empty(message_bytes, dtype=torch.uint8, device=device)
        comm.recv(message, src)
    tensors = [_view(message, slot).requires_grad_(slot.requires_grad and slot.dtype.is_floating_point)
               for slot in slots]
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
