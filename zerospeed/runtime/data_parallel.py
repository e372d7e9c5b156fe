"""Stage 0: replicated parameters, gradients all-reduced in buckets at the accumulation boundary.

The same wrapper serves fp32, fp16 and bf16. In low precision the module holds fp16 / bf16
parameters and the base optimizer holds one fp32 master per trainable parameter (the param
groups are re-pointed at the masters), so the update happens in fp32 and is copied back.
Gradients accumulate across micro-batches in `grad_accum_dtype`, in persistent flat buckets: each
parameter's `.grad` is a view of its slot, into which autograd accumulates, when that dtype is the
model's; else the gradient hook adds each gradient into the slot and clears `.grad` ([Note:
gradients as bucket views] in overlapped_allreduce.py). On the boundary micro-batch the hooks
also start the bucketed all-reduce, in place, while backward runs ([Note: overlapped all-reduce]).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from zerospeed.comm.run_groups import RunGroups
from zerospeed.runtime.base_optimizer import (DeepSpeedOptimizer, StepGradients, optimizer_state_tensors,
                                              tensor_bytes)
from zerospeed.runtime.fp16.loss_scaler import LossScaler
from zerospeed.runtime.expert_gradients import GroupedAllReduce
from zerospeed.runtime.grad_space import GradSpace, Piece
from zerospeed.runtime.grad_utils import scale_
from zerospeed.checkpoint import constants as C
from zerospeed.checkpoint import moe_reshard
from zerospeed.checkpoint.contract import CheckpointLayout, ReplicatedState
from zerospeed.checkpoint.full_state_import import cloned, copy_into_params, require, with_hyperparams, with_loss_scaler
from zerospeed.runtime.precision import PrecisionSettings
from zerospeed.runtime.zero.offload.config import OffloadStateTypeEnum
from zerospeed.runtime.zero.state_offload import StateTensors
from zerospeed.runtime.zero.muon.attach import attach_stage0

if TYPE_CHECKING:
    from zerospeed.checkpoint.full_state import FullOptimizerState


def trainable_params(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    return [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]


class DataParallelOptimizer(DeepSpeedOptimizer):
    """ZeRO stage 0 (plain data parallelism) for fp32, fp16 and bf16. `run_groups`: the run's groups
    ([Note: run groups] in comm/run_groups.py), where expert parameters and AutoTP-split Muon
    matrices find theirs; a model with neither needs none."""

    def __init__(self, init_optimizer: torch.optim.Optimizer, precision: PrecisionSettings,
                 loss_scaler: LossScaler, dp_group: Any, reduce_bucket_size: int,
                 grad_space: GradSpace | None = None, run_groups: RunGroups | None = None) -> None:
        self._lp_params = trainable_params(init_optimizer)
        self._init_base(init_optimizer, loss_scaler, precision,
                        grad_space or GradSpace.data_parallel(dp_group, False, self._lp_params, run_groups))
        self.dp_group = dp_group
        self.run_groups = run_groups
        self.reduce_bucket_size = int(reduce_bucket_size)
        self._masters = self._init_fp32_masters() if precision.low_precision else self._lp_params
        attach_stage0(init_optimizer, dp_group, run_groups)   # Muon's matrix owners; nothing for other optimizers
        # Read by every gradient hook call; fixed here, as the settings are (a frozen dataclass).
        self._separate_accumulation = precision.grad_accum_dtype != precision.param_dtype
        self._reducer = GroupedAllReduce(self._lp_params, reduce_bucket_size, dp_group, precision,
                                         grads_in_params=not self._separate_accumulation, run_groups=run_groups)
        self._window_open = False      # the buckets hold this accumulation window's gradients
        self._reduce_in_backward = False
        self._hook_handles = [param.register_post_accumulate_grad_hook(self._grad_hook(index))
                              for index, param in enumerate(self._lp_params)]

    def destroy(self) -> None:
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []

    def _init_fp32_masters(self) -> list[torch.Tensor]:
        """Replace each trainable param in the optimizer's groups by an fp32 copy (its master)."""
        master_of: dict[int, torch.nn.Parameter] = {}
        for group in self.optimizer.param_groups:
            group["params"] = [self._master(p, master_of) if p.requires_grad else p for p in group["params"]]
        return [master_of[id(p)] for p in self._lp_params]

    @staticmethod
    def _master(param: torch.nn.Parameter, master_of: dict[int, torch.nn.Parameter]) -> torch.nn.Parameter:
        master = torch.nn.Parameter(param.detach().clone().float())
        master_of[id(param)] = master
        return master

    def trainable_param_groups(self) -> list[list[torch.nn.Parameter]]:
        # The base optimizer's groups hold the fp32 masters (the params themselves in fp32).
        param_of = {id(master): param for param, master in zip(self._lp_params, self._masters)}
        return [[param_of[id(p)] for p in group["params"] if id(p) in param_of]
                for group in self.optimizer.param_groups]

    def params_and_masters(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """(trainable param, its fp32 master) pairs in optimizer order; the same tensor twice in fp32."""
        return list(zip(self._lp_params, self._masters))

    def offloadable_state_tensors(self) -> StateTensors:
        """Every tensor object holding each state ([Note: storage relocation] in zero/state_offload.py)."""
        # the buckets, their views (the `.grad`s in most cases) and any gradient outside them
        grads = self._reducer.grad_buffers() + [p.grad for p in self._lp_params if p.grad is not None]
        return {OffloadStateTypeEnum.lp_params: list(self._lp_params),
                OffloadStateTypeEnum.hp_params: list(self._masters),   # in fp32 the params themselves
                OffloadStateTypeEnum.lp_grads: grads,
                OffloadStateTypeEnum.optim_states: optimizer_state_tensors(self.optimizer),
                OffloadStateTypeEnum.contiguous_grad_buffer: [b for r in self._reducer.reducers for b in r.flat_buffers()]}

    # --- gradients ----------------------------------------------------------------------------
    def prepare_backward(self, will_reduce: bool) -> None:
        self._open_window()
        self._reduce_in_backward = will_reduce

    def _open_window(self) -> None:
        """Zero the buckets and attach the views once per accumulation window (its first backward)."""
        if not self._window_open:
            self._reducer.start_window()
            self._window_open = True

    def _grad_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        # [Note: gradients as bucket views]: autograd has accumulated into the bucket; the hook
        # only counts. Bound here so that a call is one closure and one method.
        reducer, local = self._reducer.slot(index)

        def on_grad_ready(param: torch.Tensor) -> None:
            if self._reduce_in_backward:
                reducer.mark_ready(local)

        def on_grad_to_accumulate(param: torch.Tensor) -> None:
            self._move_grad_to_accumulator(index, param)
            if self._reduce_in_backward:
                reducer.mark_ready(local)

        return on_grad_to_accumulate if self._separate_accumulation else on_grad_ready

    def backward_epilogue(self, is_boundary: bool) -> None:
        if is_boundary:
            self._reducer.finish()
        self._reduce_in_backward = False

    @torch.no_grad()
    def _move_grad_to_accumulator(self, index: int, param: torch.Tensor) -> None:
        assert param.grad is not None, "the hook runs for a parameter whose gradient was just produced"
        self._open_window()   # a backward outside engine.backward
        # upcast exactly, then one add in the accumulation dtype (into zeros on the first micro-batch)
        self._reducer.view(index).add_(param.grad)
        param.grad = None

    def gradient_views(self) -> list[torch.Tensor]:
        """Each trainable parameter's slot in its bucket, where its gradient accumulates (and is
        reduced) in `grad_accum_dtype`."""
        return [self._reducer.view(index) for index in range(len(self._lp_params))]

    def _gradient(self, index: int) -> torch.Tensor:
        """The accumulated gradient of trainable param `index` (zeros where none was produced)."""
        if self._separate_accumulation:
            return self._reducer.view(index)
        param = self._lp_params[index]
        if param.grad is None:   # cleared by the user after backward: zeros, in its slot
            view = self._reducer.view(index)
            view.zero_()
            param.grad = view
        return param.grad

    def _gradients(self) -> list[torch.Tensor]:
        self._open_window()   # a step with no backward in this window: zero gradients
        return [self._gradient(index) for index in range(len(self._lp_params))]

    # --- the step ([Note: one step] in base_optimizer.py) -------------------------------------------
    def _step_gradients(self) -> StepGradients:
        return StepGradients(self._gradients())

    def _norm_pieces(self, grads: StepGradients) -> list[Piece]:
        # Whole gradients, each in its parameter's part (expert group, tp-split or not).
        return [(grad, self.grad_space.part_of(param)) for param, grad in zip(self._lp_params, grads.tensors)]

    def _apply_update(self, grads: list[torch.Tensor], multiplier: float) -> None:
        for master, grad in zip(self._masters, grads):
            master.grad = grad if grad.dtype == torch.float32 else grad.float()
        scale_([m.grad for m in self._masters if m.grad is not None], multiplier)   # every master's, set above
        self.optimizer.step()
        if self.precision.low_precision:
            self._copy_masters_to_params()

    @torch.no_grad()
    def _copy_masters_to_params(self) -> None:
        for param, master in zip(self._lp_params, self._masters):
            param.copy_(master)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self._lp_params:
            param.grad = None
        for master in self._masters:
            master.grad = None
        # The buckets keep their memory; the next window's first backward zeroes them and points
        # the `.grad`s at them again, so between steps `.grad` is None, as before.
        self._window_open = False

    # --- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "optimizer_state_dict": self.optimizer.state_dict(),
            "loss_scaler": self.loss_scaler.state_dict(),
            "dynamic_loss_scale": self.loss_scaler.dynamic,
            "overflow": self.overflow,
            "clip_grad": self.clip_grad,
        }
        if self.precision.low_precision:
            state["fp32_groups"] = [m.detach().clone() for m in self._masters]
        return state

    def load_state_dict(self, state_dict: dict[str, Any], load_optimizer_states: bool = True) -> None:
        if load_optimizer_states:
            self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        self.loss_scaler.load_state_dict(state_dict["loss_scaler"])
        self.overflow = bool(state_dict.get("overflow", False))
        if self.precision.low_precision and "fp32_groups" in state_dict:
            with torch.no_grad():
                for master, saved in zip(self._masters, state_dict["fp32_groups"]):
                    master.copy_(saved)
            self._copy_masters_to_params()

    # --- checkpoints ([Note: checkpoint contract]): replicated state, in the model-states file ------
    def checkpoint_layout(self) -> CheckpointLayout:
        return CheckpointLayout(zero_stage=0, partitions=1)

    def replicated_state(self, param_names: dict[torch.nn.Parameter, str]) -> ReplicatedState:
        """The base optimizer's groups hold one tensor per model parameter: the trainable ones' masters
        (the params themselves in fp32) and the frozen params, each named by its model parameter."""
        name_of = {id(master): param_names[param] for param, master in self.params_and_masters()}
        name_of.update({id(p): n for p, n in param_names.items()})
        groups = [list(g["params"]) for g in self.optimizer.param_groups]
        return ReplicatedState(params=groups, names=[[name_of[id(p)] for p in g] for g in groups],
                               trainable=[[p.requires_grad for p in g] for g in groups],
                               fp32_masters=self.precision.low_precision, clip_grad=self.clip_grad)

    def model_file_optimizer_state(self, param_names: dict[torch.nn.Parameter, str]) -> dict[str, Any]:
        state = self.state_dict()
        replicated = self.replicated_state(param_names)
        state["param_names"], state["trainable"] = replicated.names, replicated.trainable
        return state

    def load_full_state(self, full: FullOptimizerState, param_names: dict[torch.nn.Parameter, str],
                        load_optimizer_states: bool) -> None:
        """One tensor per parameter ([Note: full layout]): each trainable parameter's master and
        moments under its name, experts under their global id (moe_reshard.py)."""
        current = with_loss_scaler(self.state_dict(), full)
        torch_state = current[C.OPTIMIZER_STATE_DICT]
        replicated = self.replicated_state(param_names)
        full_names = moe_reshard.full_state_names(param_names, self.run_groups)
        state: dict[int, dict[str, Any]] = {}
        masters: list[torch.Tensor] = []
        for group, group_names, group_trainable in zip(torch_state["param_groups"], replicated.names,
                                                       replicated.trainable):
            for index, local_name, is_trainable in zip(group["params"], group_names, group_trainable):
                if not is_trainable:
                    continue
                name = full_names.get(local_name, local_name)
                masters.append(require(full.fp32, name).clone())
                if name in full.moments:
                    # one tensor per param: torch's Adam increments `step` in place
                    state[index] = {**cloned(full.scalars.get(name, {})),
                                    **{k: v.clone() for k, v in full.moments[name].items()}}
        torch_state["state"] = state
        torch_state["param_groups"] = with_hyperparams(torch_state["param_groups"], full)
        if "fp32_groups" in current:
            current["fp32_groups"] = masters
        else:
            copy_into_params(param_names, full_names, full)
        self.load_state_dict(current, load_optimizer_states=load_optimizer_states)

    def refresh_fp32_params(self) -> None:
        """Re-derive the fp32 masters from the (just loaded) low-precision module weights."""
        if self.precision.low_precision:
            with torch.no_grad():
                for master, param in zip(self._masters, self._lp_params):
                    master.copy_(param)

    def memory_breakdown(self) -> dict[str, int]:
        grads = [p.grad for p in self._lp_params] + self._reducer.grad_buffers()
        breakdown = {
            "lp_params": tensor_bytes(self._lp_params),
            "grads": tensor_bytes([g for g in grads if g is not None]),
            "master_params": tensor_bytes(self._masters) if self.precision.low_precision else 0,
            "optimizer_states": tensor_bytes(optimizer_state_tensors(self.optimizer)),
        }
        breakdown["total"] = sum(breakdown.values())
        return breakdown

