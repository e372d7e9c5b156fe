"""What AutoTP refuses, before it cuts the model: Ulysses sequence parallelism (from the ds_config or
from ALST's mpu) and a model built under zero.Init. Each error names the keys; the model is left whole."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_on_ranks


class _SequenceParallelMpu:
    """Stands for the mpu `UlyssesSPAttentionHF.register_with_transformers` returns."""

    @staticmethod
    def get_sequence_parallel_group():
        return None


def _try(case: str) -> tuple[str, list[int]]:
    import zerospeed

    torch.manual_seed(0)
    with zerospeed.zero.Init(enabled=case == "zero_init"):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "tensor_parallel": {"autotp_size": 2}, "zero_optimization": {"stage": 1}}
    mpu = None
    if case == "sp_config":
        config["sequence_parallel_size"] = 2
    elif case == "sp_mpu":
        mpu = _SequenceParallelMpu()
    else:
        config["zero_optimization"] = {"stage": 3}
    try:
        zerospeed.initialize(model=model, model_parameters=model.parameters(), config=config, mpu=mpu)
    except ValueError as error:
        return str(error), _numels(model)
    return "", []


def _numels(model: torch.nn.Module) -> list[int]:
    """Each parameter's full size (a zero.Init parameter's `ds_numel`): nothing was cut."""
    return [int(getattr(p, "ds_numel", p.numel())) for p in model.parameters()]


@pytest.mark.parametrize("case, words", [
    ("sp_config", ["tensor_parallel.autotp_size=2", "sequence_parallel_size=2", "DeepSpeed 0.19.8"]),
    ("sp_mpu", ["tensor_parallel.autotp_size=2", "register_with_transformers", "sequence parallelism"]),
    ("zero_init", ["tensor_parallel.autotp_size=2", "zero.Init", "'0.weight'"]),
])
def test_autotp_refuses_before_sharding(case, words):
    for message, numels in run_on_ranks(_try, 2, case):
        assert message and all(word in message for word in words), message
        assert numels == [64, 8, 64, 8]   # nothing was cut
