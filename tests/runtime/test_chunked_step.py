"""`step_in_chunks` ([Note: chunked optimizer step]) gives the bits of a plain `step()`.

Two copies of the same parameters (one flat partition of an uneven size and a small tensor) step
side by side for a few steps, one plainly, one in chunks of 1000 elements: parameters and the
whole optimizer state are compared with `torch.equal`, and the chunked optimizer's state holds
nothing but the original parameters afterwards.
"""

import pytest
import torch

from zerospeed.runtime.chunked_step import step_in_chunks

NUM_STEPS = 4
CASES = [(torch.optim.AdamW, dict(weight_decay=0.01)),
         (torch.optim.Adam, dict(weight_decay=0.01)),
         (torch.optim.AdamW, dict(amsgrad=True, betas=(0.8, 0.9))),
         (torch.optim.Adam, dict(maximize=True, eps=1e-6))]


def _params() -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(10_007, generator=generator)),
            torch.nn.Parameter(torch.randn(3, 5, generator=generator))]


def _run(kind, options, chunked: bool):
    params = _params()
    optimizer = kind(params, lr=1e-2, **options)
    generator = torch.Generator().manual_seed(1)
    for _ in range(NUM_STEPS):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)
        if chunked:
            step_in_chunks(optimizer, chunk_numel=1000)
        else:
            optimizer.step()
    return params, optimizer


@pytest.mark.parametrize("kind,options", CASES)
def test_chunked_step_equals_plain_step_bit_for_bit(kind, options):
    plain_params, plain = _run(kind, options, chunked=False)
    chunked_params, chunked = _run(kind, options, chunked=True)
    for got, want in zip(chunked_params, plain_params):
        assert torch.equal(got, want)
    assert set(chunked.state) == set(chunked_params)
    for got_param, want_param in zip(chunked_params, plain_params):
        got_state, want_state = chunked.state[got_param], plain.state[want_param]
        assert sorted(got_state) == sorted(want_state)
        for key, value in want_state.items():
            assert torch.equal(got_state[key], value), key
    assert chunked.state[chunked_params[0]]["step"].item() == NUM_STEPS


def test_the_step_peak_is_bounded_by_the_chunk():
    """The single-tensor Adam allocates two temporaries the size of what it steps at once: with
    chunks, no allocation during the step is larger than a chunk."""
    params, optimizer = _run(torch.optim.AdamW, {}, chunked=True)   # state exists now
    for param in params:
        param.grad = torch.ones_like(param)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step_in_chunks(optimizer, chunk_numel=1000)
    largest = max((event.cpu_memory_usage for event in prof.events()), default=0)
    assert 0 < largest <= 1000 * 4


def test_other_optimizers_step_as_before():
    params = _params()
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    for param in params:
        param.grad = torch.ones_like(param)
    step_in_chunks(optimizer, chunk_numel=1000)
    assert set(optimizer.state) == set(params)
