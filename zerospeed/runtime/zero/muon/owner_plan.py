"""Which rank orthogonalizes which matrix, and where each matrix's elements live (pure).

[Note: owner-based Muon]
ZeRO keeps each rank's share of a param group as one flat buffer: a matrix may be cut between
ranks (stage 1/2: the flat group buffer cut into equal partitions; stage 3: every parameter cut
into `ceil(numel / W)` elements per rank). Newton-Schulz needs the whole matrix, so every matrix
gets one owner rank. At the step each rank sends its pieces of the Muon input U to the owners
(one all-to-all), each owner rebuilds its matrices and orthogonalizes them, and the results go
back the same way (a second all-to-all) into the ranks' partitions. Matrices are assigned largest
first to the least-loaded rank (load = the matrix's Newton-Schulz cost), so owners do about the
same work, and every rank derives the same plan from the same shapes without communicating. Where
the pieces are uneven (stage 1/2: most matrices lie whole in one partition) a matrix goes instead to
the rank holding most of it, as long as that rank stays within an even share of the total cost:
those elements never travel, and the owners' work stays as even.

A `MatrixSpec` is the whole geometry: the parameter's shape and, for every rank, the pieces of
it that rank holds (offset in that rank's flat buffer, offset in the matrix, length).
"""

from __future__ import annotations

import dataclasses
import math

__all__ = ["ExchangePlan", "MatrixSpec", "Piece", "assign_owners", "exchange_plan", "flat_partition_specs",
           "ns_cost", "per_param_partition_specs"]


@dataclasses.dataclass(frozen=True)
class Piece:
    rank: int
    buffer_offset: int   # in `rank`'s flat buffer
    matrix_offset: int   # in the matrix's flattened elements
    numel: int


@dataclasses.dataclass(frozen=True)
class MatrixSpec:
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]   # in rank order, then matrix order

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def ns_cost(shape: tuple[int, ...]) -> int:
    """Newton-Schulz work for one matrix, up to a constant: rows * cols * min(rows, cols)."""
    rows, cols = shape[0], math.prod(shape[1:])
    return rows * cols * min(rows, cols)


def assign_owners(shapes: list[tuple[int, ...]], world_size: int,
                  held: list[list[int]] | None = None) -> list[int]:
    """Owner rank of each matrix, the same on every rank: largest cost first onto the least-loaded
    rank (ties: lower rank, earlier matrix). With `held` (`held[i][r]`: matrix i's elements already
    in rank r's partition) a matrix goes to the rank holding most of it while that rank's load stays
    within an even share of the total: those elements then never cross in the exchange (ZeRO 1/2's
    contiguous partitions hold whole matrices, so most need not travel at all)."""
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    costs = [ns_cost(shape) for shape in shapes]
    share = -(-sum(costs) // world_size)
    load = [0] * world_size
    owners = [0] * len(shapes)
    for index in sorted(range(len(shapes)), key=lambda i: (-costs[i], i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        if held is not None:
            holder = min(range(world_size), key=lambda r: (-held[index][r], load[r], r))
            if held[index][holder] > 0 and load[holder] + costs[index] <= share:
                rank = holder
        owners[index] = rank
        load[rank] += costs[index]
    return owners


def flat_partition_specs(shapes: list[tuple[int, ...]], offsets: list[int], partition_numel: int,
                         world_size: int) -> list[MatrixSpec]:
    """ZeRO 1/2: matrix i occupies [offsets[i], +numel) of a flat buffer whose rank r holds
    [r * partition_numel, (r + 1) * partition_numel)."""
    specs = []
    for shape, offset in zip(shapes, offsets):
        end = offset + math.prod(shape)
        pieces = []
        for rank in range(world_size):
            lo, hi = max(offset, rank * partition_numel), min(end, (rank + 1) * partition_numel)
            if hi > lo:
                pieces.append(Piece(rank, lo - rank * partition_numel, lo - offset, hi - lo))
        specs.append(MatrixSpec(tuple(shape), tuple(pieces)))
    return specs


def per_param_partition_specs(shapes: list[tuple[int, ...]], offsets: list[int],
                              world_size: int) -> list[MatrixSpec]:
    """ZeRO 3: matrix i is cut into `ceil(numel / W)` elements per rank, rank r's chunk starting at
    offsets[i] of its sub-group's flat buffer (the same offset on every rank); the last chunks may
    be short or empty (padding)."""
    specs = []
    for shape, offset in zip(shapes, offsets):
        numel = math.prod(shape)
        chunk = -(-numel // world_size)
        pieces = tuple(Piece(rank, offset, rank * chunk, min(chunk, numel - rank * chunk))
                       for rank in range(world_size) if numel - rank * chunk > 0)
        specs.append(MatrixSpec(tuple(shape), pieces))
    return specs


@dataclasses.dataclass(frozen=True)
class ExchangePlan:
    """One rank's side of the two all-to-alls, as lists in the order the bytes travel.

    `send[r]`: this rank's pieces of the matrices owned by r (matrix order); `receive[r]`: rank r's
    pieces of the matrices this rank owns (matrix order). The return trip swaps the two."""

    rank: int
    owned: tuple[int, ...]                           # indices of the matrices this rank owns
    send: tuple[tuple[tuple[int, Piece], ...], ...]      # per destination: (matrix index, piece)
    receive: tuple[tuple[tuple[int, Piece], ...], ...]   # per source: (matrix index, piece)

    def send_numels(self) -> list[int]:
        return [sum(piece.numel for _, piece in pieces) for pieces in self.send]

    def receive_numels(self) -> list[int]:
        return [sum(piece.numel for _, piece in pieces) for pieces in self.receive]


def exchange_plan(specs: list[MatrixSpec], owners: list[int], rank: int, world_size: int) -> ExchangePlan:
    send: list[list[tuple[int, Piece]]] = [[] for _ in range(world_size)]
    receive: list[list[tuple[int, Piece]]] = [[] for _ in range(world_size)]
    for index, (spec, owner) in enumerate(zip(specs, owners)):
        for piece in spec.pieces:
            if piece.rank == rank:
                send[owner].append((index, piece))
            if owner == rank:
                receive[piece.rank].append((index, piece))
    owned = tuple(i for i, owner in enumerate(owners) if owner == rank)
    return ExchangePlan(rank, owned, tuple(map(tuple, send)), tuple(map(tuple, receive)))
