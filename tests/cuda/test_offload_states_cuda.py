"""`engine.offload_states()` / `reload_states()` on GPUs (runtime/zero/state_offload.py).

After offloading every state, `torch.cuda.memory_allocated()` must have dropped by at least the
bytes of the device storages the wrapper lists (the caching allocator rounds blocks up, so the
drop may be a little larger, never smaller); the host copies are pinned; after reload the
memory is back and the next steps equal, bit for bit, those of the same engine that never
offloaded (same GPU, same kernels). Blocking and non-blocking transfers, stages 0-3, fp32 and bf16.
"""

import pytest
import torch
from cuda_ranks import gpu_world_sizes, run_nccl

MICRO, IN, HIDDEN, OUT = 4, 256, 1024, 256


def _engine(stage: int, bf16: bool):
    import zerospeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.GELU(), torch.nn.Linear(HIDDEN, OUT))
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    if bf16:
        config["bf16"] = {"enabled": True}
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _step(engine, index: int) -> float:
    generator = torch.Generator().manual_seed(100 * index + torch.distributed.get_rank())
    x = torch.randn(MICRO, IN, generator=generator).cuda()
    y = torch.randn(MICRO, OUT, generator=generator).cuda()
    dtype = next(engine.module.parameters()).dtype
    loss = torch.nn.functional.mse_loss(engine(x.to(dtype)).float(), y)
    engine.backward(loss)
    engine.step()
    return loss.item()


def _device_state_bytes(engine) -> int:
    seen, total = set(), 0
    for tensors in engine.optimizer.offloadable_state_tensors().values():
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if tensor.is_cuda and storage.nbytes() > 0 and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def _offload_round_trip(stage: int, bf16: bool, non_blocking: bool) -> dict:
    plain = _engine(stage, bf16)
    plain_losses = [_step(plain, i) for i in range(4)]
    del plain
    engine = _engine(stage, bf16)
    losses = [_step(engine, i) for i in range(2)]
    torch.cuda.synchronize()
    state_bytes = _device_state_bytes(engine)
    before = torch.cuda.memory_allocated()
    engine.offload_states(non_blocking=non_blocking)
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    lp = engine.optimizer.offloadable_state_tensors()
    host_pinned = all(t.is_pinned() for kind, ts in lp.items() if kind.value != "contiguous_grad_buffer" for t in ts
                      if t.device.type == "cpu" and t.untyped_storage().nbytes() > 0)
    engine.reload_states(non_blocking=non_blocking)
    reloaded = torch.cuda.memory_allocated()
    losses += [_step(engine, i) for i in range(2, 4)]
    return {"state_bytes": state_bytes, "before": before, "after": after, "reloaded": reloaded,
            "pinned": host_pinned, "losses": losses, "plain_losses": plain_losses}


@pytest.mark.parametrize("world_size", gpu_world_sizes())
@pytest.mark.parametrize("non_blocking", [False, True])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_offload_frees_the_states_bytes_and_reload_trains_on(stage, bf16, non_blocking, world_size):
    for result in run_nccl(_offload_round_trip, world_size, stage, bf16, non_blocking):
        assert result["state_bytes"] > 0
        assert result["before"] - result["after"] >= result["state_bytes"], result
        assert result["reloaded"] - result["after"] >= result["state_bytes"], result
        assert result["pinned"]
        assert result["losses"] == result["plain_losses"]
