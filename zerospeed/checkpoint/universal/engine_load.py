"""`load_checkpoint` with `"checkpoint": {"load_universal": true}` (DeepSpeed's universal load).

The tag comes from `<load_dir>/latest_universal` (missing: ValueError, as DeepSpeed). The
counters, the scheduler and the client state come from the folder's model-states file (this
rank's, or dp rank 0's when the run has more ranks than the writer); the parameters and the
optimizer state come from `zero/<param>/*.pt` as one more source of the full state
([Note: full layout]), which the optimizer's `load_full_state` cuts for this run's stage and
data-parallel size, as a resharded load does. What the run's file set adds is asked of its
`WeightFiles` ([Note: weight files]): the model-states file to read (a pipeline stage beyond the
saved stage count reads stage 0's), the module's other state (persistent buffers from the
model-states file, which DeepSpeed leaves at their initial values; a pipeline's layer files,
keyed by global layer index), each parameter's whole shape and this rank's cut of it (AutoTP:
its tp pieces). The engine's checkpointer is handed in; nothing here imports the runtime.
"""

from __future__ import annotations

import os
from typing import Any

from zerospeed import comm
from zerospeed.checkpoint import constants as C
from zerospeed.checkpoint.atomic import read_latest, resolve_tag_dir
from zerospeed.checkpoint.reader import CheckpointReader
from zerospeed.checkpoint.moe_reshard import full_state_names
from zerospeed.checkpoint.universal.layout import LATEST_UNIVERSAL
from zerospeed.checkpoint.universal.read import read_universal_state

__all__ = ["load_universal_checkpoint", "read_latest_universal"]


def read_latest_universal(load_dir: str) -> str:
    tag = read_latest(load_dir, LATEST_UNIVERSAL)   # a damaged pointer raises, naming the file
    if tag is None:
        raise ValueError(f"Invalid for universal checkpoint: {os.path.join(load_dir, LATEST_UNIVERSAL)} does not exist")
    return tag


def load_universal_checkpoint(checkpointer: Any, load_dir: str, tag: Any, load_optimizer_states: bool = True,
                              load_lr_scheduler_states: bool = True,
                              load_module_only: bool = False) -> tuple[str, dict[str, Any]]:
    folder = resolve_tag_dir(load_dir, read_latest_universal(load_dir) if tag is None else str(tag))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"universal checkpoint directory {folder} does not exist")
    site = checkpointer.site()
    ctx = checkpointer.context(site)
    reader = CheckpointReader(folder)   # its manifest: every file present, each read checksummed
    weight_files = site.weight_files
    model_path = weight_files.universal_model_file(ctx, reader)
    model_state = reader.load(model_path)
    weight_files.load_universal_module(ctx, reader, model_state)   # buffers; a pipeline's layer files
    with_optimizer = load_optimizer_states and not load_module_only
    names = full_state_names(ctx.param_names, ctx.run_groups)
    # the folder holds every parameter whole; an AutoTP run cuts its tp pieces from it, then the
    # optimizer its own partition, as a resharded load does
    shapes = {names[name]: weight_files.universal_shape(name, param)
              for param, name in ctx.param_names.items() if param.requires_grad}
    full = weight_files.own_universal_state(ctx, read_universal_state(folder, shapes, load_moments=with_optimizer))
    ctx.optimizer.load_full_state(full, ctx.param_names, load_optimizer_states=with_optimizer)
    loaded_scheduler = False
    if not load_module_only:
        loaded_scheduler = checkpointer.load_scheduler(model_state, load_lr_scheduler_states)
        checkpointer.load_counters(model_state)
    comm.barrier(site.group)
    excluded = set(C.CLIENT_STATE_EXCLUDED_KEYS) | ({C.OPTIMIZER} if with_optimizer else set())
    excluded |= {C.LR_SCHEDULER} if loaded_scheduler else set()
    return model_path, {key: value for key, value in model_state.items() if key not in excluded}
