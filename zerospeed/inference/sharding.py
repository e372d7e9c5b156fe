"""AutoTP for inference: the tensor-parallel group and the cut, with training's one rule set.

The layer rules and the sharded linears are training's (``runtime/tensor_parallel/plan.py``,
``shard.py``, ``layers.py``): a model cut for inference holds exactly the pieces a model cut for
training holds. What differs is only where the group comes from and that no weights are
broadcast (DeepSpeed's inference does not broadcast either: every rank loads the same weights,
or reads its own slices of a checkpoint, checkpoint_loading.py).

[Note: the inference tensor-parallel group]
The group is the ``model`` axis of the ``data x model`` layout (tp fastest, consecutive ranks),
built in ``comm/groups.py``: with 4 ranks and tp 2, ranks {0,1} and {2,3} each hold a replica.
DeepSpeed 0.19.8 builds one group of ranks 0..tp-1 and leaves the other ranks out. A
registered model-parallel group of the same size (training AutoTP in the same process) is
reused; otherwise the group is registered under `INFERENCE_TENSOR_PARALLEL` and reused by the
next `init_inference` of the same size. A user's ``tp_group`` or ``mpu`` must hold the ranks the
layout assigns.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from zerospeed import comm
from zerospeed.comm import groups
from zerospeed.comm.topology import PipeModelDataParallelTopology
from zerospeed.inference.config import DeepSpeedInferenceConfig
from zerospeed.runtime.tensor_parallel.plan import Partition
from zerospeed.runtime.tensor_parallel.shard import apply_autotp, linear_layers

__all__ = ["INFERENCE_TENSOR_PARALLEL", "injection_policy_specs", "shard_for_inference", "tensor_parallel_group"]

INFERENCE_TENSOR_PARALLEL = "inference_tensor_parallel"


def _ranks(group: Any) -> tuple[int, ...]:
    return tuple(comm.get_global_rank(group, r) for r in range(comm.get_world_size(group)))


def _layout_group(tp_size: int) -> Any:
    """This rank's tp group of the data x model layout ([Note: the inference tensor-parallel group])."""
    world_size = comm.get_world_size()
    if world_size % tp_size:
        raise ValueError(f"init_inference: tensor_parallel.tp_size ({tp_size}) must divide the world size ({world_size})")
    for name in (groups.MODEL_PARALLEL, INFERENCE_TENSOR_PARALLEL):
        if groups.is_initialized(name) and len(groups.get_group(name).ranks) == tp_size:
            return groups.get_group(name).group
    topology = PipeModelDataParallelTopology(num_pp=1, num_mp=tp_size, num_dp=world_size // tp_size)
    return groups.create_axis_group(topology, "model", INFERENCE_TENSOR_PARALLEL).group


def tensor_parallel_group(config: DeepSpeedInferenceConfig) -> Any:
    """The group the model is cut over, or None at tp 1 without an mpu (nothing is cut)."""
    tp = config.tensor_parallel
    given = tp.mpu.get_model_parallel_group() if tp.mpu is not None else tp.tp_group
    size = comm.get_world_size(given) if given is not None and tp.mpu is not None else tp.tp_size
    if size <= 1:
        return None
    group = _layout_group(size)
    if given is not None and _ranks(given) != _ranks(group):
        source = "tensor_parallel.mpu" if tp.mpu is not None else "tensor_parallel.tp_group"
        raise ValueError(f"init_inference: {source} holds ranks {list(_ranks(given))}, but the tensor-parallel "
                         f"layout puts this rank's peers at {list(_ranks(group))} (consecutive ranks)")
    return group


def injection_policy_specs(model: torch.nn.Module, policy: dict[Any, Any]) -> dict[str, Any]:
    """DeepSpeed's ``injection_policy`` as AutoTP ``partition_config`` rules: inside every instance
    of a policy's block class, the named linears are row-parallel and the others column-parallel;
    every linear outside those blocks stays replicated."""
    specs: list[dict[str, Any]] = []
    for block_class, row_names in policy.items():
        if not (isinstance(block_class, type) and issubclass(block_class, torch.nn.Module)):
            raise ValueError(f"init_inference: injection_policy key {block_class!r} is not a torch.nn.Module class")
        rows = (row_names,) if isinstance(row_names, str) else tuple(row_names)
        blocks = [name for name, module in model.named_modules() if isinstance(module, block_class)]
        for row in rows:
            if not any(name.endswith(row) for name, _ in model.named_modules()):
                raise ValueError(f"init_inference: injection_policy layer '{row}' is not in the model")
        for name, _, _ in linear_layers(model):
            if any(name.startswith(block + ".") for block in blocks):
                kind = "row" if name.endswith(rows) else "column"
                specs.append({"patterns": [re.escape(f"{name}.weight") + "$"], "partition_type": kind})
    return {"use_default_specs": False, "layer_specs": specs}


def shard_for_inference(model: torch.nn.Module, config: DeepSpeedInferenceConfig,
                        group: Any) -> dict[str, Partition]:
    """Cut ``model`` over ``group`` with AutoTP's rules (or the user's injection_policy)."""
    partition_config = injection_policy_specs(model, config.injection_policy) if config.injection_policy else None
    return apply_autotp(model, group, partition_config)
