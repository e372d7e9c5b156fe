"""Pipeline schedules, checked without processes by the simulator, and 1F1B against DeepSpeed."""

import json
import os
import subprocess
import sys

import pytest

from deepspeed_extensions import require_deepspeed

from zerospeed.runtime.pipe.executor import MAX_PENDING_SENDS
from zerospeed.runtime.pipe.instructions import (BackwardPass, ForwardPass, LoadMicroBatch, RecvActivation,
                                                 RecvGrad, SendActivation)
from zerospeed.runtime.pipe.schedule import DataParallelSchedule, InferenceSchedule, TrainSchedule
from zerospeed.runtime.pipe.schedule_lowering import (GPipeSchedule, Interleaved1F1BSchedule, LoweredSchedule,
                                                      ComputeOp, one_f_one_b_bubble)
from zerospeed.runtime.pipe.simulator import ScheduleError, simulate

GRID = [(stages, micro_batches) for stages in (1, 2, 3, 4, 6) for micro_batches in (1, 2, 3, 4, 8, 9)]


@pytest.mark.parametrize("stages,micro_batches", GRID)
def test_train_schedule_1f1b_passes_the_simulator_with_its_buffer_bound(stages, micro_batches):
    schedules = [TrainSchedule(micro_batches, stages, s) for s in range(stages)]
    report = simulate(schedules)
    for stage_id, peak in enumerate(report.peak_live_buffers):
        assert peak == min(stages - stage_id, micro_batches)  # 1F1B: in flight = distance to the end
        assert peak <= schedules[stage_id].num_pipe_buffers()
    assert sum(len(step) > 0 for step in schedules[0]) <= 2 * (micro_batches + stages - 1)


@pytest.mark.parametrize("stages,micro_batches", GRID)
def test_inference_schedule_passes_the_simulator(stages, micro_batches):
    report = simulate([InferenceSchedule(micro_batches, stages, s) for s in range(stages)], training=False)
    assert max(report.peak_live_buffers) <= 2


@pytest.mark.parametrize("stages,micro_batches", GRID)
def test_gpipe_passes_the_simulator_and_holds_every_micro_batch(stages, micro_batches):
    schedules = [GPipeSchedule(micro_batches, stages, s) for s in range(stages)]
    report = simulate(schedules)
    assert report.peak_live_buffers == [micro_batches] * stages
    simulate([GPipeSchedule(micro_batches, stages, s, training=False) for s in range(stages)], training=False)


@pytest.mark.parametrize("stages,micro_batches,chunks", [(s, m, v) for s in (2, 3, 4) for m in (s, 2 * s, 3 * s)
                                                          for v in (1, 2, 3)])
def test_interleaved_1f1b_passes_the_simulator_and_shrinks_the_bubble(stages, micro_batches, chunks):
    schedules = [Interleaved1F1BSchedule(micro_batches, stages, s, chunks) for s in range(stages)]
    report = simulate(schedules)
    for stage_id, schedule in enumerate(schedules):
        assert report.peak_live_buffers[stage_id] <= chunks * schedule.num_pipe_buffers()
    # Timed with forward 1 / backward 2 units, the idle share is the interleaved theory (S-1)/(vM+S-1).
    theory = (stages - 1) / (chunks * micro_batches + stages - 1)
    assert schedules[0].bubble_fraction() == pytest.approx(theory, abs=1e-9)
    if chunks == 1:
        assert theory == pytest.approx(one_f_one_b_bubble(micro_batches, stages))
    simulate([Interleaved1F1BSchedule(micro_batches, stages, s, chunks, training=False) for s in range(stages)],
             training=False)


def _train_schedules(kind, stages, micro_batches):
    if kind == "1f1b":
        return [TrainSchedule(micro_batches, stages, s) for s in range(stages)]
    if kind == "gpipe":
        return [GPipeSchedule(micro_batches, stages, s) for s in range(stages)]
    return [Interleaved1F1BSchedule(micro_batches, stages, s, 2) for s in range(stages)]


@pytest.mark.parametrize("kind", ["1f1b", "gpipe", "interleaved"])
def test_every_schedule_is_deadlock_free_with_blocking_and_with_the_executors_sends(kind):
    """[Note: send modes]: S in 2..8, M in S..2S+3 (interleaved: the multiples of S there), each
    schedule run with blocking sends (a rendezvous) and with the executor's bounded non-blocking ones."""
    for stages in range(2, 9):
        for micro_batches in range(stages, 2 * stages + 4):
            if kind == "interleaved" and micro_batches % stages:
                continue
            for pending in (0, MAX_PENDING_SENDS):
                simulate(_train_schedules(kind, stages, micro_batches), max_pending_sends=pending)


def test_send_mode_decides_whether_a_schedule_deadlocks():
    """Swapping a backward step's receive and send deadlocks blocking sends, not non-blocking ones."""
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate([_Swapped(4, 3, s) for s in range(3)], max_pending_sends=0)
    simulate([_Swapped(4, 3, s) for s in range(3)], max_pending_sends=1)


