"""The `make demo` job: a small GPT trained byte-level on the standard library's source with ZeRO,
checkpointed, merged with zero_to_fp32 and loaded back into a plain PyTorch model.

    zerospeed --num_gpus 2 examples/train_gpt.py --deepspeed_config examples/configs/zero2.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zerospeed as deepspeed  # noqa: E402  (the one line a DeepSpeed script changes)
from gpt import GPT, ByteWindows, GPTConfig, stdlib_bytes  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--save_dir", default="runs/demo")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--seed", type=int, default=0)
    deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_SIZE", 1))))
    config = GPTConfig()
    dataset = ByteWindows(stdlib_bytes(), config.block_size)
    engine, _, loader, _ = deepspeed.initialize(args=args, model=GPT(config), training_data=dataset)
    rank = deepspeed.comm.get_rank()
    losses = train(engine, loader, args.steps, show_progress=rank == 0)
    if rank == 0:
        print(f"loss: first {losses[0]:.3f} -> last {losses[-1]:.3f}", flush=True)
        if not losses[-1] < losses[0]:
            raise SystemExit("the loss did not fall")
    check_round_trip(engine, args.save_dir, dataset, config)


def train(engine, loader, steps: int, show_progress: bool) -> list[float]:
    losses = []
    data = _repeat(loader)
    progress = tqdm(total=steps, disable=not show_progress, desc="train", unit="step")
    while engine.global_steps < steps:
        inputs, targets = next(data)
        loss = engine(inputs, targets)
        engine.backward(loss)
        engine.step()
        if engine.micro_steps % engine.gradient_accumulation_steps() == 0:
            losses.append(loss.item())
            progress.update(1)
            progress.set_postfix(loss=f"{loss.item():.3f}")
    progress.close()
    return losses


def _repeat(loader):
    while True:
        yield from loader


def check_round_trip(engine, save_dir: str, dataset, config: GPTConfig) -> None:
    """Save, merge the ZeRO shards into one fp32 state dict, load it into a fresh model, compare."""
    if not hasattr(engine, "save_checkpoint"):
        return
    engine.save_checkpoint(save_dir)
    deepspeed.comm.barrier()
    if deepspeed.comm.get_rank() != 0:
        return
    from zerospeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state_dict = get_fp32_state_dict_from_zero_checkpoint(save_dir)
    model = GPT(config)
    model.load_state_dict(state_dict)
    inputs, targets = (torch.stack(t) for t in zip(*(dataset[i] for i in range(4))))
    with torch.no_grad():
        merged_loss = model(inputs, targets).item()
        engine.eval()
        engine_loss = engine(inputs, targets).float().item()
    print(f"zero_to_fp32 round trip: engine loss {engine_loss:.5f}, merged-model loss {merged_loss:.5f}")
    if abs(merged_loss - engine_loss) > 1e-3 * max(1.0, abs(engine_loss)):
        raise SystemExit("the merged fp32 model does not reproduce the engine's loss")


if __name__ == "__main__":
    main()
