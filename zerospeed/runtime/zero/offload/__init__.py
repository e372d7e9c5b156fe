"""ZeRO-Offload: everything that holds training state in host memory or on NVMe (docs/offload.md).

What lives where (one concept per module):

- `config.py`            `offload_optimizer` / `offload_param` config models (imported by users as
                         DeepSpeed's `deepspeed.runtime.zero.offload_config`, a thin re-export)
- `host_memory_check.py` up-front host-RAM plan and check at `initialize` (pure arithmetic)
- `offload_states.py`    `OffloadStates`: the host-side optimizer holder (fp32 masters and optimizer
                         states in RAM or swap files, stepped unit by unit by the CPU optimizer)
- `placement.py`         stage 3's placement, decided once per run: where each sub-group's fp32
                         master and optimizer state live, how its gradients reach them, its step
- `partition_home.py`    stage 3's partitions by `offload_param`: device, host memory or swap files
- `group_placement.py`   the same decision at stages 1 and 2, per param group
- `partial_offload.py`   `offload_optimizer.ratio < 1` at stage 3: the device optimizer of the
                         sub-groups kept on the accelerator, and the checkpoint layout across both
- `host_grads.py`        `HostGradientSink`: reduced gradient slices copied to host buffers during backward
- `aio_engine.py`        `AsyncIOEngine`: tensor <-> file transfers on a thread pool (the `aio` block)
- `optimizer_swapper.py` `OptimizerSwapper`: optimizer swap units on NVMe through bounded staging buffers
- `param_swapper.py`     `ParamSwapper`: stage-3 parameter partitions on NVMe (`offload_param: nvme`)

The ZeRO wrappers (`../stage_1_and_2.py`, `../stage3.py`) own these objects, each through its one
placement (`GroupPlacement` at stages 1 and 2, `SubGroupPlacement` at stage 3); nothing here
imports a wrapper or the engine. Stage 3's sub-group plan, which partial offload and the memory
check read, is `../sub_groups.py`. This package imports nothing itself, so importing the config stays cheap.
"""

__all__: list[str] = []
