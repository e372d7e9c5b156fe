"""DeepSpeed's `deepspeed.ops.adagrad`."""

from zerospeed.ops.adagrad.cpu_adagrad import DeepSpeedCPUAdagrad

__all__ = ["DeepSpeedCPUAdagrad"]
