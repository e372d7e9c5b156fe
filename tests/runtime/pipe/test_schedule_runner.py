"""`ScheduleRunner`, the part of `PipelineEngine` that runs a batch's schedule, on its own: its
refusals, its cached instruction lists, one single-stage batch run through a real `StageExecutor`
against plain torch (no processes: one stage sends nothing), and its loss reductions (formulas)."""

from __future__ import annotations

import pytest
import torch

from zerospeed.runtime.pipe import instructions as ins
from zerospeed.runtime.pipe.schedule import InferenceSchedule, TrainSchedule
from zerospeed.runtime.pipe.schedule_runner import ScheduleRunner

MICRO_BATCHES = 4


class _OneStageGrid:
    def get_pipe_parallel_world_size(self) -> int:
        return 1

    def get_stage_id(self) -> int:
        return 0

    def stage_to_global(self, stage_id: int) -> int:
        return stage_id


class _Module(torch.nn.Module):
    """A one-stage pipeline module: a linear layer and a squared-error loss."""

    num_chunks = 1

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(3, 1)
        self.loss_fn = lambda out, labels: ((out - labels) ** 2).mean()
        self.tied_comms = self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def reduce_and_inject(self) -> None:
        pass


class _Wrapper:
    """The optimizer wrapper's backward surface, recording the calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []

    def prepare_backward(self, is_boundary: bool) -> None:
        self.calls.append(("prepare", is_boundary))

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def backward_epilogue(self, is_boundary: bool) -> None:
        self.calls.append(("epilogue", is_boundary))


class _Host:
    def __init__(self) -> None:
        self.module, self.optimizer, self.steps = _Module(), _Wrapper(), 0

    def _pipeline_optimizer_step(self) -> None:
        self.steps += 1


def _runner(name: str = "1f1b", chunks: int = 1) -> ScheduleRunner:
    return ScheduleRunner(name, _OneStageGrid(), chunks, None, 1, torch.device("cpu"))


def test_refuses_unknown_schedules_and_chunk_mismatches():
    with pytest.raises(ValueError, match="pipeline.schedule must be one of"):
        _runner("zigzag")
    with pytest.raises(ValueError, match="needs PipelineModule"):
        _runner("interleaved_1f1b", 1)
    with pytest.raises(ValueError, match="needs PipelineModule"):
        _runner("gpipe", 2)


def test_steps_are_the_schedules_built_once():
    runner = _runner()
    train, infer = runner.steps(True, MICRO_BATCHES), runner.steps(False, MICRO_BATCHES)
    assert train == list(TrainSchedule(MICRO_BATCHES, 1, 0)) and infer == list(InferenceSchedule(MICRO_BATCHES, 1, 0))
    assert runner.steps(True, MICRO_BATCHES) is train


def test_a_training_batch_averages_gradients_over_micro_batches():
    torch.manual_seed(1)
    batches = [(torch.randn(2, 3), torch.randn(2, 1)) for _ in range(MICRO_BATCHES)]
    host, runner = _Host(), _runner()
    executor = runner.run(host, iter(batches), True, MICRO_BATCHES)
    reference = _Module()
    expected_losses = [reference.loss_fn(reference(x), y) for x, y in batches]
    (torch.stack(expected_losses).sum() / MICRO_BATCHES).backward()
    assert torch.allclose(torch.stack(executor.losses), torch.stack(expected_losses).detach())
    for got, want in zip(host.module.parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad)
    assert host.steps == 1 and host.optimizer.calls[-1] == ("epilogue", True)
    assert [name for name, *_ in runner.last_timeline].count("ForwardPass") == MICRO_BATCHES
    assert set(runner.last_seconds) == {type(cmd).__name__ for step in runner.steps(True, MICRO_BATCHES)
                                        for cmd in step}
    expected_mean = torch.stack(expected_losses).detach().mean()
    torch.testing.assert_close(runner.mean_loss(executor.losses), expected_mean)


def test_an_eval_batch_keeps_logits_and_takes_no_step():
    batches = [(torch.randn(2, 3), torch.randn(2, 1)) for _ in range(2)]
    host, runner = _Host(), _runner()
    with torch.no_grad():
        executor = runner.run(host, iter(batches), False, 2, return_logits=True)
    assert host.steps == 0 and host.optimizer.calls == [] and len(executor.logits) == 2
    assert not any(isinstance(cmd, ins.BackwardPass) for step in runner.steps(False, 2) for cmd in step)


def test_output_reductions():
    runner = _runner()
    outputs = [torch.tensor(1.0), torch.tensor(3.0)]
    assert runner.reduce_outputs(outputs, None, 2) is outputs
    assert runner.reduce_outputs(outputs, "AVG", 2) == 2.0
    with pytest.raises(NotImplementedError, match="reduction type sum"):
        runner.reduce_outputs(outputs, "sum", 2)
    value = torch.tensor(5.0)
    assert runner.broadcast_from_last(value) is value
