"""Memory estimators for model states: DeepSpeed's table-printing ones and a precise per-rank one.

[Note: two estimators]
DeepSpeed's `estimate_zero{2,3}_model_states_mem_needs*` (`deepspeed/runtime/zero/stage_1_and_2.py::
estimate_zero2_model_states_mem_needs`, `deepspeed/runtime/zero/stage3.py::estimate_zero3_model_states_mem_needs`) keep their signatures,
formulas and printed tables, so scripts and forum answers port. Their formulas are coarse: they
assume fp16 parameters with fp32 master weights and gradients and Adam, and add an
`additional_buffer_factor` on the host side.

`estimate_model_states_bytes` is ours: per-rank bytes of exactly the four things a zerospeed
optimizer wrapper reports in `memory_breakdown()` (`lp_params, grads, master_params,
optimizer_states`), for a given stage, dtype, world size and offload choice, including the
padding the flat-buffer layout adds. What it models, with N ranks, Psi parameters, b bytes per
parameter element, g per gradient element and s optimizer-state bytes per element (Adam: 8):

| stage | lp_params | grads | master_params (bf16/fp16 only) | optimizer_states |
|---|---|---|---|---|
| 0 | b Psi | g Psi | 4 Psi | s Psi |
| 1 | b Psi_pad | g Psi + 4 Psi_pad/N* | 4 Psi_pad/N | s Psi_pad/N |
| 2 | b Psi_pad | (g + 4*) Psi_pad/N | 4 Psi_pad/N | s Psi_pad/N |
| 3 | b Psi_3/N | (g + 4*) Psi_3/N | 4 Psi_3/N | s Psi_3/N |

`*` the fp32 gradient of the master partition, held in bf16/fp16 only (`fp32_partition_grads`).
In fp32 the rank's slice of the flat parameter buffer *is* the master copy, so master_params is 0
and fp32 Adam gives the textbook 16 Psi, 8 Psi + 8 Psi/N, 4 Psi + 12 Psi/N and 16 Psi/N.
Psi_pad rounds the flat buffer up to a multiple of `alignment x N` elements; Psi_3/N sums each
parameter's padded shard (ceil(numel / N)), since stage 3 partitions parameter by parameter.
Offloading the optimizer moves master_params, optimizer_states and the fp32 partition gradients
to the host; offloading parameters (stage 3) moves lp_params there too.
Activations, communication buckets and allocator caching are outside model states.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

__all__ = [
    "ModelStatesBytes", "estimate_model_states_bytes", "model_to_params",
    "estimate_zero2_model_states_mem_needs", "estimate_zero2_model_states_mem_needs_all_live",
    "estimate_zero2_model_states_mem_needs_all_cold", "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_live", "estimate_zero3_model_states_mem_needs_all_cold",
]

GIB = 2**30
_DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}
_KEYS = ("lp_params", "grads", "master_params", "optimizer_states")


# --- DeepSpeed's estimators (deepspeed/runtime/zero/stage_1_and_2.py, stage3.py) ------------------------------------------------

def model_to_params(model: torch.nn.Module) -> tuple[int, int]:
    """(total params with shared storage counted once, the largest module's direct params)."""
    by_storage: dict[object, int] = {}
    for param in model.parameters():
        key = id(param) if param.is_meta else param.data_ptr()
        by_storage[key] = param.numel()
    largest_layer = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return sum(by_storage.values()), largest_layer


def estimate_zero2_model_states_mem_needs(total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                          cpu_offload: bool = True,
                                          additional_buffer_factor: float = 1.5) -> tuple[int, int]:
    """(cpu bytes per node, gpu bytes per GPU) for ZeRO-2 with 16-bit params and Adam."""
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        # 2 bytes of 16-bit params per GPU, and partitioned: 16-bit grads 2, fp32 grads 4, fp32 params 4, Adam 8
        gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def estimate_zero3_model_states_mem_needs(total_params: int, largest_layer_params: int, num_gpus_per_node: int = 1,
                                          num_nodes: int = 1, cpu_offload: bool = True,
                                          cpu_offload_params: bool = True, zero_init: bool = True,
                                          additional_buffer_factor: float = 1.5) -> tuple[int, int, int]:
    """(cpu bytes per node, gpu bytes per GPU, largest layer bytes) for ZeRO-3 with Adam."""
    total_gpus = num_nodes * num_gpus_per_node
    per_node = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params  # the largest layer gathered whole
    if cpu_offload and cpu_offload_params:
        gpu_mem = largest_layer_memory
        factor = 18 * per_node if zero_init else max(4 * num_gpus_per_node, 18 * per_node)
        cpu_mem = total_params * factor * additional_buffer_factor
    elif cpu_offload:
        gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)
        factor = 16 * per_node if zero_init else max(4 * num_gpus_per_node, 16 * per_node)
        cpu_mem = total_params * factor * additional_buffer_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        loaded = largest_layer_params if zero_init else total_params
        cpu_mem = loaded * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), largest_layer_memory


