"""Newton-Schulz on the matrices a data-parallel owner holds, whole or split over tensor-parallel ranks.

[Note: Muon with AutoTP]
AutoTP cuts a matrix into `tp_size` shards (TPShard: along `dim`, each of `fused_parts` parts cut
into equal pieces), and ZeRO then partitions each tp rank's shard over the data-parallel group.
The data-parallel owner exchange (owner_exchange.py) rebuilds the *shard* on its dp owner. The
owner plan depends only on the shards' shapes, which are the same on every tp rank, so the dp
owners of one matrix's shards are the ranks with the same dp rank: exactly one tensor-parallel
group. That group finishes the job (`TensorParallelMatrices`): each tp rank sends its shard to
the matrix's tp owner (one all-to-all), the owner joins the shards into the whole matrix,
orthogonalizes it and cuts the result the same way, and the pieces go back (a second
all-to-all). Newton-Schulz on a shard is not Newton-Schulz on the matrix (DeepSpeed 0.19.8 runs
it per shard); this is the single-process step.

Matrices AutoTP left whole (replicated on the tp ranks, with equal gradients: [Note:
tensor-parallel autograd]) are orthogonalized by each tp rank, giving the same result on all.
Without AutoTP `LocalMatrices` orthogonalizes every matrix in place. A matrix tagged for per-head
Muon is orthogonalized head by head after the join ([Note: per-head Muon] in per_head.py). Every tp rank calls the
exchange with the same matrix indices (the same plan), so the collectives match.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from zerospeed import comm
from zerospeed.runtime.tensor_parallel.layers import TPShard, shard_of
from zerospeed.runtime.zero.muon.newton_schulz import orthogonalize
from zerospeed.runtime.zero.muon.owner_plan import assign_owners

__all__ = ["LocalMatrices", "MatrixStep", "TensorParallelMatrices", "full_shape", "join_shards", "matrix_step_for"]


class MatrixStep(Protocol):
    """(matrix index -> its flat U as held here, ns_steps, ns_method) -> the same indices' flat O."""

    @property
    def num_orthogonalized(self) -> int: ...

    def __call__(self, updates: dict[int, torch.Tensor], steps: int, method: str) -> dict[int, torch.Tensor]: ...


class LocalMatrices:
    """Every matrix is whole here: Newton-Schulz on each (`head_dims[i]`: matrix i head by head,
    [Note: per-head Muon] in per_head.py)."""

    def __init__(self, shapes: Sequence[tuple[int, ...]], head_dims: Sequence[int | None] | None = None) -> None:
        self.shapes = list(shapes)
        self.head_dims = list(head_dims) if head_dims is not None else [None] * len(self.shapes)
        self.num_orthogonalized = 0

    def __call__(self, updates: dict[int, torch.Tensor], steps: int, method: str) -> dict[int, torch.Tensor]:
        self.num_orthogonalized += len(updates)
        return {index: orthogonalize(update, self.shapes[index], steps, method, self.head_dims[index])
                for index, update in updates.items()}


def full_shape(shard_shape: tuple[int, ...], shard: TPShard) -> tuple[int, ...]:
    shape = list(shard_shape)
    shape[shard.dim] *= shard.tp_size
    return tuple(shape)


def join_shards(pieces: Sequence[torch.Tensor], shard: TPShard) -> torch.Tensor:
    """The whole matrix from every tp rank's shard (in tp rank order); the inverse of `shard_of`."""
    per_rank = [piece.chunk(shard.fused_parts, dim=shard.dim) for piece in pieces]
    parts = [torch.cat([chunks[part] for chunks in per_rank], dim=shard.dim) for part in range(shard.fused_parts)]
    return torch.cat(parts, dim=shard.dim)


