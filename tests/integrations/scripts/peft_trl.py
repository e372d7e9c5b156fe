"""PEFT LoRA under ZeRO-3 (`--task lora`) and TRL `SFTTrainer` at ZeRO-2 (`--task sft`), each a few
steps of a tiny Llama with the HF Trainer machinery; rank 0 writes what the test compares.
Written against the libraries' documented APIs; it knows nothing of zerospeed."""

import argparse
import json
import os

import torch
from datasets import Dataset
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)


def lora(args):
    from peft import LoraConfig, get_peft_model

    training_args = TrainingArguments(output_dir=args.output_dir, deepspeed=args.deepspeed, max_steps=3,
                                      per_device_train_batch_size=2, learning_rate=1e-2, logging_steps=1,
                                      report_to="none", use_cpu=True, seed=7, save_strategy="no")
    model = AutoModelForCausalLM.from_pretrained(args.model)  # under zero.Init: partitioned
    # The adapters' random init from a known state: how much RNG from_pretrained consumes under
    # zero.Init is not part of the contract (docs/compatibility.md, Client libraries).
    set_seed(7)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))
    frozen = [p for p in model.parameters() if not p.requires_grad]
    info = {"trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad),
            "frozen_partitioned": all(hasattr(p, "ds_numel") and p.numel() < p.ds_numel for p in frozen)}
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    lines = open(args.text).read().split("\n")[:24]
    encoded = tokenizer(lines, padding="max_length", truncation=True, max_length=16)
    dataset = Dataset.from_dict({**encoded, "labels": encoded["input_ids"]})
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset, data_collator=default_data_collator)
    trainer.train()
    trainer.save_model(args.output_dir)
    return trainer, info


def sft(args):
    from trl import SFTConfig, SFTTrainer

    config = SFTConfig(output_dir=args.output_dir, deepspeed=args.deepspeed, max_steps=3, per_device_train_batch_size=2,
                       learning_rate=1e-2, logging_steps=1, report_to="none", use_cpu=True, seed=7,
                       save_strategy="no", max_length=32)
    lines = [line for line in open(args.text).read().split("\n") if line][:24]
    trainer = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(args.model), args=config,
                         train_dataset=Dataset.from_list([{"text": line} for line in lines]),
                         processing_class=AutoTokenizer.from_pretrained(args.model))
    trainer.train()
    trainer.save_model(args.output_dir)
    return trainer, {}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--task", choices=["lora", "sft"], required=True)
    for name in ("deepspeed", "model", "text", "output_dir"):
        parser.add_argument(f"--{name}", required=True)
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    trainer, info = (lora if args.task == "lora" else sft)(args)
    if torch.distributed.get_rank() == 0:
        info["history"] = [e for e in trainer.state.log_history if "loss" in e]
        with open(os.path.join(args.output_dir, "result.json"), "w") as handle:
            json.dump(info, handle)


if __name__ == "__main__":
    main()
