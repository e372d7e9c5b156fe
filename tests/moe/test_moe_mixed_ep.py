"""A model whose MoE layers have different expert-parallel sizes (ep 2 and ep 4 on 4 gloo ranks: groups
`ep_size_2` and `ep_size_4`, as DeepSpeed names them) trains through `initialize` at ZeRO 0-3 like the
same model with every expert local, trained in one process on the global batch, and its checkpoints
resume bit for bit with every layer's experts in their global-id files.

With ep 2 each expert of the first layer lives on 2 ranks (its expert-data-parallel group: ranks
{0, 2} or {1, 3}); with ep 4 each expert of the second layer on one rank. So one step reduces
gradients over three kinds of group (data-parallel, both expert-data-parallel sizes), and the norm
counts each expert once whatever its group.
"""

from __future__ import annotations

import os

import pytest
import torch
from distributed import run_on_ranks
from parity import assert_close_relative

import zerospeed
from zerospeed.moe.layer import MoE

WORLD, EP_SIZES = 4, (2, 4)
D_IN, D_MODEL, D_HIDDEN, D_OUT, NUM_EXPERTS = 5, 8, 12, 3, 4
NUM_STEPS, MICRO, LR, CLIP, AUX_COEF = 3, 6, 0.5, 0.05, 0.1
_EXPERTS = ".deepspeed_moe.experts.deepspeed_experts."


class MixedEpModel(torch.nn.Module):
    """inp -> MoE (top-2) -> MoE (top-1) -> head, each MoE layer with its own ep size."""

    def __init__(self, ep_sizes: tuple[int, int]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(D_IN, D_MODEL)
        expert = torch.nn.Sequential(torch.nn.Linear(D_MODEL, D_HIDDEN), torch.nn.Tanh(),
                                     torch.nn.Linear(D_HIDDEN, D_MODEL))
        self.moes = torch.nn.ModuleList(
            MoE(D_MODEL, expert, NUM_EXPERTS, ep_size, k, capacity_factor=1.0, min_capacity=1, use_rts=False,
                top2_2nd_expert_sampling=False, drop_policy="position" if k == 1 else None)
            for ep_size, k in zip(ep_sizes, (2, 1)))
        self.head = torch.nn.Linear(D_MODEL, D_OUT)

    @torch.no_grad()
    def set_expert_weights(self, rank: int) -> None:
        """Every expert's weights drawn from (layer, global id); ep groups are consecutive ranks, so this
        rank's ep rank in a layer of ep size e is rank % e."""
        for layer, moe in enumerate(self.moes):
            local = moe.num_local_experts
            for i, expert in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
                generator = torch.Generator().manual_seed(100 * (layer + 1) + (rank % moe.ep_size) * local + i)
                for param in expert.parameters():
                    param.data.copy_(torch.randn(param.shape, generator=generator) * 0.5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        hidden, aux = torch.tanh(self.inp(x)), 0.0
        for moe in self.moes:
            out, l_aux, _ = moe(hidden)
            hidden, aux = hidden + out, aux + l_aux
        return torch.nn.functional.mse_loss(self.head(hidden), y) + AUX_COEF * aux


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(MICRO * WORLD, D_IN, generator=generator), torch.randn(MICRO * WORLD, D_OUT,
                                                                               generator=generator))
            for _ in range(NUM_STEPS)]


def _shard(batch: tuple, rank: int) -> tuple:
    return batch[0][rank * MICRO:(rank + 1) * MICRO], batch[1][rank * MICRO:(rank + 1) * MICRO]


def _engine(stage: int, optimizer: dict) -> tuple:
    model = MixedEpModel(EP_SIZES)
    model.set_expert_weights(torch.distributed.get_rank())
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": CLIP, "optimizer": optimizer,
              "zero_optimization": {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}}
    engine, _, _, _ = zerospeed.initialize(model=model, config=config)
    return engine, model


