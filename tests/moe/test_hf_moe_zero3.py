"""A Hugging Face MoE model (tiny Mixtral from a config) trains under ZeRO-3 on 2 gloo ranks without
marking leaf modules, and equals the same model trained in one process on the global batch.

Why no leaf marking is needed with transformers 5.x (DeepSpeed's default `leaf_module` config marks the
block anyway, and so does zerospeed): the experts of a `MixtralSparseMoeBlock` are
one module (`MixtralExperts`) holding 3-D parameters, so one pre-forward hook gathers every expert
and each parameter's gradient arrives once per backward, whichever experts the tokens reach. The
data-dependent part (which experts run) stays inside that module. transformers 4.x built one
module per expert, and only the experts that got tokens ran: that is what hung DeepSpeed users and
what `set_z3_leaf_modules` was for (tests/runtime/zero/test_stage3.py covers leaf modules).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from distributed import run_on_ranks
from parity import assert_close_relative

transformers = pytest.importorskip("transformers")

STEPS, MICRO, SEQ, LR = 2, 2, 8, 0.5


def _model() -> torch.nn.Module:
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=32, output_router_logits=True,
                                        router_aux_loss_coef=0.1, attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config)


def _tokens(world_size: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (MICRO * world_size, SEQ), generator=generator) for _ in range(STEPS)]


def _train_zero3(stage: int = 3) -> dict:
    import zerospeed
    from zerospeed.runtime.zero.parameter_offload import get_z3_leaf_modules

    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = _model()
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0, "zero_optimization": {"stage": stage,
              "stage3_param_persistence_threshold": 0}, "optimizer": {"type": "SGD", "params": {"lr": LR}}}
    engine, _, _, _ = zerospeed.initialize(model=model, config=config)
    # DeepSpeed 0.19.8's default leaf_module.classes name the Mixtral block: marked, as there (harmless:
    # the block's experts are one module anyway)
    assert [type(m).__name__ for m in get_z3_leaf_modules(model)] == ["MixtralSparseMoeBlock"] * 2
    losses = []
    for tokens in _tokens(world_size):
        ids = tokens[rank * MICRO:(rank + 1) * MICRO]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with zerospeed.zero.GatheredParameters(list(model.parameters())):
        params = {name: param.detach().clone() for name, param in model.named_parameters()}
    return {"losses": losses, "params": params}


def test_tiny_mixtral_trains_under_zero3_like_one_process() -> None:
    results = run_on_ranks(_train_zero3, 2)
    model = _model()
    batches = [[tokens[r * MICRO:(r + 1) * MICRO] for r in range(2)] for tokens in _tokens(2)]
    _assert_equal_to_one_process(results, model, batches, lambda ids: model(input_ids=ids, labels=ids).loss)


def _assert_equal_to_one_process(results: list[dict[str, Any]], model: torch.nn.Module, batches: list[list[Any]],
                                 loss_of: Any) -> None:
    """Train `model` in one process on each step's per-rank shards (the mean of the ranks' losses, SGD)
    and compare every rank's losses and final parameters at 1e-5."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step, shards in enumerate(batches):
        losses = [loss_of(shard) for shard in shards]
        (sum(losses) / 2).backward()
        optimizer.step()
        optimizer.zero_grad()
        for rank, result in enumerate(results):
            assert_close_relative(torch.tensor(result["losses"][step]), losses[rank].detach(), 1e-5,
                                  f"rank {rank} loss step {step}")
    for name, param in model.named_parameters():
        for result in results:
            assert_close_relative(result["params"][name], param.detach(), 1e-5, name)


# --- per-expert blocks (the transformers 4 layout): found and made leaves ---------------------------

D_IN, D_MODEL, NUM_EXPERTS, TOKENS = 4, 8, 4, 6


