"""Tiny Hugging Face models of the architectures AutoTP inference covers, and the parity check
every launch path runs (the harness test, plain torchrun, the zerospeed launcher, tests/compat).

Each model is built after seeding torch with 0, so every rank holds the same weights and the
unsharded copy each rank builds for reference is the model before the cut. Kinds:
llama (GQA, untied head), mistral, qwen2 (q/k/v biases, tied embeddings), gpt_neox (head-major
fused query_key_value), opt (tied embeddings, biases), falcon (new decoder architecture, GQA,
fused qkv), phi (output head with a bias), gpt2 (Conv1D, fused c_attn).
"""

from __future__ import annotations

from typing import Any

import torch

VOCAB, HIDDEN, HEADS, LAYERS = 64, 32, 4, 2
KINDS = ("llama", "mistral", "qwen2", "gpt_neox", "opt", "falcon", "phi", "gpt2")
NEW_TOKENS = 6


def _common() -> dict[str, Any]:
    return {"vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
            "max_position_embeddings": 64, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def _config(kind: str) -> Any:
    import transformers as hf

    common = _common()
    if kind == "llama":
        return hf.LlamaConfig(intermediate_size=64, num_key_value_heads=2, tie_word_embeddings=False, **common)
    if kind == "mistral":
        return hf.MistralConfig(intermediate_size=64, num_key_value_heads=2, **common)
    if kind == "qwen2":
        return hf.Qwen2Config(intermediate_size=64, num_key_value_heads=2, tie_word_embeddings=True, **common)
    if kind == "gpt_neox":
        return hf.GPTNeoXConfig(intermediate_size=64, **common)
    if kind == "opt":
        return hf.OPTConfig(ffn_dim=64, word_embed_proj_dim=HIDDEN, **common)
    if kind == "falcon":
        return hf.FalconConfig(new_decoder_architecture=True, num_kv_heads=2, **common)
    if kind == "phi":
        return hf.PhiConfig(intermediate_size=64, **common)
    if kind == "gpt2":
        return hf.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                             bos_token_id=1, eos_token_id=2)
    raise ValueError(f"unknown model kind {kind!r}")


def tiny_model(kind: str) -> torch.nn.Module:
    """A fp32 causal LM of ``kind`` in eval mode, built after seeding torch with 0."""
    import transformers as hf

    config = _config(kind)
    torch.manual_seed(0)
    model = hf.AutoModelForCausalLM.from_config(config)
    return model.float().eval()


def prompt() -> torch.Tensor:
    """Two prompts of 5 tokens, the same on every rank."""
    return torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(11))


@torch.no_grad()
def logits_and_tokens(model: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt's logits and the greedy continuation (``model`` is an engine or a module)."""
    ids = prompt()
    logits = model(input_ids=ids).logits
    tokens = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                            do_sample=False, pad_token_id=0)
    return logits, tokens
