"""Gradient arithmetic on its own: the chunked float64 sum of squares against a float64 reference,
the clip factor against its formula."""

import pytest
import torch

from zerospeed.runtime.grad_utils import any_non_finite, sum_of_squares, unscale_and_clip_factor


@pytest.mark.parametrize("numel", [0, 5, 1024, 5000, 70_000, 1_000_003])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_of_squares_matches_float64(numel, dtype):
    torch.manual_seed(numel)
    tensors = [(torch.randn(numel) * 1e-3).to(dtype), torch.randn(3, 7).to(dtype)]
    expected = sum(float(t.double().square().sum()) for t in tensors)
    got = sum_of_squares(tensors)
    assert got.dtype == torch.float64 and got.dim() == 0
    assert abs(float(got) - expected) <= 2e-7 * expected


def test_sum_of_squares_of_a_non_contiguous_tensor():
    tensor = torch.randn(3000, 5).t()
    assert abs(float(sum_of_squares([tensor])) - float(tensor.double().square().sum())) <= 2e-7 * float(
        tensor.double().square().sum())


@pytest.mark.parametrize("numel", [5000, 70_000])
def test_non_finite_values_reach_the_norm(numel):
    tensor = torch.randn(numel)
    tensor[4000] = float("inf")
    assert float(sum_of_squares([tensor])) == float("inf")
    tensor[4000] = float("nan")
    assert torch.isnan(sum_of_squares([tensor]))
    assert float(sum_of_squares([])) == 0.0


def test_clip_factor_formula():
    # DeepSpeed's: clip = (norm / scale + 1e-6) / max_norm, applied only above 1
    assert unscale_and_clip_factor(scaled_norm=8.0, loss_scale=4.0, clip_grad=1.0) == pytest.approx(4.0 * (2.0 + 1e-6))
    assert unscale_and_clip_factor(scaled_norm=2.0, loss_scale=4.0, clip_grad=1.0) == 4.0
    assert unscale_and_clip_factor(scaled_norm=8.0, loss_scale=4.0, clip_grad=0.0) == 4.0
    # a non-finite norm (overflow check off) is not clipped by: inf would zero every gradient
    assert unscale_and_clip_factor(scaled_norm=float("inf"), loss_scale=1.0, clip_grad=1.0) == 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_overflow_check_is_exact(dtype):
    tensors = [torch.randn(5000).to(dtype), torch.randn(3, 7).to(dtype)]
    assert not any_non_finite(tensors) and not any_non_finite([])
    for bad in (float("inf"), float("-inf"), float("nan")):
        tensors[0][1234] = bad
        assert any_non_finite(tensors), bad
    # finite values whose float32 sum overflows: the quick sum flags them, the exact check clears them
    big = torch.full((4,), 3e38)
    assert torch.isinf(big.sum()) and not any_non_finite([big, torch.zeros(3)])
