"""The batch triangle (`deepspeed/runtime/config.py::DeepSpeedConfig._configure_train_batch_size`): every derivation row and DeepSpeed's failure messages."""

from __future__ import annotations

import pytest

from zerospeed.runtime.config import DeepSpeedConfig, resolve_batch_sizes
from zerospeed.runtime.config_utils import ConfigError

EITHER = "Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided"


def _mismatch(tbs: int, mbs: int, gas: int, world: int) -> str:
    return f"on world_size {world} cannot satisfy train_batch_size = train_micro_batch_size_per_gpu * " \
           f"gradient_accumulation_steps * world_size (derived: {tbs} != {mbs} * {gas} * {world})"


# (train_batch_size, micro_batch, grad_acc, world_size) -> (tbs, mbs, gas)
RESOLVED = [
    # all three
    ((8, 2, 4, 1), (8, 2, 4)),
    ((16, 2, 4, 2), (16, 2, 4)),
    ((32, 2, 4, 4), (32, 2, 4)),
    # TBS + MBS: GAS = (TBS // MBS) // W
    ((8, 2, None, 1), (8, 2, 4)),
    ((16, 2, None, 2), (16, 2, 4)),
    ((32, 2, None, 4), (32, 2, 4)),
    ((24, 3, None, 2), (24, 3, 4)),
    # TBS + GAS: MBS = (TBS // W) // GAS
    ((8, None, 4, 1), (8, 2, 4)),
    ((16, None, 4, 2), (16, 2, 4)),
    ((32, None, 2, 4), (32, 4, 2)),
    # MBS + GAS: TBS = MBS * GAS * W
    ((None, 2, 4, 1), (8, 2, 4)),
    ((None, 2, 4, 2), (16, 2, 4)),
    ((None, 1, 8, 4), (32, 1, 8)),
    # only TBS: GAS = 1, MBS = TBS // W
    ((8, None, None, 1), (8, 8, 1)),
    ((16, None, None, 2), (16, 8, 1)),
    ((32, None, None, 4), (32, 8, 1)),
    # only MBS: GAS = 1, TBS = MBS * W
    ((None, 2, None, 1), (2, 2, 1)),
    ((None, 3, None, 2), (6, 3, 1)),
    ((None, 4, None, 4), (16, 4, 1)),
]

FAILING = [
    # floor division, then the equality assertion
    ((7, None, 2, 1), _mismatch(7, 3, 2, 1)),
    ((7, 2, None, 1), _mismatch(7, 2, 3, 1)),
    ((8, 2, 3, 1), _mismatch(8, 2, 3, 1)),
    ((16, 2, 2, 2), _mismatch(16, 2, 2, 2)),
    ((10, None, None, 4), _mismatch(10, 2, 1, 4)),
    ((30, None, None, 4), _mismatch(30, 7, 1, 4)),
    ((20, 2, None, 4), _mismatch(20, 2, 2, 4)),
    ((18, None, 2, 4), _mismatch(18, 2, 2, 4)),
    # a derived value of 0: the values as given and the world size, not the derived 0 (DeepSpeed's message)
    ((1, None, None, 2), "train_batch_size 1, train_micro_batch_size_per_gpu not set, "
                         "gradient_accumulation_steps not set on world_size 2"),
    ((6, None, 4, 2), _mismatch(6, 0, 4, 2)),
    ((8, 8, None, 2), _mismatch(8, 8, 0, 2)),
    ((3, 2, None, 2), "train_batch_size 3, train_micro_batch_size_per_gpu 2, gradient_accumulation_steps not set "
                      "on world_size 2 cannot satisfy"),
    # a given value <= 0: the key path
    ((0, 2, None, 1), "train_batch_size: 0 has to be greater than 0"),
    ((-8, 2, None, 1), "train_batch_size: -8 has to be greater than 0"),
    ((8, 0, None, 1), "train_micro_batch_size_per_gpu: 0 has to be greater than 0"),
    ((8, None, 0, 2), "gradient_accumulation_steps: 0 has to be greater than 0"),
    ((None, -1, 2, 1), "train_micro_batch_size_per_gpu: -1 has to be greater than 0"),
    # not enough given
    ((None, None, 4, 1), EITHER),
    ((None, None, None, 2), EITHER),
]


@pytest.mark.parametrize(("given", "expected"), RESOLVED)
def test_resolved(given, expected):
    assert resolve_batch_sizes(*given) == expected


@pytest.mark.parametrize(("given", "message"), FAILING)
def test_failing(given, message):
    with pytest.raises(ConfigError) as info:
        resolve_batch_sizes(*given)
    assert message in str(info.value)


def test_mismatch_names_where_the_world_size_came_from():
    with pytest.raises(ConfigError, match=r"on world_size 1 \(from torch.distributed not initialized\).*16 != 1 \* 1 \* 1"):
        DeepSpeedConfig({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1})


class _Mpu:
    def get_data_parallel_world_size(self) -> int:
        return 4


@pytest.mark.parametrize(("kwargs", "world"), [({}, 1), ({"world_size": 2}, 2), ({"mpu": _Mpu()}, 4),
                                               ({"mpu": _Mpu(), "world_size": 2}, 2)])
def test_world_size_sources(kwargs, world):
    config = DeepSpeedConfig({"train_batch_size": 32, "gradient_accumulation_steps": 2}, **kwargs)
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) \
        == (32, 32 // world // 2, 2)
    assert config.world_size == world


def test_top_level_auto_counts_as_not_given():
    config = DeepSpeedConfig({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4,
                              "gradient_accumulation_steps": "auto"}, world_size=2)
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) == (8, 4, 1)
    assert config.resolved_auto_keys == ["train_batch_size", "gradient_accumulation_steps"]