class _Expert(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = torch.nn.Linear(D_MODEL, 12), torch.nn.Linear(12, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.tanh(self.w1(x)))


class PerExpertMoeBlock(torch.nn.Module):
    """transformers 4's Mixtral block: a router and one module per expert; only experts with tokens run."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(D_MODEL, NUM_EXPERTS, bias=False)
        self.experts = torch.nn.ModuleList(_Expert() for _ in range(NUM_EXPERTS))
        self.ran: list[list[int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = torch.softmax(self.gate(x), dim=-1).topk(2, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        ran: list[int] = []
        self.ran.append(ran)   # filled as experts run: a check may stop the forward inside an expert
        for index, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == index)
            if token.numel() == 0:
                continue
            ran.append(index)
            out = out.index_add(0, token, expert(x[token]) * weights[token, slot, None])
        return out


class PerExpertNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(D_IN, D_MODEL)
        self.moe = PerExpertMoeBlock()
        with torch.no_grad():   # expert 3 only for tokens with a large feature 0 (rank 1's, see _data)
            self.inp.weight.zero_()
            self.inp.weight[0, 0] = 1.0
            self.inp.weight[1:, 1:].copy_(torch.randn(D_MODEL - 1, D_IN - 1) * 0.3)
            self.moe.gate.weight.copy_(torch.randn(NUM_EXPERTS, D_MODEL) * 0.1)
            self.moe.gate.weight[3, 0] = 4.0
        self.head = torch.nn.Linear(D_MODEL, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.head(self.moe(self.inp(x))), y)


def _data(world_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(2)
    batches = []
    for _ in range(STEPS):
        x = torch.randn(world_size * TOKENS, D_IN, generator=generator)
        x[:, 0] = -2.0
        x[TOKENS:, 0] = 2.0       # rank 1's tokens reach expert 3, rank 0's never do
        batches.append((x, torch.randn(world_size * TOKENS, 1, generator=generator)))
    return batches


def _train_per_expert(detect: bool) -> dict:
    import zerospeed
    from zerospeed.utils import get_z3_leaf_modules

    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = PerExpertNet()
    config = {"train_micro_batch_size_per_gpu": TOKENS, "zero_optimization": {
              "stage": 3, "stage3_param_persistence_threshold": 0, "leaf_module": {"detect_moe_blocks": detect}},
              "optimizer": {"type": "SGD", "params": {"lr": LR}}}
    engine, _, _, _ = zerospeed.initialize(model=model, config=config)
    assert get_z3_leaf_modules(model) == ([model.moe] if detect else [])
    losses = []
    for x, y in _data(world_size):
        loss = engine(x[rank * TOKENS:(rank + 1) * TOKENS], y[rank * TOKENS:(rank + 1) * TOKENS])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with zerospeed.zero.GatheredParameters(list(model.parameters())):
        params = {name: param.detach().clone() for name, param in model.named_parameters()}
    return {"losses": losses, "params": params, "ran": model.moe.ran}


def test_per_expert_moe_block_is_found_and_trains_under_zero3_like_one_process() -> None:
    """The classic ZeRO-3 MoE hang: rank 0's tokens never reach expert 3, rank 1's do. zerospeed finds the
    block (router + ModuleList of experts) and makes it a leaf; training equals one process."""
    results = run_on_ranks(_train_per_expert, 2, True)
    assert all(3 not in ran for ran in results[0]["ran"]) and all(3 in ran for ran in results[1]["ran"])
    model = PerExpertNet()
    batches = [[(x[r * TOKENS:(r + 1) * TOKENS], y[r * TOKENS:(r + 1) * TOKENS]) for r in range(2)]
               for x, y in _data(2)]
    _assert_equal_to_one_process(results, model, batches, lambda xy: model(*xy))


# --- ranks that call different submodules: a clear error, not wrong losses or a hang ---------------

def _train_unmarked(zero_extra: dict) -> dict:
    """The per-expert block with detection off and no marking: rank 1 calls expert 3, rank 0 never does."""
    import zerospeed
    from zerospeed.runtime.zero.gather_order_check import ModuleOrderError

    rank = torch.distributed.get_rank()
    model = PerExpertNet()
    config = {"train_micro_batch_size_per_gpu": TOKENS, "zero_optimization": {
              "stage": 3, "stage3_param_persistence_threshold": 0, "leaf_module": {"detect_moe_blocks": False},
              **zero_extra}, "optimizer": {"type": "SGD", "params": {"lr": LR}}}
    engine, _, _, _ = zerospeed.initialize(model=model, config=config)
    losses = []
    try:
        for x, y in _data(2):
            loss = engine(x[rank * TOKENS:(rank + 1) * TOKENS], y[rank * TOKENS:(rank + 1) * TOKENS])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    except ModuleOrderError as error:
        return {"error": str(error), "losses": losses, "ran": model.moe.ran}
    return {"error": None, "losses": losses, "ran": model.moe.ran}


@pytest.mark.parametrize("zero_extra,when", [({}, "at the end of backward"),
                                             ({"enable_sanity_checks": True}, "before gather #")])
def test_ranks_calling_different_experts_is_a_clear_error(zero_extra: dict, when: str) -> None:
    """Without the leaf marking the ranks' gathers pair up wrongly (silently wrong losses before the check
    existed). The check compares what each rank gathered once per backward (or, with DeepSpeed's
    enable_sanity_checks, before every gather) and raises on every rank, in the first step, before the
    optimizer steps, naming the expert only rank 1 called."""
    results = run_on_ranks(_train_unmarked, 2, zero_extra, timeout_s=120)
    ran = [result["ran"][0] for result in results]   # the experts each rank ran, in call order
    if not zero_extra:   # the forward ran through: rank 1 reached expert 3, rank 0 did not
        assert 3 in ran[1] and 3 not in ran[0]
    first = next(i for i, (a, b) in enumerate(zip(ran[0] + [None], ran[1] + [None])) if a != b)
    for result in results:
        assert result["error"] is not None, "ranks that called different experts trained on"
        assert result["losses"] == [], "the error comes in the first step"
        assert when in result["error"]
        # gathers #0 and #1 are inp and the router; then each rank's experts in call order
        assert f"First difference, gather #{2 + first} of this micro-step" in result["error"], result["error"]
        for rank in (0, 1):
            assert f"rank {rank}: moe.experts.{ran[rank][first]}.w1 (Linear) (forward)" in result["error"]
        assert "set_z3_leaf_modules" in result["error"]
