"""ZeRO-3 leaf modules (DeepSpeed's `deepspeed.utils.z3_leaf_module`), and finding MoE blocks that need it.

[Note: ZeRO-3 leaf modules]
ZeRO-3 gathers a module's parameters in its pre-forward hook and counts on every rank calling the
same modules in the same order. An MoE block whose experts are separate modules breaks that: only
the experts that got tokens run, which differs between ranks, so one rank waits in an all-gather the
other never joins (the classic hang), and an expert that ran nowhere never gets a gradient. A *leaf*
module is gathered whole (all descendants' parameters) when it is entered and its children get no
hooks, so the data-dependent part stays inside it.

Marking, as DeepSpeed 0.19.8: `set_z3_leaf_modules(model, classes)` by class (isinstance) or by
class name / fully qualified name, `..._by_name`, `..._by_suffix`, and the config block
`zero_optimization.leaf_module: {classes, names, name_suffixes}`, whose default `classes` are the
Mixtral, Qwen2-MoE and Qwen3-MoE sparse MoE blocks of transformers (applied at stage 3).

zerospeed also finds such blocks itself (`find_moe_blocks`, on by default at stage 3, config
`leaf_module.detect_moe_blocks`): a module with a `ModuleList` child of at least two modules of one
class whose name ends in "experts", next to a router child (`gate` or `router`): the layout of
transformers 4 MoE blocks and of most custom MoE code. zerospeed's own `MoE` layer is not one: its
experts run on every rank in every step ([Note: MoE dispatch]).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from pydantic import Field, field_validator

from zerospeed.runtime.config_utils import DeepSpeedConfigModel

__all__ = ["DEFAULT_LEAF_MODULE_CLASSES", "DeepSpeedZeroLeafModuleConfig", "apply_zero_leaf_module_config",
           "find_moe_blocks", "get_z3_leaf_modules", "set_z3_leaf_module", "set_z3_leaf_modules",
           "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix", "unset_z3_leaf_modules", "z3_leaf_module",
           "z3_leaf_parameter"]

DEFAULT_LEAF_MODULE_CLASSES = [
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
]
_ROUTER_NAMES = ("gate", "router")


class DeepSpeedZeroLeafModuleConfig(DeepSpeedConfigModel):
    """`zero_optimization.leaf_module` (DeepSpeed's keys and defaults, plus `detect_moe_blocks`)."""

    classes: list[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_CLASSES))
    names: list[str] = Field(default_factory=list)
    name_suffixes: list[str] = Field(default_factory=list)
    detect_moe_blocks: bool = True
    """zerospeed's: also mark the MoE blocks `find_moe_blocks` finds."""

    @field_validator("classes", "names", "name_suffixes", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


def z3_leaf_module(model: torch.nn.Module) -> bool:
    return bool(getattr(model, "_z3_leaf", False))


def z3_leaf_parameter(model: torch.nn.Parameter) -> bool:
    return hasattr(model, "ds_z3_leaf_module")


def get_z3_leaf_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if z3_leaf_module(m)]


def set_z3_leaf_module(model: torch.nn.Module, flag: bool) -> None:
    model.__dict__["_z3_leaf"] = flag   # a plain attribute, as nn.Module's __setattr__ would store it


def _matches(module: torch.nn.Module, wanted: type | str) -> bool:
    if isinstance(wanted, type):
        return isinstance(module, wanted)
    cls = type(module)
    return wanted in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _flag_classes(model: torch.nn.Module, classes: Iterable[Any], flag: bool, raise_if_not_found: bool) -> list[torch.nn.Module]:
    classes = list(classes)
    if not all(isinstance(c, (type, str)) for c in classes):
        raise TypeError(f"leaf_module_classes must be a list of types or names, got {classes}")
    matched = [m for m in model.modules() if any(_matches(m, c) for c in classes)]
    for module in matched:
        set_z3_leaf_module(module, flag)
    if not matched and raise_if_not_found:
        raise ValueError(f"No modules of type {classes} found in model {type(model).__name__}")
    return matched


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: Iterable[Any],
                        raise_if_not_found: bool = True) -> list[torch.nn.Module]:
    """Mark modules of these classes (types: isinstance; strings: class name or module.qualname) as leaves."""
    return _flag_classes(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: Iterable[Any],
                          raise_if_not_found: bool = True) -> list[torch.nn.Module]:
    return _flag_classes(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_modules_by_name(model: torch.nn.Module, module_names: list[str], flag: bool = True,
                                raise_if_not_found: bool = True) -> tuple[list[torch.nn.Module], list[str]]:
    by_name = dict(model.named_modules())
    missing = [name for name in module_names if name not in by_name]
    if missing and raise_if_not_found:
        raise ValueError(f"No modules named {missing} found in model {type(model).__name__}")
    matched = [by_name[name] for name in module_names if name in by_name]
    for module in matched:
        set_z3_leaf_module(module, flag)
    return matched, missing


def set_z3_leaf_modules_by_suffix(model: torch.nn.Module, module_name_suffixes: list[str], flag: bool = True,
                                  raise_if_not_found: bool = True) -> tuple[list[torch.nn.Module], list[str]]:
    matched: dict[int, torch.nn.Module] = {}
    missing = []
    for suffix in module_name_suffixes:
        hits = [m for name, m in model.named_modules() if name.endswith(suffix)]
        missing += [] if hits else [suffix]
        matched.update((id(m), m) for m in hits)
    if missing and raise_if_not_found:
        raise ValueError(f"No modules matching suffixes {missing} found in model {type(model).__name__}")
    for module in matched.values():
        set_z3_leaf_module(module, flag)
    return list(matched.values()), missing


def find_moe_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules holding per-expert modules that run in data-dependent order ([Note: ZeRO-3 leaf modules])."""
    from zerospeed.moe.layer import MoE
    from zerospeed.moe.sharded_moe import MOELayer

    own = {id(m) for layer in model.modules() if isinstance(layer, (MoE, MOELayer)) for m in layer.modules()}
    blocks = []
    for module in model.modules():
        if id(module) in own:
            continue
        children = dict(module.named_children())
        has_router = any(name in children for name in _ROUTER_NAMES)
        if has_router and any(_is_expert_list(name, child) for name, child in children.items()):
            blocks.append(module)
    return blocks


def _is_expert_list(name: str, child: torch.nn.Module) -> bool:
    if not (isinstance(child, torch.nn.ModuleList) and name.endswith("experts") and len(child) >= 2):
        return False
    return len({type(expert) for expert in child}) == 1


def apply_zero_leaf_module_config(model: torch.nn.Module, leaf_cfg: Any) -> list[torch.nn.Module]:
    """Mark the configured (and, unless `detect_moe_blocks` is off, the detected) leaf modules."""
    if leaf_cfg is None:
        return []
    cfg = leaf_cfg if isinstance(leaf_cfg, DeepSpeedZeroLeafModuleConfig) else \
        DeepSpeedZeroLeafModuleConfig.model_validate(leaf_cfg)
    matched: dict[int, torch.nn.Module] = {}
    matched.update((id(m), m) for m in set_z3_leaf_modules(model, cfg.classes, raise_if_not_found=False))
    matched.update((id(m), m) for m in set_z3_leaf_modules_by_name(model, cfg.names, raise_if_not_found=False)[0])
    matched.update((id(m), m) for m in set_z3_leaf_modules_by_suffix(model, cfg.name_suffixes,
                                                                     raise_if_not_found=False)[0])
    if cfg.detect_moe_blocks:
        for block in find_moe_blocks(model):
            set_z3_leaf_module(block, True)
            matched[id(block)] = block
    return list(matched.values())
