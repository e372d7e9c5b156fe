"""`deepspeed.pipe`: the public face of pipeline parallelism."""

from zerospeed.runtime.pipe import (
    LayerSpec,
    PipeDataParallelTopology,
    PipelineModule,
    PipeModelDataParallelTopology,
    ProcessTopology,
    TiedLayerSpec,
)

__all__ = ["LayerSpec", "PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineModule",
           "ProcessTopology", "TiedLayerSpec"]
