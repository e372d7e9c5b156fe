"""Muon's Newton-Schulz step on a partitioned flat buffer: [Note: owner-based Muon] in owner_plan.py.

`OwnerOrthogonalizer(specs, group)` is built once per flat buffer (a ZeRO 1/2 partition, a stage-3
sub-group) by the ZeRO wrapper and registered with the optimizer (muon_optimizer.py). Called with
this rank's flat U, it returns this rank's flat O: pieces to owners (all-to-all), Newton-Schulz on
the owned matrices, pieces back (all-to-all). Elements outside every matrix (padding) come back 0.
A group of one rank runs the same code with the collectives skipped. Newton-Schulz on the owned
matrices goes through a `MatrixStep` (tp_matrices.py): whole matrices here, or with AutoTP each
shard joined over the tensor-parallel group first ([Note: Muon with AutoTP]).
"""

from __future__ import annotations

from typing import Any

import torch

from zerospeed import comm
from zerospeed.runtime.zero.muon.owner_plan import MatrixSpec, Piece, assign_owners, exchange_plan
from zerospeed.runtime.zero.muon.tp_matrices import LocalMatrices, MatrixStep

__all__ = ["OwnerOrthogonalizer", "ReplicatedOrthogonalizer"]

_Route = tuple[tuple[tuple[int, Piece], ...], ...]


class OwnerOrthogonalizer:
    """`matrices` runs Newton-Schulz on the owned matrices (default: whole here; with AutoTP the
    tensor-parallel join of [Note: Muon with AutoTP])."""

    def __init__(self, specs: list[MatrixSpec], group: Any, matrices: MatrixStep | None = None,
                 device: torch.device | None = None) -> None:
        self.specs = specs
        self.device = device   # where the exchange runs (None: the update's own device)
        self.group = group
        self.world_size = comm.get_world_size(group)
        held = [[sum(piece.numel for piece in spec.pieces if piece.rank == rank) for rank in range(self.world_size)]
                for spec in specs]
        self.owners = assign_owners([spec.shape for spec in specs], self.world_size, held)
        self.plan = exchange_plan(specs, self.owners, comm.get_rank(group), self.world_size)
        self.matrices = matrices if matrices is not None else LocalMatrices([spec.shape for spec in specs])

    @property
    def num_orthogonalized(self) -> int:
        """Matrices this rank ran Newton-Schulz on, over its lifetime."""
        return self.matrices.num_orthogonalized

    def __call__(self, update: torch.Tensor, steps: int, method: str) -> torch.Tensor:
        if self.device is not None and update.device != self.device:
            # an offloaded (host) partition: the collectives and Newton-Schulz run on the device
            return self._exchange(update.to(self.device), steps, method).to(update.device)
        return self._exchange(update, steps, method)

    def _exchange(self, update: torch.Tensor, steps: int, method: str) -> torch.Tensor:
        plan = self.plan
        outgoing = _pack(plan.send, update, lambda index, piece: piece.buffer_offset)
        incoming = self._all_to_all(outgoing, plan.receive_numels(), plan.send_numels())
        results = self.matrices(self._assemble(incoming), steps, method)
        returning = _pack_results(plan.receive, results, update.device)
        back = self._all_to_all(returning, plan.send_numels(), plan.receive_numels())
        out = torch.empty(update.numel(), dtype=torch.float32, device=update.device)
        _unpack(plan.send, back, lambda index, piece: out.narrow(0, piece.buffer_offset, piece.numel))
        for start, length in _gaps(plan.send, update.numel()):
            out.narrow(0, start, length).zero_()   # padding and the other param groups' elements
        return out

    def _assemble(self, incoming: torch.Tensor) -> dict[int, torch.Tensor]:
        """Each owned matrix's flat elements from the received pieces. A matrix that arrived whole,
        in one piece, is used where it lies (Newton-Schulz only reads it); the others are joined."""
        matrices: dict[int, torch.Tensor] = {}
        offset = 0
        for pieces in self.plan.receive:
            for index, piece in pieces:
                data = incoming.narrow(0, offset, piece.numel)
                offset += piece.numel
                numel = self.specs[index].numel
                if piece.numel == numel:
                    matrices[index] = data
                    continue
                if index not in matrices:
                    matrices[index] = torch.empty(numel, dtype=torch.float32, device=incoming.device)
                matrices[index].narrow(0, piece.matrix_offset, piece.numel).copy_(data)
        return matrices

    def _all_to_all(self, outgoing: torch.Tensor, receive_numels: list[int],
                    send_numels: list[int]) -> torch.Tensor:
        if self.world_size == 1:
            return outgoing
        incoming = torch.empty(sum(receive_numels), dtype=outgoing.dtype, device=outgoing.device)
        comm.all_to_all_single(incoming, outgoing, receive_numels, send_numels, group=self.group)
        return incoming


class ReplicatedOrthogonalizer:
    """Stage 0: every rank holds every whole matrix. Each orthogonalizes the ones it owns into a
    zeroed flat buffer, and one all-reduce (a sum with zeros everywhere else: exact) hands every
    rank every result, so the replicas stay bitwise equal at 1/W of the Newton-Schulz work."""

    def __init__(self, shapes: list[tuple[int, ...]], group: Any, matrices: MatrixStep | None = None) -> None:
        self.shapes = shapes
        self.group = group
        self.world_size = comm.get_world_size(group)
        owners = assign_owners(shapes, self.world_size)
        rank = comm.get_rank(group)
        self.owned = [owner == rank for owner in owners]
        self.matrices = matrices if matrices is not None else LocalMatrices(shapes)

    @property
    def num_orthogonalized(self) -> int:
        return self.matrices.num_orthogonalized

    def __call__(self, updates: list[torch.Tensor], steps: int, method: str) -> list[torch.Tensor]:
        numels = [u.numel() for u in updates]
        device = updates[0].device if updates else torch.device("cpu")
        flat = torch.zeros(sum(numels), dtype=torch.float32, device=device)
        pieces = list(flat.split(numels))
        results = self.matrices({i: u for i, (u, mine) in enumerate(zip(updates, self.owned)) if mine}, steps, method)
        for index, result in results.items():
            pieces[index].copy_(result)
        if self.world_size > 1 and flat.numel():
            comm.all_reduce(flat, group=self.group)
        return pieces


def _pack(route: _Route, flat: torch.Tensor, offset_of: Any) -> torch.Tensor:
    parts = [flat.narrow(0, offset_of(index, piece), piece.numel).to(torch.float32)
             for pieces in route for index, piece in pieces]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.float32, device=flat.device)


def _pack_results(route: _Route, results: dict[int, torch.Tensor], device: torch.device) -> torch.Tensor:
    parts = [results[index].narrow(0, piece.matrix_offset, piece.numel) for pieces in route for index, piece in pieces]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.float32, device=device)


def _gaps(route: _Route, numel: int) -> list[tuple[int, int]]:
    """(start, length) of the elements of a flat buffer of `numel` that no piece of `route` covers."""
    gaps, position = [], 0
    for start, length in sorted((piece.buffer_offset, piece.numel) for pieces in route for _, piece in pieces):
        if start > position:
            gaps.append((position, start - position))
        position = max(position, start + length)
    if numel > position:
        gaps.append((position, numel - position))
    return gaps


def _unpack(route: _Route, data: torch.Tensor, target_of: Any) -> None:
    offset = 0
    for pieces in route:
        for index, piece in pieces:
            target_of(index, piece).copy_(data.narrow(0, offset, piece.numel))
            offset += piece.numel
