"""The tiny Hugging Face Llama of the Ulysses compat scripts (ulysses_hf.py, sp_checkpoint.py) and
the loss transformers' Trainer computes under sequence parallelism.

GQA on purpose (4 query heads, 2 KV heads): Ulysses splits the heads over the sp ranks, so both
head counts must divide by the sp size (2) and the KV heads are repeated after the all-to-all.
examples/sequence_parallel_llama.py keeps a model of its own so that it runs standalone.
"""

from __future__ import annotations

from typing import Any

import torch

SEQ, HEADS, KV_HEADS, VOCAB = 8, 4, 2, 32


def tiny_llama(num_hidden_layers: int) -> torch.nn.Module:
    """fp32, sdpa attention (what `register_with_transformers(..., "sdpa", ...)` replaces), seeded with 0."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=num_hidden_layers,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config).float()


def trainer_recipe_loss(engine: Any, batch: dict, group: Any) -> torch.Tensor:
    """The sp ranks' losses weighted by their unmasked tokens, as transformers' Trainer averages them
    under sp; the all-gather is autograd's, so every rank's backward reaches every rank's tokens."""
    import torch.distributed.nn.functional as dist_fn

    loss = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["shift_labels"],
                  shift_labels=batch["shift_labels"]).loss
    losses = torch.stack(dist_fn.all_gather(loss, group=group))
    tokens = torch.stack(dist_fn.all_gather((batch["shift_labels"] != -100).view(-1).sum(), group=group))
    return (losses * tokens).sum() / tokens.sum().clamp(min=1)
