"""One rank of a crash-test job (run by crash_trials.py in a subprocess, one per rank).

    RANK=r WORLD_SIZE=w ZS_TEST_RDZV=<file> python crash_save.py <save_dir> <stage> <steps> <tags>

Resumes from `<save_dir>` when it holds a `latest` (a resumed run must reproduce the untouched
run bit for bit, so its checkpoints can be compared with a golden run's), then trains up to
`<steps>` and saves after every step with the tags `<tags>` (comma-separated, cycled; `default`
means DeepSpeed's `global_step<N>`). The batch of step N is a function of N and the rank only.

Side files, written by rank 0 next to the save directory:
    <save_dir>.saving     created just before this run's first save (the kill watcher starts then)
    <save_dir>.progress   one line per save that returned on every rank: its global step
    <save_dir>.timing     `start <s>` before and `end <s>` after each save of this run, in seconds
                          from the marker (a kill mid-save leaves a `start` last)
ZS_TEST_CRASH_AT=<point>[@rank] with ZS_TEST_CRASH_STEP=<N> arms the named crash hook
(ZEROSPEED_CHECKPOINT_CRASH_AT) for the save of step N only. ZS_CRASH_MODULES_OUT=<file>: rank 0
writes the names of the modules it imported there when it finishes (crash_warm.py reads them).
"""

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import zerospeed  # noqa: E402
from parity import IN_FEATURES, OUT_FEATURES, make_model  # noqa: E402
from zerospeed.checkpoint.atomic import CRASH_ENV  # noqa: E402

MICRO_BATCH = 2


def config(stage: int, world_size: int) -> dict:
    zero = {"stage": stage}
    if stage == 3:  # partition every parameter of the tiny model, so the optim files hold real shards
        zero.update(stage3_param_persistence_threshold=0, stage3_model_persistence_threshold=0)
    return {"train_batch_size": MICRO_BATCH * world_size, "train_micro_batch_size_per_gpu": MICRO_BATCH,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": zero}


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.randn(MICRO_BATCH, IN_FEATURES, generator=generator),
            torch.randn(MICRO_BATCH, OUT_FEATURES, generator=generator))


def main() -> None:
    save_dir, stage, steps, tags = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(",")
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), ZS_ACCELERATOR="cpu")
    os.environ.pop(CRASH_ENV, None)
    crash_at, crash_step = os.environ.get("ZS_TEST_CRASH_AT"), int(os.environ.get("ZS_TEST_CRASH_STEP", steps))
    torch.set_num_threads(1)
    rendezvous = os.environ.get("ZS_TEST_RDZV", f"{save_dir}.rdzv")
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    engine, _, _, _ = zerospeed.initialize(model=make_model(), config=config(stage, world_size))
    if os.path.exists(os.path.join(save_dir, "latest")):
        engine.load_checkpoint(save_dir)
    if rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(save_dir)), exist_ok=True)
        open(f"{save_dir}.timing", "w").close()
        open(f"{save_dir}.saving", "w").close()
    marked = time.monotonic()
    for step in range(engine.global_steps + 1, steps + 1):
        loss = engine(*batch(step, rank))
        engine.backward(loss)
        engine.step()
        if crash_at and step == crash_step:
            os.environ[CRASH_ENV] = crash_at
        tag = tags[(step - 1) % len(tags)]
        if rank == 0:
            with open(f"{save_dir}.timing", "a") as timing:
                timing.write(f"start {time.monotonic() - marked:.4f}\n")
        engine.save_checkpoint(save_dir, tag=None if tag == "default" else tag)
        if rank == 0:
            with open(f"{save_dir}.progress", "a") as progress:
                progress.write(f"{step}\n")
            with open(f"{save_dir}.timing", "a") as timing:
                timing.write(f"end {time.monotonic() - marked:.4f}\n")
    print(f"rank {rank} done at step {engine.global_steps}", flush=True)
    modules_out = os.environ.get("ZS_CRASH_MODULES_OUT")
    if modules_out and rank == 0:  # what a rank imports, for the warm fork server (crash_warm.py)
        with open(modules_out, "w") as handle:
            handle.write("\n".join(sorted(sys.modules)))
    os._exit(0)  # skip gloo's teardown (it can abort at exit)


if __name__ == "__main__":
    main()
