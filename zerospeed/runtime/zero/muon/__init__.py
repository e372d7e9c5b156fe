"""Muon under ZeRO: `MuonWithAuxAdam` (muon_optimizer.py) and its owner-based Newton-Schulz step."""

from zerospeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

__all__ = ["MuonWithAuxAdam"]
