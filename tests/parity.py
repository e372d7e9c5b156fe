"""Parity helpers: the same model, data and optimizer run by plain single-process PyTorch.

A distributed test trains through zerospeed on W ranks with micro-batch m and accumulation g; the
reference trains one process on the whole global batch (m * g * W rows) per step. With a mean
loss the two gradients are equal, so losses and parameters must agree to rounding.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

IN_FEATURES, HIDDEN, OUT_FEATURES = 8, 16, 4


class TinyMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(IN_FEATURES, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, OUT_FEATURES)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.fc2(torch.tanh(self.fc1(x))))
        return torch.nn.functional.mse_loss(self.head(hidden), y)


def make_model(seed: int = 0) -> TinyMLP:
    torch.manual_seed(seed)
    return TinyMLP()


def global_batches(num_steps: int, global_batch: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(global_batch, IN_FEATURES, generator=generator),
             torch.randn(global_batch, OUT_FEATURES, generator=generator)) for _ in range(num_steps)]


def micro_batch(batch: tuple[torch.Tensor, torch.Tensor], micro_step: int, rank: int, micro_size: int,
                world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the global batch that rank `rank` sees at accumulation micro-step `micro_step`."""
    start = (micro_step * world_size + rank) * micro_size
    return batch[0][start:start + micro_size], batch[1][start:start + micro_size]


def torch_optimizer(kind: str, params: Any, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    if kind == "AdamW":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if kind == "Adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if kind == "SGD":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay)
    raise ValueError(kind)


def ds_optimizer_block(kind: str, lr: float, weight_decay: float) -> dict[str, Any]:
    """The ds_config `optimizer` block that must build the same optimizer as `torch_optimizer`."""
    if kind == "AdamW":
        return {"type": "AdamW", "params": {"lr": lr, "weight_decay": weight_decay}}
    if kind == "Adam":  # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false
        return {"type": "Adam", "params": {"lr": lr, "weight_decay": weight_decay, "adam_w_mode": False}}
    if kind == "SGD":
        return {"type": "SGD", "params": {"lr": lr, "momentum": 0.9, "weight_decay": weight_decay}}
    raise ValueError(kind)


def reference_run(model: torch.nn.Module, batches: list, kind: str, lr: float, weight_decay: float,
                  clip: float) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = copy.deepcopy(model)
    optimizer = torch_optimizer(kind, model.parameters(), lr, weight_decay)
    losses = []
    for x, y in batches:
        loss = model(x, y)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_close_relative(actual: torch.Tensor, expected: torch.Tensor, rtol: float, name: str = "") -> None:
    scale = expected.abs().max().clamp_min(1e-12)
    error = (actual.float() - expected.float()).abs().max() / scale
    assert error <= rtol, f"{name}: relative error {error:.3e} > {rtol:.1e}"
