"""A small model with every kind of parameter Muon's rules sort, and an independent reference.

The reference steps full parameters one at a time, in one process, in float64 for Newton-Schulz
(the plain quintic iteration, none of zerospeed's code): Muon for the hidden matrices, torch's own
AdamW for the rest. A run under ZeRO on W ranks must land on the same parameters.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch

VOCAB, HIDDEN, FFN = 32, 24, 40


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(VOCAB, HIDDEN)
        self.q_proj = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)      # square
        self.up = torch.nn.Linear(HIDDEN, FFN)                         # tall, with a bias
        self.down = torch.nn.Linear(FFN, HIDDEN, bias=False)           # wide
        self.odd = torch.nn.Linear(13, 7, bias=False)                  # sizes that straddle partitions
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(tokens)
        h = h + self.q_proj(h)
        h = h + self.down(torch.nn.functional.gelu(self.up(h)))
        h = h + torch.nn.functional.pad(self.odd(h[..., :13]), (0, HIDDEN - 7))
        logits = self.lm_head(self.norm(h))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


MUON_NAMES = ("q_proj.weight", "up.weight", "down.weight", "odd.weight")


def make_model(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM()


def batches(num_steps: int, global_batch: int, seed: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (global_batch, 6), generator=generator),
             torch.randint(0, VOCAB, (global_batch, 6), generator=generator)) for _ in range(num_steps)]


def config(stage: int, micro: int, params: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "Muon", "params": params},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 64, "allgather_bucket_size": 64,
                                  "stage3_param_persistence_threshold": 0, "sub_group_size": 700},
            **extra}


def _newton_schulz64(update: torch.Tensor, steps: int) -> torch.Tensor:
    a, b, c = 3.4445, -4.7750, 2.0315
    x = update.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if tall else x).float()


def _orthogonal_update(blended: torch.Tensor, head_dim: int | None) -> torch.Tensor:
    """The whole matrix, or (per-head Muon) each block of `head_dim` rows on its own, one by one."""
    blocks = [blended] if head_dim is None else list(blended.split(head_dim, dim=0))
    out = []
    for block in blocks:
        rows, cols = block.shape
        out.append(_newton_schulz64(block, 5) * math.sqrt(max(1.0, rows / cols)))
    return torch.cat(out, dim=0)


def reference_run(model: torch.nn.Module, data: list, muon: dict[str, float], adam: dict[str, Any],
                  clip: float = 0.0, muon_names: tuple[str, ...] = MUON_NAMES,
                  loss_of: Any = None, head_dims: dict[str, int] | None = None) -> tuple[list[float], dict]:
    """Single-process Muon (full matrices) + torch AdamW on the whole global batch per step;
    `loss_of(model, batch)` (default `model(*batch)`); `head_dims[name]`: that matrix is
    orthogonalized in blocks of so many rows (per-head Muon)."""
    head_dims = head_dims or {}
    model = copy.deepcopy(model)
    named = dict(model.named_parameters())
    adam_params = [p for n, p in named.items() if n not in muon_names]
    adamw = torch.optim.AdamW(adam_params, lr=adam["lr"], betas=adam["betas"], eps=adam["eps"],
                              weight_decay=adam["weight_decay"])
    buffers = {n: torch.zeros_like(named[n]) for n in muon_names}
    losses = []
    for batch in data:
        loss = model(*batch) if loss_of is None else loss_of(model, batch)
        loss.backward()
        losses.append(loss.item())
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        with torch.no_grad():
            for name in muon_names:
                p, beta = named[name], muon["momentum"]
                buffers[name] = beta * buffers[name] + (1 - beta) * p.grad
                blended = (1 - beta) * p.grad + beta * buffers[name]
                ortho = _orthogonal_update(blended, head_dims.get(name))
                p.mul_(1 - muon["lr"] * muon["weight_decay"]).sub_(muon["lr"] * ortho)
        adamw.step()
        model.zero_grad()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_ranks_match_reference(results: list, ref_losses: list[float], ref_params: dict, steps: int) -> None:
    """Every rank's full parameters (`result[1]`) equal the reference's within 1e-5 (fp32 after
    3 steps of Newton-Schulz), the ranks' mean losses (`result[0]`) equal its losses, and each
    Muon matrix was orthogonalized exactly once per step across the ranks (`result[2]`)."""
    for result in results:
        for name, expected in ref_params.items():
            torch.testing.assert_close(result[1][name], expected, rtol=0, atol=1e-5, msg=name)
    world = len(results)
    mean = [sum(r[0][i] for r in results) / world for i in range(steps)]
    torch.testing.assert_close(torch.tensor(mean), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert sum(r[2] for r in results) == steps * len(MUON_NAMES)
