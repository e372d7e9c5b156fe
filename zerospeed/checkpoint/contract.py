"""What checkpoint save and load ask of an optimizer: the checkpoint half of the contract.

[Note: checkpoint contract]
`checkpoint/` and the engine's save / load never ask which ZeRO stage runs; they ask the optimizer
(a `DeepSpeedOptimizer`, which inherits this class, or `NoOptimizer` when the engine has none):

* `checkpoint_files(dp_rank, mp_rank)`: the files this rank writes. The model-states file is
  shared (dp rank 0 writes it) unless the module holds partitions only (ZeRO-3: one per dp rank);
  the optim-states file exists where the optimizer state is partitioned (ZeRO 1-3), else the
  state goes into the model-states file's `optimizer` entry (`model_file_optimizer_state`).
* `checkpoint_layout()`: the `zero_stage` those files record and how many ranks they split the
  state over. A saved directory of the same layout holds exactly this rank's state; any other is
  resharded through the full representation ([Note: full layout] in checkpoint/full_state.py)
  into `load_full_state`.
* `weights_in_optimizer_files`: the module holds partitions only, so the weights are saved in,
  and load from, the fp32 masters of the optim files (ZeRO-3).
* `frozen_param_records`, `param_shapes`, `replicated_state`, `gathered_parameters`: what the
  model-states file records, how a replicated (stage-0) entry is named, how full weights are reached.

Which `zero_stage` a *saved* directory has is data read from its files (`SavedLayout`), and may be
compared with `checkpoint_layout()`; the live stage is never asked.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from zerospeed.checkpoint.layout import model_states_name

if TYPE_CHECKING:
    from zerospeed.checkpoint.full_state import FullOptimizerState

__all__ = ["CheckpointFiles", "CheckpointLayout", "FrozenParamRecords", "NoOptimizer", "OptimizerCheckpointing",
           "ReplicatedState", "frozen_param_records"]

FrozenParamRecords = tuple["OrderedDict[str, torch.Size]", dict[str, torch.Tensor]]
"""(name -> full shape, name -> this rank's data) of the parameters outside the optimizer."""


@dataclasses.dataclass(frozen=True)
class CheckpointFiles:
    """The files of one tag directory a rank writes (names inside the tag directory)."""

    model_states: str | None
    """None: another data-parallel rank writes the shared model-states file."""
    optim_states: str | None
    """None: the optimizer state is replicated and lives in the model-states file."""


@dataclasses.dataclass(frozen=True)
class CheckpointLayout:
    """How an optimizer's state is laid out in checkpoint files: the `zero_stage` they record and
    over how many data-parallel ranks the state is split (1 when it is replicated)."""

    zero_stage: int
    partitions: int


@dataclasses.dataclass(frozen=True)
class ReplicatedState:
    """A base optimizer that steps one tensor per model parameter (the parameter, or its fp32
    master): its params per group, their names and trainable flags (the key from torch's indexed
    state to names), whether the masters are separate fp32 copies (the saved entry then carries
    `fp32_groups`) and the clip value."""

    params: list[list[torch.Tensor]]
    names: list[list[str]]
    trainable: list[list[bool]]
    fp32_masters: bool
    clip_grad: float


class OptimizerCheckpointing(abc.ABC):
    """[Note: checkpoint contract]. The defaults describe replicated state (nothing partitioned)."""

    weights_in_optimizer_files: bool = False
    """The module's parameters are partition placeholders: weights are saved in, and restored from,
    the fp32 masters of the optim files."""

    def checkpoint_files(self, dp_rank: int, mp_rank: int) -> CheckpointFiles:
        return CheckpointFiles(model_states_name(0, mp_rank=mp_rank) if dp_rank == 0 else None, None)

    @abc.abstractmethod
    def checkpoint_layout(self) -> CheckpointLayout: ...

    def model_file_optimizer_state(self, param_names: dict[torch.nn.Parameter, str]) -> dict[str, Any] | None:
        """This optimizer's state for the model-states file's `optimizer` entry (in our wrapper
        shape, with `param_names`); None where the state goes to the optim files, or there is none."""
        return None

    def replicated_state(self, param_names: dict[torch.nn.Parameter, str]) -> ReplicatedState | None:
        """How the base optimizer holds replicated state (one tensor per model parameter, stage 0);
        None where it steps flat partitions or there is none."""
        return None

    def param_shapes(self, param_names: dict[torch.nn.Parameter, str]) -> list[dict[str, torch.Size]] | None:
        """Per trainable group, name -> full shape (DeepSpeed's `param_shapes`); None without state."""
        return None

    def frozen_param_records(self, module: torch.nn.Module) -> FrozenParamRecords | None:
        """What the model-states file records of the frozen parameters (ZeRO: their shapes and this
        rank's data, for zero_to_fp32); None where they are in the module state already."""
        return None

    def gathered_parameters(self, params: list[torch.nn.Parameter]) -> contextlib.AbstractContextManager[Any]:
        """A context in which `params` hold their full data (collective where they are partitioned)."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    def load_state_dict(self, state_dict: dict[str, Any], load_optimizer_states: bool = True) -> None: ...

    @abc.abstractmethod
    def load_full_state(self, full: FullOptimizerState, param_names: dict[torch.nn.Parameter, str],
                        load_optimizer_states: bool) -> None:
        """Cut this rank's state from the full representation (a resharded load)."""

    @abc.abstractmethod
    def refresh_fp32_params(self) -> None:
        """Re-derive the fp32 masters from the (just loaded) low-precision weights."""


def frozen_param_records(module: torch.nn.Module) -> FrozenParamRecords:
    """Shapes (full: `ds_shape` when partitioned) and this rank's data (`ds_tensor`) of the
    module's frozen parameters, in `named_parameters` order."""
    frozen = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
    return (OrderedDict((n, getattr(p, "ds_shape", p.shape)) for n, p in frozen),
            {n: getattr(p, "ds_tensor", p).detach().cpu() for n, p in frozen})


class NoOptimizer(OptimizerCheckpointing):
    """The engine without an optimizer (inference): no optimizer state is written or read, and the
    weights of a resharded load go straight into the (trainable) module parameters."""

    def checkpoint_layout(self) -> CheckpointLayout:
        return CheckpointLayout(0, 1)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any], load_optimizer_states: bool = True) -> None:
        pass

    @torch.no_grad()
    def load_full_state(self, full: FullOptimizerState, param_names: dict[torch.nn.Parameter, str],
                        load_optimizer_states: bool) -> None:
        for param, name in param_names.items():
            if name in full.fp32:
                param.copy_(full.fp32[name])

    def refresh_fp32_params(self) -> None:
        pass
