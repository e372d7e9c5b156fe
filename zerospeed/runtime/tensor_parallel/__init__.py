"""AutoTP tensor-parallel training (DeepSpeed's ``deepspeed.runtime.tensor_parallel``).

config.py (the ``tensor_parallel`` section), plan.py (which layer splits how, pure), layers.py
(column / row parallel linears and their collectives), shard.py (applying the plan), setup.py
(groups and sharding at ``initialize``), state_dict.py (full weights back). The exact norm is the
tp part of the step's gradient space (runtime/grad_space.py). Guide: docs/tensor_parallel.md.
"""

from zerospeed.runtime.tensor_parallel.config import TPConfig, TPTrainingConfig, get_tensor_parallel_config

__all__ = ["TPConfig", "TPTrainingConfig", "get_tensor_parallel_config"]
