"""Timers measure a known sleep, synchronize the accelerator and print DeepSpeed's lines."""

from __future__ import annotations

import time

import pytest

from zerospeed.utils.timer import SynchronizedWallClockTimer, ThroughputTimer

SLEEP_S = 0.05


def test_timer_measures_sleep_and_accumulates():
    timers = SynchronizedWallClockTimer()
    for _ in range(2):
        timers("fwd").start()
        time.sleep(SLEEP_S)
        timers("fwd").stop()
    elapsed_ms = timers("fwd").elapsed(reset=False)
    assert 2 * SLEEP_S * 1000 <= elapsed_ms < 2 * SLEEP_S * 1000 + 60
    assert timers("fwd").elapsed(reset=True) == elapsed_ms
    assert timers("fwd").elapsed() == 0.0


def test_timer_synchronizes_on_start_and_stop():
    calls = []
    timers = SynchronizedWallClockTimer(synchronize=lambda: calls.append(1))
    timers("step").start()
    timers("step").stop()
    assert len(calls) == 2


def test_misuse_raises():
    timers = SynchronizedWallClockTimer()
    with pytest.raises(RuntimeError, match="not started"):
        timers("bwd").stop()
    timers("bwd").start()
    with pytest.raises(RuntimeError, match="already been started"):
        timers("bwd").start()


def test_log_line_format(capsys):
    timers = SynchronizedWallClockTimer()
    for name, sleep_s in (("fwd_microstep", SLEEP_S), ("bwd_microstep", 2 * SLEEP_S)):
        timers(name).start()
        time.sleep(sleep_s)
        timers(name).stop()
    timers.log(["fwd_microstep", "bwd_microstep", "step_microstep"], normalizer=2.0)
    line = capsys.readouterr().out.strip()
    prefix, fwd, bwd = line.split(" | ")
    assert prefix == "[Rank 0] time (ms)"
    assert fwd.startswith("fwd_microstep: ") and bwd.startswith("bwd_microstep: ")
    assert float(fwd.split(": ")[1]) == pytest.approx(SLEEP_S * 1000 / 2, abs=30)
    assert float(bwd.split(": ")[1]) == pytest.approx(SLEEP_S * 1000, abs=30)
    assert timers("fwd_microstep").elapsed() == 0.0  # log resets by default


def test_throughput_skips_warmup_and_averages():
    lines = []
    timer = ThroughputTimer(batch_size=8, steps_per_output=2, start_step=2, logging_fn=lines.append)
    for _ in range(4):  # two untimed warm-up steps, then two timed ones
        timer.start()
        time.sleep(SLEEP_S)
        timer.stop(global_step=True, report_speed=True)
    assert timer.global_step_count == 4 and timer.micro_step_count == 4
    assert timer.total_elapsed_time == pytest.approx(2 * SLEEP_S, abs=0.06)
    assert timer.avg_samples_per_sec() == pytest.approx(8 / SLEEP_S, rel=0.5)
    assert timer.avg_samples_per_sec() == pytest.approx(8 / (timer.total_elapsed_time / 2))
    assert len(lines) == 1  # printed at global step 4 (step 2 was not timed)
    assert lines[0].startswith("epoch=0/micro_step=4/global_step=4, RunningAvgSamplesPerSec=")
    assert "CurrSamplesPerSec=" in lines[0] and "MemAllocated=" in lines[0] and "MaxMemAllocated=" in lines[0]


def test_throughput_before_timing_is_minus_inf():
    timer = ThroughputTimer(batch_size=4)
    timer.start()
    timer.stop(global_step=True)
    assert timer.avg_samples_per_sec() == float("-inf")
