"""The `zerospeed` launcher (DeepSpeed's `deepspeed` command). Imports no training code."""
