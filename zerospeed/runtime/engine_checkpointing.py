"""`save_checkpoint` / `load_checkpoint` for the engine (filled in by the checkpoint work, issue 5)."""

from __future__ import annotations


class EngineCheckpointing:
    """Mixin of DeepSpeedEngine: checkpoint save and load in DeepSpeed's layout."""
