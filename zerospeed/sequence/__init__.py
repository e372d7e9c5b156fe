"""Sequence parallelism (Ulysses): ``zerospeed.sequence.layer.DistributedAttention``."""

from zerospeed.sequence.layer import DistributedAttention

__all__ = ["DistributedAttention"]