class TensorParallelMatrices:
    """[Note: Muon with AutoTP]: `shards[i]` is matrix i's TPShard (None: whole on every tp rank),
    `shapes[i]` this rank's (shard) shape."""

    def __init__(self, shapes: Sequence[tuple[int, ...]], shards: Sequence[TPShard | None], tp_group: Any,
                 head_dims: Sequence[int | None] | None = None) -> None:
        self.shapes, self.shards, self.group = list(shapes), list(shards), tp_group
        self.head_dims = list(head_dims) if head_dims is not None else [None] * len(self.shapes)
        self.tp_size, self.tp_rank = comm.get_world_size(tp_group), comm.get_rank(tp_group)
        for index, shard in enumerate(self.shards):
            if shard is not None and (shard.tp_size, shard.tp_rank) != (self.tp_size, self.tp_rank):
                raise ValueError(f"Muon matrix {index} is split over {shard.tp_size} tensor-parallel ranks (this one "
                                 f"{shard.tp_rank}) but the tensor-parallel group has {self.tp_size} (this rank "
                                 f"{self.tp_rank})")
        self.local = LocalMatrices(self.shapes, self.head_dims)
        self.num_joined = 0   # whole split matrices this rank orthogonalized

    @property
    def num_orthogonalized(self) -> int:
        return self.local.num_orthogonalized + self.num_joined

    def __call__(self, updates: dict[int, torch.Tensor], steps: int, method: str) -> dict[int, torch.Tensor]:
        split = sorted(index for index in updates if self.shards[index] is not None)
        results = self.local({i: u for i, u in updates.items() if self.shards[i] is None}, steps, method)
        if split:
            results.update(self._split_step({i: updates[i] for i in split}, steps, method))
        return results

    def _split_step(self, updates: dict[int, torch.Tensor], steps: int, method: str) -> dict[int, torch.Tensor]:
        order = list(updates)
        whole = [full_shape(self.shapes[i], self._shard(i)) for i in order]
        owners = dict(zip(order, assign_owners(whole, self.tp_size)))
        mine = [i for i in order if owners[i] == self.tp_rank]
        numel = {i: math.prod(self.shapes[i]) for i in order}
        device = next(iter(updates.values())).device
        # Out: my shard of each matrix to its owner; in: every rank's shard of the ones I own.
        outgoing = _cat([updates[i].reshape(-1).to(torch.float32) for r in range(self.tp_size)
                         for i in order if owners[i] == r], device)
        to_owner = [sum(numel[i] for i in order if owners[i] == r) for r in range(self.tp_size)]
        mine_numel = sum(numel[i] for i in mine)
        incoming = self._all_to_all(outgoing, [mine_numel] * self.tp_size, to_owner)
        shards_of = _split_by_rank(incoming, [numel[i] for i in mine], self.tp_size)
        returning = []
        for k, index in enumerate(mine):
            shard = self._shard(index)
            joined = join_shards([pieces[k].view(self.shapes[index]) for pieces in shards_of], shard)
            ortho = orthogonalize(joined, tuple(joined.shape), steps, method, self.head_dims[index]).view(joined.shape)
            returning.append([shard_of(ortho, TPShard(shard.dim, shard.fused_parts, self.tp_size, r)).reshape(-1)
                              for r in range(self.tp_size)])
        self.num_joined += len(mine)
        back_out = _cat([piece for r in range(self.tp_size) for piece in (row[r] for row in returning)], device)
        back = self._all_to_all(back_out, to_owner, [mine_numel] * self.tp_size)
        results, offset = {}, 0
        for r in range(self.tp_size):
            for index in (i for i in order if owners[i] == r):
                results[index] = back.narrow(0, offset, numel[index])
                offset += numel[index]
        return results

    def _shard(self, index: int) -> TPShard:
        shard = self.shards[index]
        assert shard is not None
        return shard

    def _all_to_all(self, outgoing: torch.Tensor, receive_numels: list[int], send_numels: list[int]) -> torch.Tensor:
        incoming = torch.empty(sum(receive_numels), dtype=outgoing.dtype, device=outgoing.device)
        comm.all_to_all_single(incoming, outgoing, receive_numels, send_numels, group=self.group)
        return incoming


def _cat(parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.float32, device=device)


def _split_by_rank(incoming: torch.Tensor, numels: list[int], tp_size: int) -> list[list[torch.Tensor]]:
    """Rank r's block holds its shards of my matrices in order: [rank][k] -> flat shard."""
    per_rank = sum(numels)
    return [list(incoming.narrow(0, r * per_rank, per_rank).split(numels)) for r in range(tp_size)]


def matrix_step_for(params: Sequence[torch.Tensor], shapes: Sequence[tuple[int, ...]], tp_group: Any) -> MatrixStep:
    """The matrix step for `params` (whose layer shapes are `shapes`): tensor-parallel over
    `tp_group` (the run's, which AutoTP split them over) when AutoTP split any of them ([Note: Muon
    with AutoTP]), else local."""
    shards = [getattr(p, "ds_tp_shard", None) for p in params]
    head_dims = [getattr(p, "muon_head_dim", None) for p in params]   # [Note: per-head Muon]
    if all(shard is None for shard in shards):
        return LocalMatrices(shapes, head_dims)
    if tp_group is None:
        raise ValueError("Muon: parameters split by AutoTP need the run's tensor-parallel group; build the optimizer "
                         "through zerospeed.initialize, which hands it over")
    return TensorParallelMatrices(shapes, shards, tp_group, head_dims)
