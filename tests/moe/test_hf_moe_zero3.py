"""A Hugging Face MoE model (tiny Mixtral from a config) trains under ZeRO-3 on 2 gloo ranks without
marking leaf modules, and equals the same model trained in one process on the global batch.

Why no leaf marking is needed with transformers 5.x: the experts of a `MixtralSparseMoeBlock` are
one module (`MixtralExperts`) holding 3-D parameters, so one pre-forward hook gathers every expert
and each parameter's gradient arrives once per backward, whichever experts the tokens reach. The
data-dependent part (which experts run) stays inside that module. transformers 4.x built one
module per expert, and only the experts that got tokens ran: that is what hung DeepSpeed users and
what `set_z3_leaf_modules` was for (tests/runtime/zero/test_stage3.py covers leaf modules).
"""

from __future__ import annotations

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
    assert get_z3_leaf_modules(model) == [], "nothing marked by hand (or by us)"
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
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step, tokens in enumerate(_tokens(2)):
        shards = [tokens[r * MICRO:(r + 1) * MICRO] for r in range(2)]
        losses = [model(input_ids=ids, labels=ids).loss for ids in shards]
        (sum(losses) / 2).backward()
        optimizer.step()
        optimizer.zero_grad()
        for rank, result in enumerate(results):
            assert_close_relative(torch.tensor(result["losses"][step]), losses[rank].detach(), 1e-5,
                                  f"rank {rank} loss step {step}")
    for name, param in model.named_parameters():
        for result in results:
            assert_close_relative(result["params"][name], param.detach(), 1e-5, name)
