"""ds_to_universal against DeepSpeed's on the same ZeRO checkpoint: peak RSS and wall time.

    python benchmarks/bench_ds_to_universal.py --params 100 --stage 2 --rounds 2

Step 1 trains a plain MLP of about `--params` million parameters for one step at `--stage` on 2
gloo ranks with zerospeed and saves a checkpoint (fp32 masters + Adam moments: 12 bytes per
parameter). Step 2 converts its tag folder, alternating, with `python -m
zerospeed.checkpoint.ds_to_universal` and (when installed) `python -m deepspeed.checkpoint.ds_to_universal`,
each in a fresh process with `--inject_missing_state --num_extract_workers 1 --num_merge_workers 1`
(one process each, so the polled RSS is all of the converter's memory; DeepSpeed's pools would
spread it over workers). Peak RSS is the child's resident set polled every 10 ms, time is wall
time. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_zero_to_fp32 import _mlp, run_with_peak_rss  # noqa: E402 - the same model and RSS poll


def _save_rank(rank: int, num_params_m: int, stage: int, save_dir: str, init_file: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), ZS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    import zerospeed

    torch.manual_seed(0)
    zero = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}, "zero_optimization": zero}
    model = _mlp(num_params_m)
    engine, _, _, _ = zerospeed.initialize(model=model, config=config)
    loss = engine(torch.randn(1, model[0].in_features)).square().mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(save_dir, tag="bench")
    dist.barrier()
    os._exit(0)


def write_checkpoint(num_params_m: int, stage: int, save_dir: str) -> None:
    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        ranks = [context.Process(target=_save_rank, args=(r, num_params_m, stage, save_dir, f"{tmp}/rdzv"))
                 for r in range(2)]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join()
        if any(p.exitcode != 0 for p in ranks):
            raise RuntimeError(f"saving ranks exited with {[p.exitcode for p in ranks]}")


def convert(module: str, tag_dir: str, output: str) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) of one conversion in a fresh child process."""
    shutil.rmtree(os.path.dirname(output), ignore_errors=True)
    command = [sys.executable, "-m", module, "--input_folder", tag_dir, "--output_folder", output,
               "--inject_missing_state", "--num_extract_workers", "1", "--num_merge_workers", "1"]
    seconds, peak_mib = run_with_peak_rss(command, module)
    if not os.path.isfile(os.path.join(os.path.dirname(output), "latest_universal")):
        raise RuntimeError(f"{module} wrote no latest_universal beside {output}")
    return seconds, peak_mib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=100, help="model size in millions of parameters")
    parser.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    workdir = args.workdir or tempfile.mkdtemp(prefix="zs-uc-")
    checkpoint = os.path.join(workdir, "ckpt")
    write_checkpoint(args.params, args.stage, checkpoint)
    model_bytes = sum(p.numel() for p in _mlp(args.params).parameters()) * 4
    converters = {"zerospeed": "zerospeed.checkpoint.ds_to_universal"}
    try:
        import deepspeed  # noqa: F401

        converters["DeepSpeed 0.19.8"] = "deepspeed.checkpoint.ds_to_universal"
    except ImportError:
        print("deepspeed is not installed: only zerospeed's converter is measured")
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in converters}
    for round_index in range(args.rounds):
        names = list(converters) if round_index % 2 == 0 else list(reversed(converters))
        for name in names:
            output = os.path.join(workdir, "out", "universal")
            results[name].append(convert(converters[name], os.path.join(checkpoint, "bench"), output))
    print(f"\nstage-{args.stage} checkpoint from 2 ranks: {model_bytes / 2**30:.2f} GiB of fp32 weights "
          f"(x3 with both Adam moments); best of {args.rounds}")
    print("| converter | wall s | peak RSS MiB | peak RSS / fp32 model size |")
    print("|---|---|---|---|")
    for name, runs in results.items():
        seconds = min(r[0] for r in runs)
        peak = min(r[1] for r in runs)
        print(f"| {name} | {seconds:.1f} | {peak:.0f} | {peak * 2**20 / model_bytes:.2f} |")
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