def test_messages_between_two_ranks_match_in_order_whatever_they_carry():
    """2 ranks, interleaved: activations and gradients share each channel, matched in order (as gloo
    matches by source and tag); a receive of the wrong kind is a mismatch, not a wait."""
    class GradFirst(Interleaved1F1BSchedule):
        def steps(self):
            steps = [list(step) for step in super().steps()]
            if self.stage_id == 1:   # receive stage 0's first message as a gradient
                first = next(i for i, step in enumerate(steps) if any(isinstance(c, RecvActivation) for c in step))
                steps[first] = [RecvGrad(c.buffer_id, c.micro_batch_id, c.chunk_id) if isinstance(c, RecvActivation)
                                else c for c in steps[first]]
            yield from steps

    with pytest.raises(ScheduleError, match="differ"):
        simulate([GradFirst(2, 2, s, 2) for s in range(2)], max_pending_sends=MAX_PENDING_SENDS)


def test_interleaved_refuses_micro_batches_not_multiple_of_stages():
    with pytest.raises(ValueError, match="multiple of the pipeline stages"):
        Interleaved1F1BSchedule(3, 2, 0, 2)


def test_data_parallel_schedule_on_one_stage():
    simulate([DataParallelSchedule(4, 1, 0)])


class _Swapped(TrainSchedule):
    """1F1B with the two communications of every backward step swapped: must deadlock."""

    def steps(self):
        for step in super().steps():
            comm = [c for c in step if type(c).__name__ in ("RecvGrad", "SendActivation")]
            rest = [c for c in step if c not in comm]
            yield list(reversed(comm)) + rest


class _ReusedBuffer(TrainSchedule):
    def num_pipe_buffers(self):
        return 1


class _LostMicroBatch(TrainSchedule):
    def steps(self):
        for step in super().steps():
            yield [c for c in step if not (isinstance(c, BackwardPass) and c.micro_batch_id == 1)]


class _BadOrder(LoweredSchedule):
    def compute_order(self, stage_id):
        return [ComputeOp(False, 0, 0), ComputeOp(True, 0, 0)]


@pytest.mark.parametrize("bad,match", [(_Swapped, "deadlock"), (_ReusedBuffer, "overwrites buffer|uses buffer"),
                                       (_LostMicroBatch, "no BackwardPass|before BackwardPass")])
def test_the_simulator_catches_broken_schedules(bad, match):
    with pytest.raises(ScheduleError, match=match):
        simulate([bad(4, 3, s) for s in range(3)])


def test_lowering_refuses_an_order_that_cannot_run():
    with pytest.raises(ValueError, match="cannot run"):
        _BadOrder(2, 2, 0).num_pipe_buffers()


def test_mismatched_micro_batches_are_caught():
    class Shifted(InferenceSchedule):
        def steps(self):
            for step in super().steps():
                yield [RecvActivation(c.buffer_id, c.micro_batch_id + 1) if isinstance(c, RecvActivation) else c
                       for c in step]

    with pytest.raises(ScheduleError, match="differ"):
        simulate([Shifted(3, 2, s) for s in range(2)], training=False)


def test_first_steps_of_1f1b_read_like_deepspeed():
    first = list(TrainSchedule(4, 2, 0))[:2]
    assert [type(c) for c in first[0]] == [LoadMicroBatch, ForwardPass]
    # Odd step on an even stage: backward of micro-batch -1 (idle), but micro-batch 0 leaves.
    assert first[1] == [SendActivation(0, 0)]
    second = list(TrainSchedule(4, 2, 1))[1]
    assert [type(c) for c in second] == [RecvActivation, LoadMicroBatch, ForwardPass]


_DEEPSPEED_DUMP = """
import json, sys
from deepspeed.runtime.pipe import schedule as s
out = {}
for stages in (1, 2, 3, 4, 6):
    for mbs in (1, 2, 3, 4, 8, 9):
        for sid in range(stages):
            for cls in (s.TrainSchedule, s.InferenceSchedule):
                key = f"{cls.__name__}/{mbs}/{stages}/{sid}"
                out[key] = [[[c.name, c.kwargs.get("buffer_id")] for c in step] for step in cls(mbs, stages, sid)]
json.dump(out, sys.stdout)
"""


def test_train_and_inference_schedules_equal_deepspeed_instruction_for_instruction():
    require_deepspeed()
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    done = subprocess.run([sys.executable, "-c", _DEEPSPEED_DUMP], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = json.loads(done.stdout)
    classes = {"TrainSchedule": TrainSchedule, "InferenceSchedule": InferenceSchedule}
    for key, steps in theirs.items():
        name, mbs, stages, sid = key.split("/")
        ours = [[[c.name, getattr(c, "buffer_id", None)] for c in step]
                for step in classes[name](int(mbs), int(stages), int(sid))]
        assert ours == steps, key
