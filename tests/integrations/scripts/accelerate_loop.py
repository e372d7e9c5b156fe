"""A plain Accelerate training loop (accelerate's docs), launched by `accelerate launch
--use_deepspeed ...`: the DeepSpeed settings come from the launcher flags, not from this file."""

import argparse
import json
import os

import torch
from accelerate import Accelerator, PartialState


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args()
    # CPU-only machines: accelerate only forms a multi-process gloo group with cpu=True, and only
    # picks DeepSpeed with cpu=False (transformers' Trainer does the same two steps with --use_cpu).
    PartialState(cpu=True)
    accelerator = Accelerator()
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(9)
    x, y = torch.randn(64, 8, generator=generator), torch.randn(64, 1, generator=generator)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for inputs, targets in loader:
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(accelerator.gather(loss.detach()).mean().item())
    accelerator.wait_for_everyone()
    accelerator.save_model(model, args.output_dir)  # ZeRO-2: checkpoint.utils.clone_tensors_for_torch_save
    if accelerator.is_main_process:
        with open(os.path.join(args.output_dir, "result.json"), "w") as handle:
            json.dump({"losses": losses, "engine": type(model).__module__ + "." + type(model).__name__}, handle)


if __name__ == "__main__":
    main()
