"""The CUDA accelerator, streams and events, pinned memory and the offload copies (host gradient
sink, parameter swap files read into pinned buffers), each checked against plain torch."""

import pytest
import torch

from zerospeed.accelerator import real_accelerator
from zerospeed.accelerator.cuda_accelerator import CUDAAccelerator


@pytest.fixture
def cuda_accelerator():
    """The process accelerator set to CUDA for the test (the CPU suite's conftest asks for cpu)."""
    previous = real_accelerator._accelerator
    accelerator = CUDAAccelerator()
    real_accelerator.set_accelerator(accelerator)
    yield accelerator
    real_accelerator._accelerator = previous


def test_device_queries(cuda_accelerator):
    acc = cuda_accelerator
    assert acc.is_available() and acc.device_count() == torch.cuda.device_count() >= 1
    assert acc.communication_backend_name() == "nccl"
    assert acc.device_name(0) == "cuda:0" and acc.current_device_name().startswith("cuda")
    assert acc.device(0) == torch.device("cuda", 0)
    assert acc.total_memory() > 0 and acc.is_bf16_supported()
    before = acc.memory_allocated()
    acc.reset_peak_memory_stats()
    block = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    assert acc.memory_allocated() >= before + block.numel() and acc.max_memory_allocated() >= block.numel()
    del block
    acc.empty_cache()


def test_side_stream_and_events_order_work(cuda_accelerator):
    acc = cuda_accelerator
    x = torch.randn(2048, 2048, device="cuda")
    expected = x @ x
    side = acc.Stream()
    start, end = acc.Event(enable_timing=True), acc.Event(enable_timing=True)
    side.wait_stream(acc.current_stream())      # x was written on the default stream
    with acc.stream(side):
        start.record(side)
        y = x @ x
        end.record(side)
    acc.current_stream().wait_event(end)        # consume y on the default stream only after it
    assert torch.equal(y, expected)
    end.synchronize()
    assert end.query() and start.elapsed_time(end) > 0


def test_pinned_memory_and_non_blocking_copies(cuda_accelerator):
    acc = cuda_accelerator
    host = acc.pin_memory(torch.arange(1 << 20, dtype=torch.float32))
    assert acc.is_pinned(host) and not acc.is_pinned(torch.zeros(4))
    device = host.to("cuda", non_blocking=True)
    back = torch.empty_like(host, pin_memory=True)
    back.copy_(device * 2, non_blocking=True)
    acc.synchronize()
    assert torch.equal(back, host * 2)


def test_host_gradient_sink_overlapped_copies_equal_plain_sums(cuda_accelerator):
    from zerospeed.runtime.zero.offload.host_grads import HostGradientSink

    sink = HostGradientSink(pin_memory=True, max_pending=2)
    assert sink.pin_memory
    dest = sink.host_buffer(4096, torch.float32)
    assert dest.is_pinned()
    sources = [torch.randn(4096, device="cuda", dtype=dtype) for dtype in (torch.float32, torch.bfloat16) * 3]
    for source in sources:  # more than max_pending: the oldest are waited for on the way
        sink.add(dest, source)
    sink.synchronize()
    expected = torch.zeros(4096)
    for source in sources:
        expected += source.float().cpu()
    assert sink.num_pending == 0 and torch.equal(dest, expected)


def test_param_swapper_reads_into_pinned_buffers(cuda_accelerator, tmp_path):
    from zerospeed.runtime.zero.offload.aio_engine import AsyncIOEngine
    from zerospeed.runtime.zero.offload.param_swapper import ParamSwapper

    swapper = ParamSwapper(str(tmp_path / "swap"), AsyncIOEngine(), budget_numel=1 << 20, pin_memory=True)
    flat = torch.randn(1 << 16, dtype=torch.bfloat16)
    flat_id = swapper.add_flat(flat)
    part = swapper.partition(flat_id, 1024, 4096)
    assert swapper.pin and swapper.prefetch(part)
    out = torch.empty(4096, dtype=torch.bfloat16, pin_memory=True)
    swapper.read_into(part, out)
    on_device = out.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(on_device.cpu(), flat[1024:1024 + 4096])
    swapper.close()


def test_cpu_adam_refuses_gpu_resident_params_with_a_clear_error():
    from zerospeed.ops.adam import DeepSpeedCPUAdam

    param = torch.nn.Parameter(torch.randn(8, device="cuda"))
    param.grad = torch.randn(8, device="cuda")
    with pytest.raises(ValueError, match="needs CPU parameters, got one on cuda"):
        DeepSpeedCPUAdam([param], lr=1e-3).step()
