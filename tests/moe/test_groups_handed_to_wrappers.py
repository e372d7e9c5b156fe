"""Every optimizer wrapper and the checkpoint code get the run's groups handed, never from the
registry the engine publishes them into ([Note: run groups] in comm/run_groups.py): with every
by-name read of that registry made to fail once the run's groups are built (DeepSpeed's accessors,
`get_group`, `get_run_groups`, `expert_groups(name)` without the run's value), `initialize`, two
steps and a checkpoint save and load still run, for MoE models at stage 0 (its grouped expert
all-reduce and gradient space), under Muon (expert matrices owned in their expert-data-parallel
group) at stages 0-3, and for Muon's AutoTP-split matrices (the tensor-parallel group).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from distributed import run_on_ranks

import zerospeed
from zerospeed.comm import groups
from zerospeed.moe.layer import MoE

MUON = {"muon_lr": 0.02, "adam_lr": 1e-3, "momentum": 0.9, "eps": 1e-3}


class _Model(torch.nn.Module):
    """Two MoE layers of two ep sizes (two expert groups) and a dense matrix."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dense = torch.nn.Linear(4, 4)
        self.wide = MoE(4, torch.nn.Linear(4, 4), num_experts=2, ep_size=2, min_capacity=2)
        self.narrow = MoE(4, torch.nn.Linear(4, 4), num_experts=2, ep_size=1, min_capacity=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, l_aux, _ = self.wide(self.dense(x))
        out2, l_aux2, _ = self.narrow(out)
        return out2.square().mean() + l_aux + l_aux2


def _registry_reads() -> list[str]:
    """Every function of the registry that answers with a group (or the published value) by name."""
    return [name for name in groups.__all__ if name.startswith(("get_", "_get_"))]


@contextlib.contextmanager
def _registry_closed_after_build() -> Iterator[None]:
    """The registry's reads raise, except while `build_run_groups` (the builder, which registers the
    groups and AutoTP's grid through them) runs; `expert_groups` only when not handed the value."""
    from zerospeed.runtime import engine as engine_module
    from zerospeed.utils import groups as ds_groups

    building = [False]

    def guarded(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def read(*args: Any, **kwargs: Any) -> Any:
            if building[0]:
                return original(*args, **kwargs)
            raise AssertionError(f"the run's groups were read from the registry: {name}{args}")
        return read

    def expert_groups(group_name: str, run: Any = None) -> Any:
        if run is None and not building[0]:
            raise AssertionError(f"expert groups {group_name!r} read from the published value")
        return original_expert_groups(group_name, run)

    def build(*args: Any, **kwargs: Any) -> Any:
        building[0] = True
        try:
            return original_build(*args, **kwargs)
        finally:
            building[0] = False

    original_expert_groups, original_build = groups.expert_groups, engine_module.build_run_groups
    patch = pytest.MonkeyPatch()
    try:
        for name in _registry_reads():
            read = guarded(name, getattr(groups, name))
            patch.setattr(groups, name, read)
            if hasattr(ds_groups, name):
                patch.setattr(ds_groups, name, read)
        patch.setattr(groups, "expert_groups", expert_groups)
        if hasattr(ds_groups, "expert_groups"):
            patch.setattr(ds_groups, "expert_groups", expert_groups)
        patch.setattr(groups, "_create_expert_and_data_parallel", guarded("_create_expert_and_data_parallel",
                                                                         groups._create_expert_and_data_parallel))
        patch.setattr(MoE, "set_deepspeed_parallelism", guarded("MoE.set_deepspeed_parallelism",
                                                                MoE.set_deepspeed_parallelism))
        patch.setattr(engine_module, "build_run_groups", build)
        yield
    finally:
        patch.undo()


def _steps_and_checkpoint(engine: Any, batches: list[Any], loss_of: Callable[..., torch.Tensor],
                          save_dir: str) -> list[float]:
    losses = []
    for index, batch in enumerate(batches):
        loss = loss_of(engine, batch)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if index == 0:
            engine.save_checkpoint(save_dir, tag="one")
            engine.load_checkpoint(save_dir, tag="one")
    return losses


def _train_moe(stage: int, optimizer: str, save_dir: str) -> list[bool]:
    block = {"type": "Muon", "params": MUON} if optimizer == "muon" else {"type": "SGD", "params": {"lr": 0.1}}
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": block,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    generator = torch.Generator().manual_seed(torch.distributed.get_rank())
    batches = [torch.randn(2, 3, 4, generator=generator) for _ in range(2)]
    with _registry_closed_after_build():
        model = _Model()
        engine, *_ = zerospeed.initialize(model=model, config=config)
        losses = _steps_and_checkpoint(engine, batches, lambda e, x: e(x), save_dir)
        run = engine.run_groups
        return [model.wide.deepspeed_moe.ep_group is run.expert("ep_size_2").expert_parallel.group,
                all(torch.isfinite(torch.tensor(losses)).tolist()),
                optimizer != "muon" or any(g["use_muon"] and g.get("moe", False)
                                           for g in engine.basic_optimizer.param_groups)]


@pytest.mark.parametrize("stage,optimizer", [(0, "sgd"), (0, "muon"), (1, "muon"), (2, "muon"), (3, "muon")])
def test_moe_wrappers_and_checkpoints_get_the_run_groups_handed(stage, optimizer, tmp_path):
    assert run_on_ranks(_train_moe, 2, stage, optimizer, str(tmp_path)) == [[True, True, True]] * 2


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                        tie_word_embeddings=False))


def _train_autotp(stage: int, save_dir: str) -> list[bool]:
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Muon", "params": MUON},
              "zero_optimization": {"stage": stage}, "tensor_parallel": {"autotp_size": 2}}
    generator = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 64, (2, 8), generator=generator) for _ in range(2)]
    with _registry_closed_after_build():
        engine, *_ = zerospeed.initialize(model=copy.deepcopy(_llama()), config=config)
        losses = _steps_and_checkpoint(engine, batches, lambda e, ids: e(input_ids=ids, labels=ids).loss, save_dir)
        split = [p for p in engine.module.parameters() if getattr(p, "ds_tp_shard", None) is not None]
        return [bool(split), all(torch.isfinite(torch.tensor(losses)).tolist())]


@pytest.mark.parametrize("stage", [0, 1])
def test_muon_gets_the_tensor_parallel_group_handed(stage, tmp_path):
    assert run_on_ranks(_train_autotp, 2, stage, str(tmp_path)) == [[True, True]] * 2
