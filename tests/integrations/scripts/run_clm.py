"""Causal language modelling with the Hugging Face Trainer, in the shape of transformers'
`examples/pytorch/language-modeling/run_clm.py` (written from the transformers docs): a model from
`--model_name_or_path` or from `--model_type` + `--config_overrides`, a local text file,
tokenize, group into blocks, `Trainer.train(resume_from_checkpoint=...)`, `save_model`, `save_state`.
It knows nothing of DeepSpeed or zerospeed: `--deepspeed ds_config.json` is a TrainingArguments flag.
"""

import sys
from dataclasses import dataclass, field
from itertools import chain

from datasets import load_dataset
from transformers import (
    CONFIG_MAPPING,
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(default=None)
    model_type: str | None = field(default=None)
    config_overrides: str | None = field(default=None)
    tokenizer_name: str | None = field(default=None)


@dataclass
class DataTrainingArguments:
    train_file: str | None = field(default=None)
    block_size: int = field(default=16)


def main():
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    set_seed(training_args.seed)

    raw = load_dataset("text", data_files={"train": data_args.train_file})
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or model_args.model_name_or_path)

    if model_args.model_name_or_path:
        model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path)
    else:
        config = CONFIG_MAPPING[model_args.model_type]()
        if model_args.config_overrides:
            config.update_from_string(model_args.config_overrides)
        model = AutoModelForCausalLM.from_config(config)

    def tokenize(examples):
        return tokenizer(examples["text"])

    def group_texts(examples):
        joined = {k: list(chain(*examples[k])) for k in examples.keys()}
        total = (len(joined["input_ids"]) // data_args.block_size) * data_args.block_size
        result = {k: [t[i: i + data_args.block_size] for i in range(0, total, data_args.block_size)]
                  for k, t in joined.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    with training_args.main_process_first(desc="dataset map"):
        tokenized = raw.map(tokenize, batched=True, remove_columns=["text"])
        train_dataset = tokenized.map(group_texts, batched=True)["train"]

    trainer = Trainer(model=model, args=training_args, train_dataset=train_dataset,
                      processing_class=tokenizer, data_collator=default_data_collator)
    result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model()
    trainer.log_metrics("train", result.metrics)
    trainer.save_state()


if __name__ == "__main__":
    sys.exit(main())
