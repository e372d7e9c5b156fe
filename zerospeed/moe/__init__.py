"""`zerospeed.moe`: Mixture of Experts with expert parallelism (DeepSpeed's `deepspeed.moe`)."""

from zerospeed.moe.layer import MoE

__all__ = ["MoE"]
