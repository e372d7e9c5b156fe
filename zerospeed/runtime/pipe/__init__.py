"""Pipeline parallelism (DeepSpeed's `deepspeed.runtime.pipe`)."""

from zerospeed.runtime.pipe.module import LayerSpec, PipelineError, PipelineModule, TiedLayerSpec
from zerospeed.runtime.pipe.topology import (
    PipeDataParallelTopology,
    PipelineParallelGrid,
    PipeModelDataParallelTopology,
    ProcessTopology,
)

__all__ = ["LayerSpec", "PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineError",
           "PipelineModule", "PipelineParallelGrid", "ProcessTopology", "TiedLayerSpec"]
