"""Step time and MFU of the benchmark GPT on the GPUs: zerospeed against DeepSpeed 0.19.8.

Same model (GPT-2 small shape, byte vocabulary, 1024 tokens), data, optimizer (torch AdamW) and
bf16 on both, ZeRO stages 1 and 3, every visible GPU over NCCL, each system in fresh processes.
MFU = (6 N + 12 L d T) flops per token x tokens per step / step time / peak bf16 flops of the GPU
(dense tensor-core peak from the vendor's table; None for a GPU not in it). The figures are printed
and written to $ZS_GPU_REPORT (default gpu-check-report.json) for docs/benchmarks.md.
"""

import json
import os
import statistics
import time

import pytest
import torch
from cuda_ranks import run_nccl

SHAPE = dict(vocab_size=256, block_size=1024, n_layer=12, n_head=12, n_embd=768)
MICRO, STEPS, WARMUP = 8, 14, 4
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "GH200": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}
# The first GPU run sets the bar; a zerospeed step slower than this multiple of DeepSpeed's fails.
MAX_SLOWDOWN = 1.5


def _bench(system, stage):
    from example_models import load_example

    gpt = load_example("gpt")
    GPT, GPTConfig = gpt.GPT, gpt.GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**SHAPE))
    n_params = sum(p.numel() for p in model.parameters())
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "bf16": {"enabled": True}, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1, "torch_adam": True}},
              "zero_optimization": {"stage": stage}}
    library = __import__(system)
    engine, *_ = library.initialize(model=model, config=config)
    generator = torch.Generator().manual_seed(torch.distributed.get_rank())
    times, loss = [], None
    for step in range(STEPS):
        tokens = torch.randint(0, SHAPE["vocab_size"], (MICRO, SHAPE["block_size"] + 1), generator=generator)
        tokens = tokens.to(engine.device)
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        torch.cuda.synchronize()
        if step >= WARMUP:
            times.append(time.perf_counter() - start)
    return {"step_s": statistics.median(times), "loss": float(loss.float().item()), "n_params": n_params,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30}


def _mfu(step_s, n_params, world_size):
    name = torch.cuda.get_device_name(0)
    peak = next((flops for key, flops in PEAK_BF16.items() if key in name), None)
    tokens = MICRO * SHAPE["block_size"] * world_size
    flops_per_token = 6 * n_params + 12 * SHAPE["n_layer"] * SHAPE["n_embd"] * SHAPE["block_size"]
    return None if peak is None else flops_per_token * tokens / step_s / (peak * world_size)


def test_step_time_and_mfu_against_deepspeed():
    try:
        import deepspeed  # noqa: F401 - only checks that DeepSpeed is there; it runs in fresh processes
    except ImportError as error:
        pytest.fail(f"DeepSpeed 0.19.8 is needed for the GPU benchmark (make gpu-check installs it): {error}")
    world_size = torch.cuda.device_count()
    report = {"gpu": torch.cuda.get_device_name(0), "world_size": world_size, "shape": SHAPE, "micro": MICRO,
              "runs": {}}
    for stage in (1, 3):
        for system in ("deepspeed", "zerospeed"):
            ranks = run_nccl(_bench, world_size, system, stage, timeout_s=400)
            step_s = max(r["step_s"] for r in ranks)
            report["runs"][f"{system}-z{stage}"] = {**ranks[0], "step_s": step_s,
                                                     "mfu": _mfu(step_s, ranks[0]["n_params"], world_size)}
    path = os.environ.get("ZS_GPU_REPORT", "gpu-check-report.json")
    with open(path, "w") as handle:
        json.dump(report, handle, indent=2)
    for label, run in report["runs"].items():
        mfu = "n/a" if run["mfu"] is None else f"{100 * run['mfu']:.1f}%"
        print(f"{label}: step {run['step_s'] * 1000:.1f} ms, MFU {mfu}, loss {run['loss']:.4f}, "
              f"peak {run['peak_mem_gib']:.2f} GiB")
    for stage in (1, 3):
        ours, theirs = report["runs"][f"zerospeed-z{stage}"], report["runs"][f"deepspeed-z{stage}"]
        assert torch.isfinite(torch.tensor(ours["loss"])) and abs(ours["loss"] - theirs["loss"]) < 0.1, (ours, theirs)
        assert ours["step_s"] <= MAX_SLOWDOWN * theirs["step_s"], (stage, ours["step_s"], theirs["step_s"])
