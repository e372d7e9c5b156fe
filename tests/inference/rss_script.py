"""One rank of the memory check: a Llama of ~90 MB (fp32) built on the meta device is filled from
one safetensors file by `init_inference(checkpoint=..., tp 2)`. Writes ``<out_dir>/rank<R>.json``
with the rise of this process's peak RSS during `init_inference` and the model's full size.
Usage: ``rss_script.py OUT_DIR CHECKPOINT_DIR`` under torchrun, after `write_checkpoint` (in
another process, so no rank's baseline holds a full model).
"""

from __future__ import annotations

import json
import os
import resource
import sys

import torch


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # KiB on Linux


def _current_rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def write_checkpoint(checkpoint_dir: str) -> None:
    """The model's weights as one safetensors file (a Hugging Face directory)."""
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    os.makedirs(checkpoint_dir, exist_ok=True)
    torch.manual_seed(0)
    save_file(LlamaForCausalLM(_config()).state_dict(), os.path.join(checkpoint_dir, "model.safetensors"))


def main(out_dir: str, checkpoint_dir: str) -> None:
    import zerospeed
    from accelerate import init_empty_weights
    from transformers import LlamaForCausalLM

    zerospeed.comm.init_distributed()
    rank = torch.distributed.get_rank()
    with init_empty_weights():
        model = LlamaForCausalLM(_config())
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    before = max(_current_rss_bytes(), _peak_rss_bytes())
    engine = zerospeed.init_inference(model, dtype=torch.float32, tensor_parallel={"tp_size": 2},
                                      checkpoint=checkpoint_dir)
    rise = _peak_rss_bytes() - before
    shard_bytes = sum(p.numel() * p.element_size() for p in engine.module.parameters())
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump({"rise": rise, "model_bytes": model_bytes, "shard_bytes": shard_bytes}, handle)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
