"""Sequence parallelism in the runtime: the engine's groups (`groups_setup`), DeepSpeed's ALST mpu
(`parallel_state_sp`) and the Hugging Face pieces (`ulysses_sp`)."""

__all__: list[str] = []
