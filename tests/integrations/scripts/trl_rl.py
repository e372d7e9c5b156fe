"""TRL's `SFTTrainer`, `DPOTrainer` and `GRPOTrainer` (no vLLM: the policy generates) on a tiny Llama,
2-3 steps; rank 0 writes what the test compares. DPO and GRPO (beta > 0) build a frozen reference
model that TRL prepares itself (`prepare_deepspeed`: `deepspeed.initialize` without an optimizer,
under zero.Init at ZeRO-3), and GRPO generates with `unwrap_model_for_generation`.
Written against the libraries' documented APIs; it knows nothing of zerospeed."""

import argparse
import json
import os

import torch
from datasets import Dataset
from transformers import AutoTokenizer

COMMON = dict(max_steps=3, per_device_train_batch_size=2, learning_rate=1e-2, logging_steps=1, report_to="none",
              use_cpu=True, seed=7, save_strategy="no")


def _lines(args):
    return [line for line in open(args.text).read().split("\n") if line]


def sft(args):
    from trl import SFTConfig, SFTTrainer

    config = SFTConfig(output_dir=args.output_dir, deepspeed=args.deepspeed, max_length=32, **COMMON)
    return SFTTrainer(model=args.model, args=config, train_dataset=Dataset.from_list([{"text": t} for t in _lines(args)[:16]]),
                      processing_class=AutoTokenizer.from_pretrained(args.model))


def dpo(args):
    from trl import DPOConfig, DPOTrainer

    lines = _lines(args)
    rows = [{"prompt": " ".join(a.split()[:4]), "chosen": " ".join(a.split()[4:9]), "rejected": " ".join(b.split()[4:9])}
            for a, b in zip(lines[:16], lines[16:32])]
    config = DPOConfig(output_dir=args.output_dir, deepspeed=args.deepspeed, max_length=24, beta=0.1, **COMMON)
    return DPOTrainer(model=args.model, args=config, train_dataset=Dataset.from_list(rows),
                      processing_class=AutoTokenizer.from_pretrained(args.model))


def word_sum(completions, **kwargs):
    """A deterministic reward that varies between completions: the completion's word numbers mod 7."""
    return [float(sum(int(w[1:]) for w in c.split() if w[1:].isdigit()) % 7) for c in completions]


def grpo(args):
    from trl import GRPOConfig, GRPOTrainer

    config = GRPOConfig(output_dir=args.output_dir, deepspeed=args.deepspeed, beta=0.1, num_generations=2,
                        max_completion_length=6, temperature=1.0, **COMMON)
    prompts = [{"prompt": " ".join(line.split()[:5])} for line in _lines(args)[:16]]
    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    return GRPOTrainer(model=args.model, reward_funcs=word_sum, args=config,
                       train_dataset=Dataset.from_list(prompts), processing_class=tokenizer)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--task", choices=["sft", "dpo", "grpo"], required=True)
    for name in ("deepspeed", "model", "text", "output_dir"):
        parser.add_argument(f"--{name}", required=True)
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    trainer = {"sft": sft, "dpo": dpo, "grpo": grpo}[args.task](args)
    trainer.train()
    trainer.save_model(args.output_dir)
    if torch.distributed.get_rank() == 0:
        engine = trainer.model_wrapped
        ref = getattr(trainer, "ref_model", None)
        info = {"history": [e for e in trainer.state.log_history if "loss" in e],
                "engine": f"{type(engine).__module__}.{type(engine).__name__}",
                "ref_engine": None if ref is None else f"{type(ref).__module__}.{type(ref).__name__}"}
        with open(os.path.join(args.output_dir, "result.json"), "w") as handle:
            json.dump(info, handle)


if __name__ == "__main__":
    main()
