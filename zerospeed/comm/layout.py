"""`ParallelLayout`: the run's sizes on every parallel axis, read once, and the one table of which
axes combine.

A run is laid out on up to five axes: pipeline stages, tensor (AutoTP) shards, Ulysses sequence
shards, expert parallelism (MoE layers) and data parallelism, which takes the ranks left over.
ZeRO stage 3 partitions parameters over the data axis; it is listed beside the axes because two of
the refusals are about it. The layout is pure data (no process group, no torch.distributed call),
built from what `initialize` is given before anything is cut or grouped, so `validate()` refuses
an unsupported combination before the model is touched, and a test reads the table without
processes.

[Note: combination table]
`REFUSED_COMBINATIONS` holds every pair of features that zerospeed does not run together, with the
reason. Every pair not in it is supported. Enabling a combination is deleting its row (and building
its groups into the run's `RunGroups`, `runtime/engine_groups.py`); refusing one is adding a row. The error names what the user gave
for each side (the config key and value, or the mpu), so the message points at what to change.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["Refusal", "REFUSED_COMBINATIONS", "ParallelLayout", "parallel_layout_for_run"]

PIPE, TENSOR, SEQUENCE, EXPERT, ZERO3 = "pipe", "tensor", "sequence", "expert", "zero3"


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Two features zerospeed does not combine, and why."""

    features: frozenset[str]
    reason: str


def _refusal(first: str, second: str, reason: str) -> Refusal:
    return Refusal(frozenset((first, second)), reason)


REFUSED_COMBINATIONS: tuple[Refusal, ...] = (
    _refusal(PIPE, ZERO3, "ZeRO stage 3 is not supported with pipeline parallelism; use zero_optimization.stage "
                          "1 or 2 (zerospeed runs both with a PipelineModule), as DeepSpeed 0.19.8 does"),
    _refusal(TENSOR, SEQUENCE, "DeepSpeed 0.19.8 has no layout combining tensor and Ulysses sequence parallelism "
                               "either (its two meshes are each built over the whole world and would claim the same "
                               "ranks); use one of the two"),
    _refusal(TENSOR, EXPERT, "AutoTP does not shard expert layers, and there is no data x expert x tensor grid; "
                             "train MoE models with expert and data parallelism"),
    _refusal(TENSOR, PIPE, "AutoTP builds its own data x tensor grid and a PipelineModule brings a pipe x data "
                           "grid; there is no pipe x data x tensor grid for AutoTP"),
    _refusal(SEQUENCE, PIPE, "pipeline parallelism with Ulysses sequence parallelism has no combined grid "
                             "(DeepSpeed 0.19.8 neither)"),
)


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """The sizes of one run. `given` says, per enabled feature, what the user gave to enable it
    (a config key and value, or the mpu), for error messages."""

    world_size: int
    pipe: int = 1
    tensor: int = 1
    sequence: int = 1
    expert: int = 1
    has_moe: bool = False
    zero_stage: int = 0
    given: tuple[tuple[str, str], ...] = ()
    expert_sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # `expert_sizes` are the ep sizes of the model's MoE layers, each once, in the order the
        # layers come (the order their groups are created in, the same on every rank); `expert`
        # is the largest. A layout written for the table alone may leave them empty.
        if self.expert_sizes and (not self.has_moe or self.expert != max(self.expert_sizes)
                                  or len(set(self.expert_sizes)) != len(self.expert_sizes)):
            raise ValueError(f"ParallelLayout: expert_sizes {self.expert_sizes} must be distinct, with has_moe "
                             f"and expert their largest (got has_moe={self.has_moe}, expert={self.expert})")

    @property
    def data(self) -> int:
        """Data-parallel replicas: the ranks left after the pipe, tensor and sequence axes."""
        return self.world_size // (self.pipe * self.tensor * self.sequence)

    def enabled(self) -> Iterator[str]:
        """The features this run uses, in the table's vocabulary."""
        sizes = {PIPE: self.pipe, TENSOR: self.tensor, SEQUENCE: self.sequence}
        yield from (name for name, size in sizes.items() if size > 1)
        if self.has_moe:   # MoE layers at any ep_size, 1 included: they need expert groups all the same
            yield EXPERT
        if self.zero_stage >= 3:
            yield ZERO3

    def describe(self, feature: str) -> str:
        return dict(self.given).get(feature, feature)

    def validate(self) -> None:
        """Raise ValueError naming both sides of a refused combination. (Whether each size divides the
        world is checked where its grid is built, with that axis's own message.)"""
        features = set(self.enabled())
        for refusal in REFUSED_COMBINATIONS:
            if refusal.features <= features:
                first, second = sorted(refusal.features, key=_FEATURE_ORDER.index)
                raise ValueError(f"{self.describe(first)} together with {self.describe(second)} is not supported: "
                                 f"{refusal.reason}")


_FEATURE_ORDER = [TENSOR, PIPE, SEQUENCE, EXPERT, ZERO3]


def _positive_int(value: Any) -> int:
    return value if isinstance(value, int) and value > 1 else 1


def parallel_layout_for_run(raw_config: dict[str, Any], world_size: int, *, pipe_stages: int = 1,
                            tensor_size: int = 1, moe_expert_sizes: Sequence[int] = (),
                            mpu_sequence_size: int | None = None) -> ParallelLayout:
    """The layout `initialize` is asked for: sizes from the ds_config (`sequence_parallel_size`,
    `zero_optimization.stage`) and what the caller found on the model and the mpu: pipeline stages,
    the resolved AutoTP size, the ep sizes of its MoE layers in the model's order (empty without
    MoE layers; repeats are dropped), the size of a sequence-parallel mpu's group (None without one)."""
    expert_sizes = tuple(dict.fromkeys(moe_expert_sizes))
    largest = max(expert_sizes) if expert_sizes else None
    given = [(PIPE, f"a PipelineModule with {pipe_stages} stages"),
             (TENSOR, f"tensor_parallel.autotp_size={tensor_size}"),
             (EXPERT, f"MoE layers (largest ep_size {largest})"), (ZERO3, "zero_optimization.stage 3")]
    sequence = _positive_int(raw_config.get("sequence_parallel_size", 1))
    if sequence > 1:
        given.append((SEQUENCE, f"sequence_parallel_size={sequence}"))
        _check_data_parallel_size(raw_config.get("data_parallel_size"), world_size, sequence)
    elif mpu_sequence_size is not None:
        sequence = mpu_sequence_size
        given.append((SEQUENCE, "an mpu with a sequence-parallel group "
                                "(UlyssesSPAttentionHF.register_with_transformers)"))
    zero = raw_config.get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    return ParallelLayout(world_size, pipe=pipe_stages, tensor=tensor_size, sequence=sequence,
                          expert=largest or 1, has_moe=largest is not None,
                          zero_stage=stage if isinstance(stage, int) else 0, given=tuple(given),
                          expert_sizes=expert_sizes)


def _check_data_parallel_size(data_parallel_size: Any, world_size: int, sequence: int) -> None:
    """The ds_config's `data_parallel_size` beside `sequence_parallel_size` must be what is left of
    the world (a size that does not divide the world is reported where its grid is built)."""
    if data_parallel_size is None or world_size % sequence:
        return
    if data_parallel_size != world_size // sequence:
        raise ValueError(f"data_parallel_size={data_parallel_size} but world size {world_size} / "
                         f"sequence_parallel_size {sequence} = {world_size // sequence}")
