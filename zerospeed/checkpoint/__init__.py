"""Checkpoints in DeepSpeed's layout: crash-safe writes, verified loads, resharding (docs/checkpointing.md)."""
