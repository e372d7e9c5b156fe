"""Bad ds_configs for benchmarks/reliability.py: each must be refused at `initialize` with an error
that names the offending key (its leaf name at least; the dotted path is counted separately).
`zero_optimization.sub_group_size: 0` is not among them: DeepSpeed allows it (one parameter per
stage-3 sub-group) and so does zerospeed; -1 is.

    python benchmarks/bad_configs.py      # one line per case, then the totals
"""

from __future__ import annotations

import copy
import os
import sys
from typing import Any

BASE: dict[str, Any] = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2,
                        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}

# (dotted key path, value to put there); `None` as the value deletes the key.
CASES: list[tuple[str, Any]] = [
    ("train_batch_size", -2), ("train_batch_size", "2"), ("train_batch_size", 2.5), ("train_batch_size", 3),
    ("train_micro_batch_size_per_gpu", 0), ("train_micro_batch_size_per_gpu", "two"),
    ("gradient_accumulation_steps", 0), ("gradient_accumulation_steps", "yes"),
    ("optimizer.params.lr", "0.1"), ("optimizer.type", None), ("optimizer.type", "NoSuchOptimizer"),
    ("optimizer.params.weight_decay", "x"), ("optimizer.params.eps", "1e-8"), ("optimizer.params.betas", "0.9"),
    ("optimizer", "Adam"),
    ("scheduler.type", "NoSuchScheduler"), ("scheduler.params", "x"),
    ("zero_optimization.stage", 5), ("zero_optimization.stage", "2"), ("zero_optimization", 2),
    ("zero_optimization.reduce_bucket_size", -1), ("zero_optimization.allgather_bucket_size", "big"),
    ("zero_optimization.overlap_comm", "yes"), ("zero_optimization.contiguous_gradients", "no"),
    ("zero_optimization.offload_optimizer.device", "gpu0"), ("zero_optimization.offload_param.device", "disk"),
    ("zero_optimization.offload_optimizer.pin_memory", "yes"),
    ("zero_optimization.stage3_param_persistence_threshold", -5),
    ("zero_optimization.stage3_prefetch_bucket_size", "x"), ("zero_optimization.sub_group_size", -1),
    ("fp16.enabled", "true"), ("fp16.loss_scale", -1), ("fp16.initial_scale_power", "16"),
    ("fp16.loss_scale_window", 0), ("fp16.hysteresis", -1), ("fp16.min_loss_scale", -1),
    ("bf16.enabled", "yes"), ("gradient_clipping", -1.0), ("gradient_clipping", "1.0"),
    ("steps_per_print", "x"), ("wall_clock_breakdown", "yes"), ("prescale_gradients", "no"),
    ("gradient_predivide_factor", 0), ("activation_checkpointing.partition_activations", "yes"),
    ("comms_logger.enabled", "yes"), ("checkpoint.tag_validation", "Sometimes"), ("tensorboard.enabled", "1"),
    ("data_types.grad_accum_dtype", "float128"), ("dataloader_drop_last", "yes"),
    ("zero_optimization.stage3_max_live_parameters", -1),
]


def build(path: str, value: Any) -> dict[str, Any]:
    config = copy.deepcopy(BASE)
    node = config
    *parents, leaf = path.split(".")
    for key in parents:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    if value is None:
        node.pop(leaf, None)
    else:
        node[leaf] = value
    if path.startswith(("zero_optimization.offload", "zero_optimization.stage3", "zero_optimization.sub_group")):
        config["zero_optimization"]["stage"] = 3
    return config


def check(path: str, value: Any) -> tuple[bool, bool, str]:
    """(refused naming the leaf key, naming the dotted path, the error's first line)."""
    import torch

    import zerospeed
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from parity import make_model

    try:
        zerospeed.initialize(model=make_model(), config=build(path, value))
    except Exception as error:  # noqa: BLE001 - what matters is whether the message names the key
        message = f"{type(error).__name__}: {error}"
        leaf = path.split(".")[-1]
        return leaf in message, path in message, message.splitlines()[0][:160]
    finally:
        torch.manual_seed(0)
    return False, False, "accepted"


def run_bad_configs() -> dict[str, Any]:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", ZS_ACCELERATOR="cpu")
    named = dotted = 0
    misses, leaf_only = [], []
    for path, value in CASES:
        leaf_named, path_named, message = check(path, value)
        named += leaf_named
        dotted += path_named
        if not leaf_named:
            misses.append(f"{path}={value!r}: {message}")
        elif not path_named:
            leaf_only.append(f"{path}={value!r}")
        print(f"config {path}={value!r}: {'named' if leaf_named else 'NOT NAMED'} -- {message}", flush=True)
    return {"cases": len(CASES), "refused_naming_key": named, "naming_dotted_path": dotted, "misses": misses,
            "leaf_name_only": leaf_only}


if __name__ == "__main__":
    result = run_bad_configs()
    print({k: v for k, v in result.items() if k != "misses"})
    print("not refused naming the key:", result["misses"] or "none")