def _header(num_nodes: int, num_gpus_per_node: int, total_params: int, largest_layer_params: int | None) -> str:
    nodes = "nodes" if num_nodes > 1 else "node"
    gpus = "GPUs" if num_gpus_per_node > 1 else "GPU"
    model = f"SW: Model with {int(total_params / 1e6)}M total params"
    if largest_layer_params is not None:
        model += f", {int(largest_layer_params / 1e6)}M largest layer params"
    return ("Estimated memory needed for params, optim states and gradients for a:\n"
            f"HW: Setup with {num_nodes} {nodes}, {num_gpus_per_node} {gpus} per node.\n{model}.\n"
            "  per CPU  |  per GPU |   Options")


def _row(cpu_bytes: float, gpu_bytes: float, options: str) -> str:
    return f" {cpu_bytes / GIB:7.2f}GB | {gpu_bytes / GIB:6.2f}GB | {options}"


def _device(offloaded: bool) -> str:
    return f"{'cpu' if offloaded else 'none':4}"


def estimate_zero2_model_states_mem_needs_all_cold(total_params: int, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:
    """Print DeepSpeed's ZeRO-2 table for a parameter count."""
    lines = [_header(num_nodes, num_gpus_per_node, total_params, None)]
    for cpu_offload in (True, False):
        cpu, gpu = estimate_zero2_model_states_mem_needs(total_params, num_gpus_per_node, num_nodes, cpu_offload,
                                                         additional_buffer_factor)
        lines.append(_row(cpu, gpu, f"offload_optimizer={_device(cpu_offload)}"))
    print("\n".join(lines))


def estimate_zero2_model_states_mem_needs_all_live(model: torch.nn.Module, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:
    """Print DeepSpeed's ZeRO-2 table for `model` (shared parameters counted once)."""
    total_params, _ = model_to_params(model)
    estimate_zero2_model_states_mem_needs_all_cold(total_params, num_gpus_per_node, num_nodes,
                                                   additional_buffer_factor)


def estimate_zero3_model_states_mem_needs_all_cold(total_params: int, largest_layer_params: int,
                                                   num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:
    """Print DeepSpeed's ZeRO-3 table for a parameter count and largest layer."""
    lines = [_header(num_nodes, num_gpus_per_node, total_params, largest_layer_params)]
    for cpu_offload in (True, False):
        for cpu_offload_params in (True, False):
            if cpu_offload_params and not cpu_offload:
                continue
            for zero_init in (True, False):
                cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
                    total_params, largest_layer_params, num_gpus_per_node, num_nodes, cpu_offload,
                    cpu_offload_params, zero_init, additional_buffer_factor)
                options = (f"offload_param={_device(cpu_offload_params)}, "
                           f"offload_optimizer={_device(cpu_offload)}, zero_init={int(zero_init)}")
                lines.append(_row(cpu, gpu, options))
    print("\n".join(lines))


def estimate_zero3_model_states_mem_needs_all_live(model: torch.nn.Module, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:
    """Print DeepSpeed's ZeRO-3 table for `model`."""
    total_params, largest_layer_params = model_to_params(model)
    estimate_zero3_model_states_mem_needs_all_cold(total_params, largest_layer_params, num_gpus_per_node,
                                                   num_nodes, additional_buffer_factor)


# --- the precise estimate ------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ModelStatesBytes:
    """Per-rank bytes of model states, split by where they live ("device", "cpu" or "nvme")."""

    by_location: dict[str, dict[str, int]]

    def _summed(self, key: str) -> int:
        return sum(location.get(key, 0) for location in self.by_location.values())

    @property
    def lp_params(self) -> int:
        return self._summed("lp_params")

    @property
    def grads(self) -> int:
        return self._summed("grads")

    @property
    def master_params(self) -> int:
        return self._summed("master_params")

    @property
    def optimizer_states(self) -> int:
        return self._summed("optimizer_states")

    @property
    def total(self) -> int:
        return sum(sum(location.values()) for location in self.by_location.values())

    def location_total(self, location: str) -> int:
        return sum(self.by_location.get(location, {}).values())

    def as_dict(self) -> dict[str, int]:
        """The keys of `memory_breakdown()`: every location summed."""
        breakdown = {key: self._summed(key) for key in _KEYS}
        breakdown["total"] = sum(breakdown.values())
        return breakdown


def _dtype_bytes(dtype: str | torch.dtype) -> int:
    if isinstance(dtype, torch.dtype):
        return dtype.itemsize
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPE_BYTES)}, got {dtype!r}")
    return _DTYPE_BYTES[dtype]


def _offload_target(value: str | None, name: str) -> str:
    target = "device" if value in (None, "none") else value
    if target not in ("device", "cpu", "nvme"):
        raise ValueError(f"{name} must be None, 'none', 'cpu' or 'nvme', got {value!r}")
    return target


def _partition_numel(num_params: int, world_size: int, stage: int, alignment: int,
                     param_numels: Sequence[int] | None) -> tuple[int, int]:
    """(elements this rank's lp buffer holds at stages 1/2, elements of this rank's partition)."""
    if stage == 3:
        numels = param_numels if param_numels is not None else [num_params]
        return 0, sum(math.ceil(numel / world_size) for numel in numels)
    unit = alignment * world_size
    padded = math.ceil(num_params / unit) * unit
    return padded, padded // world_size


def estimate_model_states_bytes(num_params: int, world_size: int, stage: int, dtype: str | torch.dtype = "fp32",
                                offload_optimizer: str | None = None, offload_param: str | None = None,
                                grad_accum_dtype: str | torch.dtype | None = None,
                                optimizer_state_bytes_per_param: int = 8, alignment: int = 2,
                                param_numels: Sequence[int] | None = None,
                                fp32_partition_grads: bool | None = None) -> ModelStatesBytes:
    """Per-rank bytes of lp params, grads, fp32 masters and optimizer states (see [Note: two estimators])."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage}")
    num_params = int(num_params)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    optimizer_at = _offload_target(offload_optimizer, "offload_optimizer")
    param_at = _offload_target(offload_param, "offload_param")
    if param_at != "device" and stage != 3:
        raise ValueError(f"offload_param needs stage 3 (got stage {stage})")
    param_bytes = _dtype_bytes(dtype)
    grad_bytes = _dtype_bytes(grad_accum_dtype) if grad_accum_dtype is not None else param_bytes
    low_precision = param_bytes < 4
    if fp32_partition_grads is None:
        fp32_partition_grads = low_precision and stage >= 1
    if stage == 0:
        lp_numel, grad_numel, partition = num_params, num_params, num_params
    else:
        lp_numel, partition = _partition_numel(num_params, world_size, stage, alignment, param_numels)
        lp_numel = partition if stage == 3 else lp_numel
        grad_numel = num_params if stage == 1 else partition
    by_location: dict[str, dict[str, int]] = {"device": dict.fromkeys(_KEYS, 0)}
    for location in {optimizer_at, param_at}:
        by_location.setdefault(location, dict.fromkeys(_KEYS, 0))
    by_location[param_at]["lp_params"] += param_bytes * lp_numel
    by_location["device"]["grads"] += grad_bytes * grad_numel
    by_location[optimizer_at]["grads"] += 4 * partition if fp32_partition_grads else 0
    by_location[optimizer_at]["master_params"] += 4 * partition if low_precision else 0
    by_location[optimizer_at]["optimizer_states"] += optimizer_state_bytes_per_param * partition
    return ModelStatesBytes(by_location)
