"""The dynamic loss scaler follows DeepSpeed's algorithm: sequences worked out by hand from its rules."""

import pytest
import torch

from zerospeed.runtime.fp16.loss_scaler import (DynamicLossScaler, LossScaleAtMinimumError, LossScaler,
                                                create_loss_scaler)

F, T = False, True


def _scales(scaler, overflows):
    sequence = []
    for overflow in overflows:
        scaler.update_scale(overflow)
        sequence.append(scaler.cur_scale)
    return sequence


def test_hysteresis_delays_halving_and_window_doubles():
    scaler = DynamicLossScaler(init_scale=16, scale_window=3, min_scale=1, delayed_shift=2)
    pattern = [F, F, F, T, F, F, F, F, T, T, T, F]
    # iter 3: hysteresis 2 -> 1, no change; iter 7: 3 clean steps since the overflow -> x2 (hysteresis
    # refilled); iters 8-10: 2 -> 1, then halve, halve.
    assert _scales(scaler, pattern) == [16, 16, 16, 16, 16, 16, 16, 32, 32, 16, 8, 8]


@pytest.mark.parametrize("consecutive,expected", [(False, [16, 16, 8]), (True, [16, 16, 16])])
def test_consecutive_hysteresis_refills_on_every_clean_step(consecutive, expected):
    scaler = DynamicLossScaler(init_scale=16, scale_window=1000, min_scale=1, delayed_shift=2,
                               consecutive_hysteresis=consecutive)
    assert _scales(scaler, [T, F, T]) == expected


def test_first_doubling_after_window_clean_steps():
    scaler = DynamicLossScaler(init_scale=2.0**16, scale_window=1000)
    scales = _scales(scaler, [F] * 1001)
    assert scales[999] == 2.0**16 and scales[1000] == 2.0**17  # the 1001st call doubles


def test_overflow_at_minimum_scale_stops_with_advice():
    scaler = DynamicLossScaler(init_scale=2, scale_window=10, min_scale=1, delayed_shift=1)
    assert _scales(scaler, [T]) == [1]
    with pytest.raises(LossScaleAtMinimumError, match="minimum.*try bf16"):
        scaler.update_scale(True)


def test_halving_never_goes_below_min_scale():
    scaler = DynamicLossScaler(init_scale=3, scale_window=10, min_scale=2, delayed_shift=1)
    assert _scales(scaler, [T]) == [2]


def test_state_dict_round_trip():
    scaler = DynamicLossScaler(init_scale=16, scale_window=3, delayed_shift=2)
    _scales(scaler, [F, T, F, F])
    restored = DynamicLossScaler()
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()
    assert _scales(restored, [F, T, T]) == _scales(scaler, [F, T, T])


def test_static_and_non_fp16_scalers():
    assert isinstance(create_loss_scaler(torch.bfloat16, 128.0, True), LossScaler)
    assert create_loss_scaler(torch.bfloat16, 128.0, True).cur_scale == 1.0
    assert create_loss_scaler(torch.float16, 128.0, False).cur_scale == 128.0
    dynamic = create_loss_scaler(torch.float16, 0, True, {"init_scale": 2.0**8, "scale_window": 5,
                                                          "min_scale": 1, "delayed_shift": 2,
                                                          "consecutive_hysteresis": False})
    assert dynamic.dynamic and dynamic.cur_scale == 256
    loss = torch.tensor(2.0)
    assert dynamic.scale_loss(loss).item() == 512
