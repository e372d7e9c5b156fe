"""The ``compile`` ds_config section (DeepSpeed 0.19.8's `deepspeed.compile.config.CompileConfig`).

DeepSpeed reads this section at `initialize` but compiles nothing there: the model is compiled
when the user (or accelerate's dynamo plugin) calls `engine.compile()`, and every key of the
section configures DeepCompile, DeepSpeed's own compiler passes, except `autoep_non_moe` (which
compiles around AutoEP layers). zerospeed does the same: the section is typed here with
DeepSpeed's keys and defaults, nothing happens at `initialize`, and `engine.compile()` compiles
with `torch.compile` (runtime/compiled_regions.py).

What zerospeed does not implement is refused by name where ignoring it would change the run:
`deepcompile: true` (no DeepCompile pass, `z1` or `z3` included, is implemented: the ZeRO
collectives stay eager, outside the compiled regions) and `autoep_non_moe: true` (AutoEP itself
is not implemented). The other keys only tune DeepCompile, so without it they change nothing and
are accepted, as DeepSpeed accepts them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from zerospeed.runtime.config_utils import DeepSpeedConfigModel

__all__ = ["CompileConfig", "PassName"]

PassName = Literal["z1", "z3", "autosp", "autotp"]


class CompileConfig(DeepSpeedConfigModel):
    """DeepSpeed's keys and defaults; all but the first two only tune DeepCompile."""

    deepcompile: bool = False
    """DeepCompile (DeepSpeed's ZeRO compiler passes): refused when true."""
    autoep_non_moe: bool = False
    """Compile around AutoEP layers: refused when true (AutoEP is not implemented)."""
    free_activation: bool = False
    free_activation_threshold: int = 10 * 1024 * 1024
    offload_activation: bool = False
    offload_activation_pin_memory: bool = True
    offload_opt_states: bool = False
    double_buffer: bool = True
    symmetric_memory: bool = False
    debug_log: bool = False
    offload_parameters: bool = False
    sync_before_reduce: bool = False
    sync_after_reduce: bool = False
    sync_before_allgather: bool = False
    sync_after_allgather: bool = False
    keep_int_input_tensors: bool = True
    keep_all_input_tensors: bool = False
    passes: list[PassName] | None = None
    """DeepCompile's passes; read only when `deepcompile` is true (and then refused)."""

    @model_validator(mode="after")
    def _refuse_unimplemented(self) -> CompileConfig:
        if self.deepcompile:
            raise ValueError("DeepCompile (compile.deepcompile, with its z1/z3/autosp/autotp passes) is "
                             "not implemented by zerospeed, and ignoring it would change the training run: set "
                             "compile.deepcompile to false; engine.compile() then compiles the model with "
                             "torch.compile, with the ZeRO collectives outside the compiled regions")
        if self.autoep_non_moe:
            raise ValueError("compiling around AutoEP layers (compile.autoep_non_moe) is not implemented "
                             "(zerospeed has no AutoEP): set it to false")
        return self
