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
    parser.add_argument("--steps", type=int, default=200)
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
    """Save, resume a fresh engine from the checkpoint (its next losses must equal the original's),
    merge the ZeRO shards with zero_to_fp32 into safetensors, load them into a plain model, sample."""
    if not hasattr(engine, "save_checkpoint"):
        return
    engine.save_checkpoint(save_dir)
    resumed, _, _, _ = deepspeed.initialize(model=GPT(config), config=engine._config._param_dict)
    load_path, _ = resumed.load_checkpoint(save_dir)
    rank, micro = deepspeed.comm.get_rank(), engine.train_micro_batch_size_per_gpu()
    for step in range(2):
        first = (step * deepspeed.comm.get_world_size() + rank) * micro
        inputs, targets = (torch.stack(t) for t in zip(*(dataset[i] for i in range(first, first + micro))))
        losses = []
        for runner in (engine, resumed):
            runner.train()
            loss = runner(inputs, targets)
            runner.backward(loss)
            runner.step()
            losses.append(loss.item())
        if losses[0] != losses[1]:
            raise SystemExit(f"resumed run diverged at step {step}: {losses[0]} vs {losses[1]}")
    if rank == 0:
        print(f"resumed from {load_path}: next 2 losses equal the uninterrupted run", flush=True)
    engine.save_checkpoint(save_dir)   # the state the merged model must reproduce
    if rank != 0:
        return
    from safetensors.torch import load_file

    from zerospeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    output_dir = os.path.join(save_dir, "fp32")
    convert_zero_checkpoint_to_fp32_state_dict(save_dir, output_dir, safe_serialization=True)
    model = GPT(config)
    missing, unexpected = model.load_state_dict(load_file(os.path.join(output_dir, "model.safetensors")), strict=False)
    tied = {name for name, _ in model.named_parameters(remove_duplicate=False)} - dict(model.named_parameters()).keys()
    if unexpected or set(missing) - tied:
        raise SystemExit(f"merged weights do not fit the model: missing {missing}, unexpected {unexpected}")
    _compare_and_sample(engine, model, dataset)


def _compare_and_sample(engine, model, dataset) -> None:
    """The merged model must give the checkpointed engine's loss; then print a greedy sample."""
    inputs, targets = (torch.stack(t) for t in zip(*(dataset[i] for i in range(4))))
    model.eval()
    with torch.no_grad():
        merged_loss = model(inputs, targets).item()
        engine.eval()
        engine_loss = engine(inputs, targets).float().item()
        print(f"zero_to_fp32 round trip: engine loss {engine_loss:.5f}, merged-model loss {merged_loss:.5f}")
        if abs(merged_loss - engine_loss) > 1e-3 * max(1.0, abs(engine_loss)):
            raise SystemExit("the merged fp32 model does not reproduce the engine's loss")
        idx = torch.tensor([list(b"def ")])
        for _ in range(48):
            next_byte = model(idx[:, -model.config.block_size:])[:, -1].argmax(-1)
            idx = torch.cat([idx, next_byte.view(1, 1)], dim=1)
    print("sample:", bytes(idx[0].tolist()).decode("utf-8", errors="replace"), flush=True)


if __name__ == "__main__":
    main()
