"""zero_to_fp32 against DeepSpeed's script on the same stage-3 checkpoint: peak RSS and time.

    python benchmarks/bench_zero_to_fp32.py --params 300 --shard 1GB

Step 1 trains a plain MLP of about `--params` million parameters for one step at ZeRO stage 3 on 2
gloo ranks and saves a checkpoint (fp32 masters + Adam moments: 12 bytes per parameter on disk plus
the model files). Step 2 converts it, alternating, with `python -m zerospeed.utils.zero_to_fp32`
and (when installed) `python -m deepspeed.utils.zero_to_fp32`, each in a fresh process; peak RSS is
the child's resident set polled every 10 ms (its maximum), time is wall time. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WIDTH = 4096


def _mlp(num_params_m: int) -> torch.nn.Module:
    layers = max(1, round(num_params_m * 1e6 / (WIDTH * WIDTH + WIDTH)))
    return torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)))


def _save_rank(rank: int, num_params_m: int, save_dir: str, init_file: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), ZS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    import zerospeed

    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, _, _, _ = zerospeed.initialize(model=_mlp(num_params_m), config=config)
    loss = engine(torch.randn(1, WIDTH)).square().mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(save_dir)
    dist.barrier()
    os._exit(0)


def write_checkpoint(num_params_m: int, save_dir: str) -> float:
    started = time.perf_counter()
    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        ranks = [context.Process(target=_save_rank, args=(r, num_params_m, save_dir, f"{tmp}/rdzv"))
                 for r in range(2)]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join()
        if any(p.exitcode != 0 for p in ranks):
            raise RuntimeError(f"saving ranks exited with {[p.exitcode for p in ranks]}")
    return time.perf_counter() - started


def convert(module: str, checkpoint: str, output: str, shard: str) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) of one conversion in a fresh child process."""
    shutil.rmtree(output, ignore_errors=True)
    command = [sys.executable, "-m", module, checkpoint, output, "--max_shard_size", shard, "--safe_serialization"]
    seconds, peak_mib = run_with_peak_rss(command, module)
    if not os.listdir(output):
        raise RuntimeError(f"{module} wrote nothing into {output}")
    return seconds, peak_mib


def run_with_peak_rss(command: list[str], name: str) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) of `command` in a fresh child process, RSS polled every 10 ms."""
    import psutil

    started = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             env={**os.environ, "DS_ACCELERATOR": "cpu"})
    watched = psutil.Process(child.pid)
    peak_bytes = 0
    while child.poll() is None:
        try:
            peak_bytes = max(peak_bytes, watched.memory_info().rss)
        except psutil.NoSuchProcess:
            break
        time.sleep(0.01)
    seconds = time.perf_counter() - started
    if child.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{child.stderr.read().decode()[-2000:]}")
    return seconds, peak_bytes / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=300, help="model size in millions of parameters")
    parser.add_argument("--shard", default="1GB", help="--max_shard_size for both converters")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    workdir = args.workdir or tempfile.mkdtemp(prefix="zs-z2f-")
    checkpoint = os.path.join(workdir, "ckpt")
    save_s = write_checkpoint(args.params, checkpoint)
    model_bytes = sum(p.numel() for p in _mlp(args.params).parameters()) * 4
    converters = {"zerospeed": "zerospeed.utils.zero_to_fp32"}
    try:
        import deepspeed  # noqa: F401

        converters["DeepSpeed 0.19.8"] = "deepspeed.utils.zero_to_fp32"
    except ImportError:
        print("deepspeed is not installed: only zerospeed's converter is timed")
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in converters}
    for round_index in range(args.rounds):
        names = list(converters) if round_index % 2 == 0 else list(reversed(converters))
        for name in names:
            results[name].append(convert(converters[name], checkpoint, os.path.join(workdir, "out"), args.shard))
    print(f"\nstage-3 checkpoint from 2 ranks: {model_bytes / 2**30:.2f} GiB of fp32 weights, "
          f"saved in {save_s:.0f} s; --max_shard_size {args.shard}, safetensors; best of {args.rounds}")
    print("| converter | wall s | peak RSS MiB | RSS / fp32 model size |")
    print("|---|---|---|---|")
    for name, runs in results.items():
        seconds = min(r[0] for r in runs)
        peak = min(r[1] for r in runs)
        print(f"| {name} | {seconds:.1f} | {peak:.0f} | {peak * 2**20 / model_bytes:.2f} |")
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
