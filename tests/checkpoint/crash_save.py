"""Run by test_crash_safety.py in a subprocess: one rank saves twice; the hook may SIGKILL the second save.

    python crash_save.py <save_dir> <first_tag> <second_tag> [load]
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import zerospeed  # noqa: E402
from parity import make_model  # noqa: E402
from zerospeed.checkpoint.atomic import CRASH_ENV  # noqa: E402


def main() -> None:
    save_dir, first, second = sys.argv[1:4]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", ZS_ACCELERATOR="cpu")
    dist.init_process_group("gloo", init_method=f"file://{save_dir}.rdzv", rank=0, world_size=1)
    config = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 1}}
    engine, _, _, _ = zerospeed.initialize(model=make_model(), config=config)
    if len(sys.argv) > 4:
        path, _ = engine.load_checkpoint(save_dir)
        print(f"loaded {path} at step {engine.global_steps}")
        return
    crash_at = os.environ.pop(CRASH_ENV, None)
    for index, tag in enumerate((first, second)):
        loss = engine(torch.randn(2, 8), torch.randn(2, 4))
        engine.backward(loss)
        engine.step()
        if index == 1 and crash_at:
            os.environ[CRASH_ENV] = crash_at
        engine.save_checkpoint(save_dir, tag=tag)
    print("saved both")


if __name__ == "__main__":
    main()
