"""`HostGradientSink` (host_grads.py) and the ZeRO 1/2 gradients it moves to host memory in backward.

- the sink's arithmetic against plain tensor ops, and its submission order when a transfer is
  still in flight (a fake event stands in for the accelerator's);
- through `zerospeed.initialize` on 2 ranks with `offload_optimizer: cpu`, stages 1, 2 and 3, GAS
  1 and 3: after the boundary backward (before the step) the partitions the step reads (stage 3:
  `grad_flat`) are host buffers holding the reduced gradient of the global batch, the step gets
  exactly those buffers, and the run equals the same run without offload bit for bit
  (`DeepSpeedCPUAdam` on both sides, as in test_offload.py).
"""

import pytest
import torch
from distributed import run_on_ranks
from parity import global_batches, make_model, micro_batch

import zerospeed
from zerospeed.ops.adam import DeepSpeedCPUAdam
from zerospeed.runtime.zero.offload import host_grads
from zerospeed.runtime.zero.offload.host_grads import HostGradientSink
from zerospeed.runtime.zero.param_state import rank_span

WORLD_SIZE, MICRO, NUM_STEPS = 2, 2, 3


# --- the sink alone -------------------------------------------------------------------------------
def test_sink_accumulates_and_copies_like_plain_ops():
    generator = torch.Generator().manual_seed(0)
    sink = HostGradientSink(pin_memory=True, max_pending=2)
    dest = sink.host_buffer(40, torch.float32)
    expected = torch.zeros(40)
    ops = [("add", 0, 40, torch.float32), ("add", 10, 20, torch.bfloat16), ("copy", 5, 10, torch.float32),
           ("add", 0, 40, torch.float32), ("add", 30, 10, torch.bfloat16), ("copy", 35, 5, torch.bfloat16)]
    for op, offset, numel, dtype in ops:
        source = torch.randn(numel, generator=generator).to(dtype)
        reference = expected.narrow(0, offset, numel)
        reference.add_(source) if op == "add" else reference.copy_(source)
        getattr(sink, op)(dest.narrow(0, offset, numel), source)
    sink.synchronize()
    assert sink.num_pending == 0
    assert dest.dtype == torch.float32 and dest.is_pinned() == torch.cuda.is_available()
    assert torch.equal(dest, expected)


class _FakeEvent:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def test_sink_keeps_submission_order_behind_a_transfer_in_flight(monkeypatch):
    """A host source submitted behind an unfinished transfer waits for it: the two land in order."""
    events = []

    def fake_copy_to_host(self, dest, source, accumulate):
        events.append(_FakeEvent())
        values = torch.full(dest.shape, 2.0)          # what the "device" source holds
        return host_grads._Pending(dest, values, accumulate, source, events[-1])

    monkeypatch.setattr(HostGradientSink, "_copy_to_host", fake_copy_to_host)
    sink = HostGradientSink(pin_memory=False)
    dest = torch.ones(4)
    sink.copy(dest, torch.empty(4, device="meta"))   # "device" source: in flight
    sink.add(dest, torch.full((4,), 3.0))            # host source, queued behind it
    assert sink.num_pending == 2 and torch.equal(dest, torch.ones(4))
    events[0].done = True
    sink.add(dest, torch.full((4,), 10.0))           # the next submission completes what is ready
    assert sink.num_pending == 0 and torch.equal(dest, torch.full((4,), 15.0))
    sink.copy(dest, torch.empty(4, device="meta"))
    sink.synchronize()
    assert events[1].done and torch.equal(dest, torch.full((4,), 2.0))


# --- through initialize, 2 ranks ------------------------------------------------------------------
def _engine(stage, gas, offload, **zero_overrides):
    model = make_model()
    groups = [{"params": [p for n, p in model.named_parameters() if not n.endswith("bias")]},
              {"params": [p for n, p in model.named_parameters() if n.endswith("bias")], "weight_decay": 0.0}]
    zero = {"stage": stage, "sub_group_size": 100, "reduce_bucket_size": 120, **zero_overrides}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
              "gradient_clipping": 0.5, "zero_optimization": zero}
    engine, *_ = zerospeed.initialize(model=model, model_parameters=groups, config=config,
                                      optimizer=lambda params: DeepSpeedCPUAdam(params, lr=1e-2, weight_decay=0.1))
    return engine


def _reference_grads(x, y):
    """Name -> flat mean gradient of the global batch (plain torch)."""
    reference = make_model()
    reference(x, y).backward()
    return {name: p.grad.reshape(-1) for name, p in reference.named_parameters()}


def _reference_partitions(engine, x, y):
    """Per group: this rank's partition of the flat mean gradient of the global batch."""
    by_name = _reference_grads(x, y)
    names = {param: name for name, param in engine.module.named_parameters()}
    rank, partitions = torch.distributed.get_rank(), []
    for group in engine.optimizer.groups:
        flat = torch.zeros(group.layout.padded_numel)
        for param, offset in zip(group.params, group.layout.param_offsets):
            flat.narrow(0, offset, param.numel()).copy_(by_name[names[param]])
        partitions.append(flat.narrow(0, group.layout.partition_start(rank), group.layout.partition_numel))
    return partitions


