"""ZeRO-3 leaf-module marking against the real DeepSpeed 0.19.8 (`deepspeed.utils.z3_leaf_module`): the same
calls mark the same modules, raise alike, and the default `zero_optimization.leaf_module` config marks
the same transformers MoE blocks. zerospeed additionally finds per-expert MoE blocks on its own
([Note: ZeRO-3 leaf modules]; trained under ZeRO-3 in tests/moe/test_hf_moe_zero3.py)."""

from __future__ import annotations

import os

import pytest
import torch

from deepspeed_extensions import import_deepspeed

os.environ.setdefault("DS_ACCELERATOR", "cpu")
ds_leaf = import_deepspeed("deepspeed.utils.z3_leaf_module")
ds_leaf_config = import_deepspeed("deepspeed.runtime.zero.leaf_module_config")

from zerospeed.utils import z3_leaf_module as zs_leaf  # noqa: E402

pytestmark = pytest.mark.compat
transformers = pytest.importorskip("transformers")


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(4, 3)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))


class SubBlock(Block):
    pass


def _model() -> torch.nn.Module:
    config = transformers.MixtralConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=2)
    return torch.nn.ModuleDict({"blocks": torch.nn.ModuleList([Block(), SubBlock()]),
                                "mixtral": transformers.MixtralForCausalLM(config)})


def _marked(model: torch.nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if getattr(module, "_z3_leaf", False)]


CALLS = [("set_z3_leaf_modules", ([Block],)), ("set_z3_leaf_modules", (["SubBlock"],)),
         ("set_z3_leaf_modules", ([f"{__name__}.Block"],)), ("set_z3_leaf_modules_by_name", (["blocks.1.experts"],)),
         ("set_z3_leaf_modules_by_suffix", ([".gate"],))]


@pytest.mark.parametrize("fn_name,args", CALLS)
def test_marking_equals_deepspeed(fn_name: str, args: tuple) -> None:
    ours, theirs = _model(), _model()
    getattr(zs_leaf, fn_name)(ours, *args)
    getattr(ds_leaf, fn_name)(theirs, *args)
    assert _marked(ours) == _marked(theirs) and _marked(ours)
    assert zs_leaf.get_z3_leaf_modules(ours) == [ours.get_submodule(n) for n in _marked(ours)]
    zs_leaf.unset_z3_leaf_modules(ours, [Block], raise_if_not_found=False)
    ds_leaf.unset_z3_leaf_modules(theirs, [Block], raise_if_not_found=False)
    assert _marked(ours) == _marked(theirs)


def test_errors_and_default_config_equal_deepspeed() -> None:
    for module in (zs_leaf, ds_leaf):
        with pytest.raises(ValueError, match="No modules of type"):
            module.set_z3_leaf_modules(_model(), ["Missing"])
        with pytest.raises(ValueError, match="No modules named"):
            module.set_z3_leaf_modules_by_name(_model(), ["nowhere"])
    assert zs_leaf.DEFAULT_LEAF_MODULE_CLASSES == ds_leaf_config.DEFAULT_LEAF_MODULE_CLASSES
    ours, theirs = _model(), _model()
    zs_leaf.apply_zero_leaf_module_config(ours, {"detect_moe_blocks": False})
    ds_leaf.apply_zero_leaf_module_config(theirs, ds_leaf_config.DeepSpeedZeroLeafModuleConfig())
    assert _marked(ours) == _marked(theirs) == ["mixtral.model.layers.0.mlp"]
    # zerospeed's detection adds the per-expert blocks (router + ModuleList of experts)
    detected = _model()
    zs_leaf.apply_zero_leaf_module_config(detected, {})
    assert _marked(detected) == ["blocks.0", "blocks.1", "mixtral.model.layers.0.mlp"]
