"""The tiny Hugging Face models, batches and data-parallel training loop of the AutoTP tests
(test_autotp.py, test_optimizer_reshard.py).

Llama with untied embeddings (AutoTP splits the LM head apart from the embedding) and GQA, GPT-2
with dropout off so that a sharded run and the one-process reference see the same numbers.
"""

from __future__ import annotations

from typing import Any

import torch

SEQ, VOCAB = 8, 64


def tiny_model(kind: str) -> torch.nn.Module:
    """`"llama"` or `"gpt2"`, fp32, built after seeding torch with 0."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=2 * SEQ, n_embd=32, n_layer=2, n_head=4,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * SEQ,
                                        tie_word_embeddings=False))


def global_batches(rows: int, count: int) -> list[torch.Tensor]:
    """`count` global batches of token ids, the same on every rank."""
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (rows, SEQ), generator=generator) for _ in range(count)]


def train_dp_slices(engine: Any, batches: list[torch.Tensor]) -> tuple[list[float], list[float]]:
    """One step per global batch, each dp rank on its slice (tp peers share one); the loss of
    each step averaged over the dp group, and the gradient norm the engine reports after it."""
    dp, dp_rank = engine.dp_world_size, engine.get_data_parallel_rank()
    losses, norms = [], []
    for ids in batches:
        micro = ids.shape[0] // dp
        mine = ids[dp_rank * micro:(dp_rank + 1) * micro]
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean, group=engine.dp_group)
        losses.append(mean.item() / dp)
        norms.append(engine.get_global_grad_norm())
    return losses, norms


def autotp_engine(tp: int, stage: int, global_batch: int, **extra: Any) -> Any:
    """The resharding tests' engine: `tiny_model("llama")` with AdamW and clipping on every rank, tp
    `tp` (cut by `tp_model_init` first), dp the ranks left, ZeRO `stage`; `extra` ds_config sections.
    `train_batch_size` counts every rank, as accelerate writes it for "auto" and DeepSpeed checks it
    under AutoTP: the engine restates it for the dp size."""
    import zerospeed

    dp = torch.distributed.get_world_size() // tp
    zero = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}
    config = {"train_micro_batch_size_per_gpu": global_batch // dp, "gradient_clipping": 1.0,
              "train_batch_size": global_batch // dp * torch.distributed.get_world_size(),
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
              "zero_optimization": zero, "tensor_parallel": {"autotp_size": tp}, **extra}
    model = tiny_model("llama")
    if tp > 1:
        model = zerospeed.tp_model_init(model, tp, torch.float32)
    engine, *_ = zerospeed.initialize(model=model, config=config)
    return engine


def full_weights(engine: Any) -> dict[str, torch.Tensor]:
    """The unsharded weights, copied (gathered over dp at stage 3, then joined over tp)."""
    from zerospeed.runtime.tensor_parallel.state_dict import consolidated_state_dict
    from zerospeed.runtime.zero.partition_parameters import GatheredParameters

    params = list(engine.module.parameters())
    with GatheredParameters(params, enabled=any(hasattr(p, "ds_id") for p in params)):
        if not engine.tensor_parallel.enabled:
            return {k: v.clone() for k, v in engine.module.state_dict().items()}
        return consolidated_state_dict(engine.module, engine.tensor_parallel.tp_group)