def _reference_grad_flat(engine, x, y):
    """Stage 3, per sub-group: this rank's partitions of the mean gradient, end to end (padded)."""
    by_name = _reference_grads(x, y)
    rank, flats = torch.distributed.get_rank(), []
    for sub_group in engine.optimizer.fp16_groups:
        pieces = []
        for param in sub_group:
            start, real = rank_span(param.zs_state.numel, WORLD_SIZE, rank)
            piece = torch.zeros(param.partition_numel())
            piece.narrow(0, 0, real).copy_(by_name[param.zs_state.name].narrow(0, start, real))
            pieces.append(piece)
        flats.append(torch.cat(pieces))
    return flats


def _step_reads(optimizer):
    """The gradient tensors the step hands to `OffloadStates.step`."""
    if hasattr(optimizer, "grad_flat"):
        return optimizer.grad_flat
    return [g.partition_grad for g in optimizer.groups]


def _first_boundary_checks(engine, x, y):
    """Before the first step: what the step will read, and whether it is the reduced gradient."""
    optimizer, reads = engine.optimizer, _step_reads(engine.optimizer)
    on_host = all(t.device.type == "cpu" and t.is_pinned() == torch.cuda.is_available() for t in reads)
    stage3 = hasattr(optimizer, "grad_flat")
    # stage 2: the partition buffer itself is on the host; stage 1: a host buffer beside the flat one
    separate = stage3 or all((g.partition_grad is g.grads) if optimizer.partition_gradients
                             else g.partition_grad.untyped_storage().data_ptr() != g.grads.untyped_storage().data_ptr()
                             for g in optimizer.groups)
    expected = _reference_grad_flat(engine, x, y) if stage3 else _reference_partitions(engine, x, y)
    close = all(torch.allclose(t, r, rtol=1e-5, atol=1e-7) for t, r in zip(reads, expected, strict=True))
    return {"on_host": on_host, "separate": separate, "reduced": close, "pending": optimizer.sink.num_pending}


def _run(stage, gas, offload, **zero_overrides):
    engine = _engine(stage, gas, offload, **zero_overrides)
    stepped_with, checks, losses = [], None, []
    if offload:
        holder_step = engine.optimizer.offload.step

        def recording_step(grads, multiplier):
            stepped_with.append([g.data_ptr() for g in grads])
            holder_step(grads, multiplier)
        engine.optimizer.offload.step = recording_step
    rank = torch.distributed.get_rank()
    for step, (x, y) in enumerate(global_batches(NUM_STEPS, MICRO * WORLD_SIZE * gas)):
        for micro_step in range(gas):
            mx, my = micro_batch((x, y), micro_step, rank, MICRO, WORLD_SIZE)
            loss = engine(mx, my)
            engine.backward(loss)
            if offload and step == 0 and micro_step == gas - 1:
                checks = _first_boundary_checks(engine, x, y)
                checks["read_ptrs"] = [g.data_ptr() for g in _step_reads(engine.optimizer)]
            engine.step()
            losses.append(loss.item())
    named = dict(engine.module.named_parameters())
    with zerospeed.zero.GatheredParameters(list(named.values())):    # stage 3; a no-op below it
        params = {name: p.detach().clone() for name, p in named.items()}
    return losses, params, checks, stepped_with


def _offload_against_none(stage, gas, zero_overrides):
    return _run(stage, gas, False, **zero_overrides), _run(stage, gas, True, **zero_overrides)


_STAGE3 = {"param_persistence_threshold": 0}    # every parameter gathered, not only the large ones


@pytest.mark.parametrize("stage,zero_overrides", [
    (1, {}), (1, {"overlap_comm": True}), (2, {}), (2, {"overlap_comm": True, "reduce_scatter": False}),
    (3, {**_STAGE3, "overlap_comm": False}), (3, _STAGE3)],
    ids=["stage1", "stage1-overlap", "stage2", "stage2-overlap-allreduce", "stage3", "stage3-overlap"])
@pytest.mark.parametrize("gas", [1, 3])
def test_gradients_reach_host_in_backward_and_match_no_offload(stage, zero_overrides, gas):
    for reference, offloaded in run_on_ranks(_offload_against_none, WORLD_SIZE, stage, gas, zero_overrides):
        losses, params, checks, stepped_with = offloaded
        assert losses == reference[0]
        for name, value in reference[1].items():
            assert torch.equal(params[name], value), name
        read_ptrs = checks.pop("read_ptrs")
        assert checks == {"on_host": True, "separate": True, "reduced": True, "pending": 0}
        assert len(stepped_with) == NUM_STEPS and stepped_with[0] == read_ptrs   # no copy at the step
