"""The optimizer block builds DeepSpeed's optimizer choices; ZeRO refuses non-element-wise ones."""

import pytest
import torch

from zerospeed.ops.lamb import FusedLamb
from zerospeed.runtime.config import DeepSpeedConfig
from zerospeed.runtime.optimizer_factory import build_basic_optimizer, check_zero_supported


def _params():
    return [torch.nn.Parameter(torch.zeros(3))]


@pytest.mark.parametrize("name,params,expected_type,expected", [
    ("Adam", {"lr": 0.1}, torch.optim.AdamW, {"weight_decay": 0.0}),        # DeepSpeed: Adam means AdamW
    ("adam", {"lr": 0.1, "adam_w_mode": False}, torch.optim.Adam, {"weight_decay": 0.0}),
    ("AdamW", {"lr": 0.1, "betas": [0.8, 0.9]}, torch.optim.AdamW, {"betas": (0.8, 0.9), "weight_decay": 0.0}),
    # torch_adam: torch's class with torch's own defaults, as DeepSpeed builds it (AdamW decays 0.01)
    ("AdamW", {"lr": 0.1, "torch_adam": True}, torch.optim.AdamW, {"weight_decay": 0.01}),
    ("Adam", {"lr": 0.1, "torch_adam": True, "adam_w_mode": False}, torch.optim.Adam, {"weight_decay": 0.0}),
    ("SGD", {"lr": 0.1, "momentum": 0.9}, torch.optim.SGD, {"momentum": 0.9}),
    ("Adagrad", {"lr": 0.1}, torch.optim.Adagrad, {"lr": 0.1}),
    ("RMSprop", {"lr": 0.1}, torch.optim.RMSprop, {"lr": 0.1}),
    ("Lamb", {"lr": 0.1}, FusedLamb, {"max_coeff": 10.0, "min_coeff": 0.01}),
])
def test_config_names_build_the_right_optimizer(name, params, expected_type, expected):
    optimizer = build_basic_optimizer(name, params, _params())
    assert type(optimizer) is expected_type
    for key, value in expected.items():
        assert tuple(optimizer.param_groups[0][key]) == tuple(value) if isinstance(value, tuple) \
            else optimizer.param_groups[0][key] == value


def test_unknown_optimizer_and_max_grad_norm_are_clear_errors():
    with pytest.raises(ValueError, match="NoSuchOpt is not a supported DeepSpeed Optimizer"):
        build_basic_optimizer("NoSuchOpt", {}, _params())
    with pytest.raises(ValueError, match="gradient_clipping"):
        build_basic_optimizer("Adam", {"max_grad_norm": 1.0}, _params())


def test_zero_refuses_lamb_unless_allowed():
    lamb = FusedLamb(_params())
    stage2 = DeepSpeedConfig({"train_batch_size": 1, "zero_optimization": {"stage": 2}}, world_size=1)
    with pytest.raises(ValueError, match='"zero_allow_untested_optimizer": true'):
        check_zero_supported(lamb, stage2)
    allowed = DeepSpeedConfig({"train_batch_size": 1, "zero_optimization": {"stage": 2},
                               "zero_allow_untested_optimizer": True}, world_size=1)
    check_zero_supported(lamb, allowed)
    check_zero_supported(torch.optim.SGD(_params(), lr=0.1), stage2)  # element-wise: exact under ZeRO
