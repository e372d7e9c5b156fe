"""transformers `Trainer` with accelerate's `parallelism_config` (`sp_backend="deepspeed"`): Ulysses
sequence parallelism (ALST) on a tiny Llama, written against the public APIs only.

Usage: trainer_sp.py OUTPUT_DIR SP_SIZE. SP_SIZE 1 trains the same model without sequence
parallelism (the reference, on one rank). Accelerate registers Ulysses attention
(`UlyssesSPAttentionHF.register_with_transformers`), wraps the data loader in
`UlyssesSPDataLoaderAdapter` (each sp rank's batch is trained in turn by the whole group) and the
Trainer aggregates the loss over the sequence shards. Writes OUTPUT_DIR/result.json on rank 0:
the logged history and the engine's class.
"""

import json
import os
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

SEQ, SAMPLES, STEPS = 16, 8, 4


def main(output_dir: str, sp_size: int) -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         attn_implementation="sdpa"))
    generator = torch.Generator().manual_seed(3)
    data = [{"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(SEQ)} for ids in torch.randint(0, 32, (SAMPLES, SEQ), generator=generator)]
    ds_config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                 "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": {"stage": 1},
                 "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}}}
    parallelism = None
    if sp_size > 1:
        from accelerate.parallelism_config import ParallelismConfig
        from accelerate.utils import DeepSpeedSequenceParallelConfig

        parallelism = ParallelismConfig(sp_backend="deepspeed", sp_size=sp_size, sp_handler=DeepSpeedSequenceParallelConfig(
            sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"))
    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=1, max_steps=STEPS,
                             learning_rate=1e-2, lr_scheduler_type="constant", max_grad_norm=0.5, logging_steps=1,
                             seed=7, report_to="none", use_cpu=True, save_strategy="no", deepspeed=ds_config,
                             train_sampling_strategy="sequential", parallelism_config=parallelism)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        engine = trainer.model_wrapped
        history = [entry for entry in trainer.state.log_history if "loss" in entry]
        with open(os.path.join(output_dir, "result.json"), "w") as handle:
            json.dump({"history": history, "engine": f"{type(engine).__module__}.{type(engine).__name__}"}, handle)


if __name__ == "__main__":
    positional = [arg for arg in sys.argv[1:] if not arg.startswith("--local_rank")]   # the launcher's flag
    main(positional[0], int(positional[1]))
