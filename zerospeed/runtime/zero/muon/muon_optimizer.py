"""`MuonWithAuxAdam`: Muon for the groups marked `use_muon`, AdamW for the others (DeepSpeed's
class name and import path, `deepspeed.runtime.zero.muon.muon_optimizer.MuonWithAuxAdam`).

The update is [Note: Muon's update] in newton_schulz.py. The optimizer steps whatever tensors its
groups hold: whole parameters (stage 0, or single-process use) or flat ZeRO partitions (stages
1-3). Momentum and the Adam moments are elementwise, so they live with those tensors and are
checkpointed and resharded like Adam's. Newton-Schulz is not elementwise: for a flat partition the
ZeRO wrapper registers an orthogonalizer (`set_orthogonalizer`, owner_exchange.py) that rebuilds
each whole matrix on its owner rank; at stage 0 the wrapper registers one per param group
(`set_group_orthogonalizer`): each rank orthogonalizes the matrices it owns and one all-reduce
shares the results. A Muon tensor with no orthogonalizer must be a whole matrix
(>= 2 dims) and is orthogonalized in place; a 1-D one is an error, never a silent SGD step
(DeepSpeed's DS#8441).

Group defaults are DeepSpeed's: Muon lr 0.02, momentum 0.95, weight_decay 0, ns_method "gram";
Adam lr 3e-4, betas (0.9, 0.95), eps 1e-10, weight_decay 0. zerospeed adds `ns_steps` (5) and
`nesterov` (True), the values DeepSpeed always uses. `adam_w_mode=False` makes the Adam half's
weight decay an L2 term added to the gradient, as DeepSpeed's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from zerospeed.runtime.zero.muon.newton_schulz import NS_METHODS, orthogonalize

__all__ = ["ADAM_DEFAULTS", "MUON_DEFAULTS", "GroupOrthogonalizer", "MuonWithAuxAdam", "Orthogonalizer"]

MUON_DEFAULTS: dict[str, Any] = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0, "ns_method": "gram",
                                 "ns_steps": 5, "nesterov": True}
ADAM_DEFAULTS: dict[str, Any] = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}

Orthogonalizer = Callable[[torch.Tensor, int, str], torch.Tensor]
"""(this rank's flat U, ns_steps, ns_method) -> this rank's flat O, float32."""
GroupOrthogonalizer = Callable[[list[torch.Tensor], int, str], list[torch.Tensor]]
"""(every whole U of a param group, ns_steps, ns_method) -> their O, float32."""


class MuonWithAuxAdam(torch.optim.Optimizer):
    def __init__(self, param_groups: Iterable[dict[str, Any]], adam_w_mode: bool = True) -> None:
        groups = [_with_defaults(dict(group), index) for index, group in enumerate(param_groups)]
        super().__init__(groups, {})
        self.adam_w_mode = bool(adam_w_mode)
        self._orthogonalizers: dict[int, Orthogonalizer] = {}
        self._group_orthogonalizers: dict[int, GroupOrthogonalizer] = {}
        self.num_local_orthogonalized = 0   # whole matrices orthogonalized without an orthogonalizer

    def set_orthogonalizer(self, tensor: torch.Tensor, orthogonalizer: Orthogonalizer) -> None:
        """Route `tensor`'s (a flat partition's) Newton-Schulz step through `orthogonalizer`."""
        self._orthogonalizers[id(tensor)] = orthogonalizer

    def needs_whole_partitions(self, group: dict[str, Any]) -> bool:
        """Whether ZeRO-Offload must step `group`'s partitions whole ([Note: whole-partition units]
        in offload/offload_states.py): a Muon group's orthogonalizer exchanges a whole partition."""
        return bool(group.get("use_muon", False))

    def swap_state_names(self, group: dict[str, Any]) -> tuple[str, ...]:
        """The state tensors of one of `group`'s params, each shaped like it, that ZeRO-Offload's NVMe
        files hold after its master ([Note: unit files] in offload/unit_files.py)."""
        return ("momentum_buffer",) if group["use_muon"] else ("exp_avg", "exp_avg_sq")

    def initial_scalar_state(self, group: dict[str, Any]) -> dict[str, Any]:
        """The rest of such a param's state before its first step, beside its zero state tensors:
        the step counts of the AdamW half, as `_adam_group_step` creates them."""
        return {} if group["use_muon"] else {"step": torch.tensor(0.0)}

    @property
    def newton_schulz_calls(self) -> int:
        """Matrices this rank has orthogonalized so far (evidence Muon ran, not SGD)."""
        routes = [*self._orthogonalizers.values(), *self._group_orthogonalizers.values()]
        owned = sum(getattr(o, "num_orthogonalized", 0) for o in routes)
        return self.num_local_orthogonalized + owned

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            if group["use_muon"]:
                self._muon_group_step(index, group)
            else:
                self._adam_group_step(group)
        return loss

    def set_group_orthogonalizer(self, group_index: int, orthogonalizer: GroupOrthogonalizer) -> None:
        """Route param group `group_index`'s whole matrices through one call (stage 0's owners)."""
        self._group_orthogonalizers[group_index] = orthogonalizer

    def _muon_group_step(self, group_index: int, group: dict[str, Any]) -> None:
        beta = group["momentum"]
        updates = []
        for param in group["params"]:
            # A partition takes part in its owners' exchange even without a gradient (zeros).
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(param)
            buf = state["momentum_buffer"]
            buf.lerp_(grad, 1 - beta)
            updates.append(grad.lerp(buf, beta) if group["nesterov"] else buf)
        steps, method = group["ns_steps"], group["ns_method"]
        by_group = self._group_orthogonalizers.get(group_index)
        orthos = by_group(updates, steps, method) if by_group is not None else \
            [self._orthogonalize(p, u, steps, method) for p, u in zip(group["params"], updates)]
        for param, ortho in zip(group["params"], orthos):
            if group["weight_decay"]:   # a pass over the parameter that is a no-op (x 1.0) without decay
                param.mul_(1 - group["lr"] * group["weight_decay"])
            param.add_(ortho.view_as(param).to(param.dtype), alpha=-group["lr"])

    def _orthogonalize(self, param: torch.Tensor, update: torch.Tensor, steps: int, method: str) -> torch.Tensor:
        orthogonalizer = self._orthogonalizers.get(id(param))
        if orthogonalizer is not None:
            return orthogonalizer(update.reshape(-1), steps, method)
        if param.dim() < 2:
            raise RuntimeError(f"Muon param group holds a tensor of shape {tuple(param.shape)} with no "
                               "owner layout: a flat partition whose ZeRO wrapper did not register its "
                               "matrices, or a 1-D parameter marked use_muon. Refusing to step it as SGD.")
        self.num_local_orthogonalized += 1
        return orthogonalize(update, tuple(param.shape), steps, method, getattr(param, "muon_head_dim", None))

    def _adam_group_step(self, group: dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
        lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
        for param in group["params"]:
            if param.grad is None:
                continue
            grad = param.grad
            if not self.adam_w_mode and decay:
                grad = grad.add(param, alpha=decay)
            state = self.state[param]
            if "step" not in state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(param)
                state["exp_avg_sq"] = torch.zeros_like(param)
            state["step"] += 1
            step = float(state["step"])
            state["exp_avg"].lerp_(grad, 1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)   # torch's order
            if self.adam_w_mode:
                param.mul_(1 - lr * decay)
            param.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1 ** step))


def _with_defaults(group: dict[str, Any], index: int) -> dict[str, Any]:
    if "use_muon" not in group:
        raise ValueError(f"MuonWithAuxAdam param group {index} has no 'use_muon' key: each group must say "
                         "whether Muon (True) or AdamW (False) steps it")
    group["use_muon"] = bool(group["use_muon"])
    defaults = MUON_DEFAULTS if group["use_muon"] else ADAM_DEFAULTS
    for key, value in defaults.items():
        group.setdefault(key, value)
    if group["use_muon"] and group["ns_method"] not in NS_METHODS:
        raise ValueError(f"ns_method must be one of {NS_METHODS}, got {group['ns_method']!r}")
    if group["use_muon"] and (not isinstance(group["ns_steps"], int) or group["ns_steps"] < 1):
        raise ValueError(f"ns_steps must be a positive integer, got {group['ns_steps']!r}")
    if not group["use_muon"]:
        group["betas"] = tuple(group["betas"])
    return group
