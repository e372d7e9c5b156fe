"""Activation checkpointing (DeepSpeed's `deepspeed.runtime.activation_checkpointing`)."""

from zerospeed.runtime.activation_checkpointing import checkpointing

__all__ = ["checkpointing"]