def _global_params(model: MixedEpModel) -> dict[str, torch.Tensor]:
    """Every parameter this rank holds, local expert ids renamed to global ones (gathered at stage 3)."""
    from zerospeed.utils import groups

    named = {}
    for name, param in model.named_parameters():
        if _EXPERTS in name:
            head, tail = name.split(_EXPERTS)
            local, rest = tail.split(".", 1)
            moe = model.moes[int(head.split(".")[1])]
            ep_rank = groups._get_expert_parallel_rank(moe.expert_group_name)
            name = f"{head}{_EXPERTS}{ep_rank * moe.num_local_experts + int(local)}.{rest}"
        with zerospeed.zero.GatheredParameters([param]):   # a no-op below stage 3
            named[name] = param.detach().clone()
    return named


def _steps(engine: object, batches: list) -> list[float]:
    losses = []
    for batch in batches:
        loss = engine(*_shard(batch, torch.distributed.get_rank()))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _train(stage: int) -> dict:
    engine, model = _engine(stage, {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}})
    names = [group.get("name") for group in engine.optimizer.param_groups]
    norms, losses = [], []
    for batch in _batches():
        losses += _steps(engine, [batch])
        norms.append(engine.get_global_grad_norm())
    return {"losses": losses, "norms": norms, "params": _global_params(model), "group_names": names}


def _reference() -> dict:
    model = MixedEpModel((1, 1))
    model.set_expert_weights(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses, norms = [], []
    for batch in _batches():
        shard_losses = [model(*_shard(batch, rank)) for rank in range(WORLD)]
        (sum(shard_losses) / WORLD).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append([loss.item() for loss in shard_losses])
    return {"losses": losses, "norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_layers_of_two_expert_parallel_sizes_train_like_one_process(stage: int) -> None:
    results = run_on_ranks(_train, WORLD, stage)
    expected = _reference()
    assert min(expected["norms"]) > CLIP, "clipping must be active for the norm to matter"
    for rank, result in enumerate(results):
        if stage < 3:   # DeepSpeed's MoE param groups, one per expert group (stage 3: sub-groups)
            assert result["group_names"] == ["dense-params", "ep_size_2", "ep_size_4"]
        assert_close_relative(torch.tensor(result["norms"]), torch.tensor(expected["norms"]), 1e-5, "grad norms")
        want = torch.tensor([expected["losses"][step][rank] for step in range(NUM_STEPS)])
        assert_close_relative(torch.tensor(result["losses"]), want, 1e-5, f"rank {rank} losses")
        for name, value in result["params"].items():
            assert_close_relative(value, expected["params"][name], 1e-5, f"rank {rank} {name}")
    assert set().union(*(r["params"] for r in results)) == set(expected["params"]), "every expert is held"


def _save_then_resume(save_dir: str, stage: int) -> dict:
    adam = {"type": "AdamW", "params": {"lr": 1e-2}}
    batches = _batches()
    engine, model = _engine(stage, adam)
    _steps(engine, batches[:1])
    engine.save_checkpoint(save_dir, tag="t")
    continued = _steps(engine, batches[1:])
    expected = _global_params(model)
    engine, model = _engine(stage, adam)
    engine.load_checkpoint(save_dir, tag="t")
    resumed = _steps(engine, batches[1:])
    return {"continued": continued, "resumed": resumed, "expected": expected, "got": _global_params(model)}


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_mixed_expert_parallel_checkpoint_resumes_bit_for_bit(stage: int, tmp_path: object) -> None:
    results = run_on_ranks(_save_then_resume, WORLD, str(tmp_path), stage)
    for result in results:
        assert result["continued"] == result["resumed"]
        for name, value in result["expected"].items():
            assert torch.equal(result["got"][name], value), name
    files = set(os.listdir(os.path.join(str(tmp_path), "t")))
    expert_files = {f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt" for layer in (0, 1) for e in range(4)}
    assert expert_files <= files, sorted(files)
