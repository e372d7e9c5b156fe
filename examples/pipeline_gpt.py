"""A pipelined GPT: the decoder of gpt.py as a PipelineModule with a tied embedding / LM head,
trained with `engine.train_batch()`, checkpointed in DeepSpeed's pipeline layout and resumed.

    zerospeed --num_gpus 2 examples/pipeline_gpt.py --deepspeed_config examples/configs/pipeline.json
    zerospeed --num_gpus 4 examples/pipeline_gpt.py --deepspeed_config examples/configs/pipeline.json --stages 2

With 4 ranks and --stages 2 this is 2 pipeline stages x 2 data-parallel pipelines.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zerospeed as deepspeed  # noqa: E402  (the one line a DeepSpeed script changes)
from gpt import Block, ByteWindows, GPTConfig, stdlib_bytes  # noqa: E402
from zerospeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec  # noqa: E402


class Embedding(nn.Module):
    """Token + position embedding; its `wte.weight` is tied to the LM head on the last stage."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        for weight in (self.wte.weight, self.wpe.weight):
            nn.init.normal_(weight, std=0.02)  # GPT-2's init; N(0, 1) would make the tied head's logits huge

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))


def lm_head(embedding: Embedding, hidden: torch.Tensor) -> torch.Tensor:
    return hidden @ embedding.wte.weight.t()


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def pipelined_gpt(config: GPTConfig, num_stages: int, checkpoint_interval: int) -> PipelineModule:
    layers = [TiedLayerSpec("embed", Embedding, config, tied_weight_attr="wte.weight"),
              *[LayerSpec(Block, config) for _ in range(config.n_layer)],
              LayerSpec(nn.LayerNorm, config.n_embd),
              TiedLayerSpec("embed", Embedding, config, forward_fn=lm_head, tied_weight_attr="wte.weight")]
    return PipelineModule(layers, num_stages=num_stages, loss_fn=lm_loss, partition_method="type:Block",
                          activation_checkpoint_interval=checkpoint_interval, seed_layers=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--checkpoint_interval", type=int, default=1)
    parser.add_argument("--save_dir", default="runs/pipeline_gpt")
    parser.add_argument("--local_rank", type=int, default=-1)
    deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed()
    config = GPTConfig(n_layer=4, n_embd=64, block_size=64)
    model = pipelined_gpt(config, args.stages, args.checkpoint_interval)
    dataset = ByteWindows(stdlib_bytes(1_000_000), config.block_size)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, training_data=dataset)
    for _ in range(args.steps // 2):
        engine.train_batch()  # pulls gradient_accumulation_steps micro-batches from training_data
    engine.save_checkpoint(args.save_dir)
    engine.load_checkpoint(args.save_dir)
    for _ in range(args.steps - args.steps // 2):
        loss = engine.train_batch()
    if deepspeed.comm.get_rank() == 0:
        print(f"final loss {float(loss):.4f} after {engine.global_steps} steps; checkpoint in {args.save_dir}")


if __name__ == "__main__":
    main()
