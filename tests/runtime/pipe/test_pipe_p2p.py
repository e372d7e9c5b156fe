"""Activation transfers between two gloo ranks ([Note: one message per activation transfer]):
values cross exactly whatever their shapes, dtypes and tuple structure from one transfer to the
next, in one message while the message size stays the same and two when it changes."""

from typing import Any

import torch

from distributed import run_on_ranks

from zerospeed import comm
from zerospeed.runtime.pipe import p2p


def _values() -> list[Any]:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 8, 4, generator=generator)
    mask = torch.tensor([[True, False, True]])
    return [
        hidden,                                                  # first transfer: announced
        hidden * 2,                                              # same size: one message
        hidden.reshape(4, 4, 4),                                 # same bytes, other shape: one message
        (hidden[:1], torch.arange(20), mask),                    # a tuple, other size: announced
        (hidden[:1] + 1, torch.arange(20) + 1, ~mask),           # same sizes: one message
        torch.randn(3, 5, generator=generator).double().t(),     # non-contiguous float64
        torch.empty(0, 4),                                       # empty
        hidden.half(),
    ]


def _transfer() -> list[Any]:
    sizes: p2p.MessageSizes = {}
    messages = []
    if comm.get_rank() == 0:
        for value in _values():
            sends = p2p.send_activations(value, 1, torch.device("cpu"), sizes)
            messages.append(len(sends))
            for work, _ in sends:
                work.wait()
        return messages
    received = []
    for _ in _values():
        value = p2p.recv_activations(0, torch.device("cpu"), sizes)
        received.append(value)
    return received


def _flat(value: Any) -> tuple[torch.Tensor, ...]:
    return value if isinstance(value, tuple) else (value,)


def test_activations_cross_exactly_in_one_message_unless_their_size_changes():
    messages, received = run_on_ranks(_transfer, 2)
    assert messages == [2, 1, 1, 2, 1, 2, 2, 2]
    for sent, got in zip(_values(), received):
        assert isinstance(got, tuple) == isinstance(sent, tuple)
        for a, b in zip(_flat(sent), _flat(got), strict=True):
            assert b.dtype == a.dtype and b.shape == a.shape
            assert torch.equal(a, b)
            assert b.data_ptr() % 64 == 0   # the CPU allocator's alignment, as a fresh tensor's


def _grad_flags() -> list[bool]:
    sizes: p2p.MessageSizes = {}
    if comm.get_rank() == 0:
        value = (torch.ones(2, 3, requires_grad=True) * 2, torch.arange(3), torch.ones(2))
        for work, _ in p2p.send_activations(value, 1, torch.device("cpu"), sizes):
            work.wait()
        return []
    return [t.requires_grad for t in p2p.recv_activations(0, torch.device("cpu"), sizes)]


def test_received_activations_require_grad_where_the_sent_ones_did():
    assert run_on_ranks(_grad_flags, 2)[1] == [True, False, False]
