"""The coordinator and hooks end to end: dynamic order, live-parameter bound, prefetch, comm volume,
memory breakdown."""

import logging
import os
import sys

import pytest
import torch
from distributed import run_on_ranks
from parity import assert_close_relative, global_batches, micro_batch

import zerospeed

sys.path.insert(0, os.path.dirname(__file__))
from test_stage3 import _batches, _config, build_model, train

STEPS, BATCH = 6, 8


class Reordering(torch.nn.Module):
    """Every third forward runs its two hidden layers in the other order (data-independent, so every
    rank and the stage-0 run agree)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 4)
        self.calls = 0

    def forward(self, x, y):
        self.calls += 1
        first, second = (self.a, self.b) if self.calls % 3 else (self.b, self.a)
        return torch.nn.functional.mse_loss(self.head(torch.tanh(second(torch.tanh(first(x))))), y)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _train_reordering(stage):
    world_size, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    torch.manual_seed(0)
    model = Reordering()
    config = {"train_batch_size": BATCH, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage, "param_persistence_threshold": 0}}
    engine, *_ = zerospeed.initialize(model=model, config=config)
    records = _Records()
    logging.getLogger("zerospeed").addHandler(records)
    losses = []
    for batch in global_batches(STEPS, BATCH):
        loss = engine(*micro_batch(batch, 0, rank, BATCH // world_size, world_size))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    logging.getLogger("zerospeed").removeHandler(records)
    from test_stage3 import full_params

    coordinator = engine.optimizer.parameter_offload.coordinator if stage == 3 else None
    warnings = [m for m in records.messages if "order of module calls changed" in m]
    return losses, full_params(engine), coordinator and coordinator.num_invalidations, len(warnings)


def test_changing_forward_order_invalidates_the_trace_and_still_equals_stage0():
    stage0 = run_on_ranks(_train_reordering, 2, 0)
    stage3 = run_on_ranks(_train_reordering, 2, 3)
    for (losses0, params0, _, _), (losses3, params3, invalidations, warnings) in zip(stage0, stage3):
        assert invalidations >= 2 and warnings == 1
        assert_close_relative(torch.tensor(losses3), torch.tensor(losses0), 1e-6, "losses")
        for name, expected in params0.items():
            assert_close_relative(params3[name], expected, 1e-6, name)


def _gather_op():
    """The parameter gather's collective: gloo's is an in-place all-gather ([Note: gloo temporaries])."""
    return "all_gather_in_place" if zerospeed.comm.prefers_in_place() else "all_gather_into_tensor"


def _live_bound(max_live, prefetch):
    zero = {"max_live_parameters": max_live, "prefetch_bucket_size": prefetch, "max_reuse_distance": 3000,
            "param_persistence_threshold": 0, "reduce_bucket_size": 5000}
    zerospeed.comm.comms_logger.reset()
    config = _config(3, 1, 2, 0.0, zero, comms_logger={"enabled": True})
    engine, losses3 = train(build_model("gpt"), config, 2, 1, _batches(4))
    prefetches = sum(r.async_op for r in zerospeed.comm.comms_logger.records if r.op == _gather_op())
    zerospeed.comm.configure(enabled=False)
    _, losses0 = train(build_model("gpt"), _config(0, 1, 2, 0.0), 2, 1, _batches(4))
    coordinator = engine.optimizer.parameter_offload.coordinator
    largest = max(sum(p.ds_numel for p in m.parameters(recurse=False)) for m in engine.module.modules())
    return coordinator.peak_available_numel, largest, prefetches, coordinator.trace_mode.name, losses0, losses3


@pytest.mark.parametrize("max_live,prefetch", [(8000, 2000), (1_000_000_000, 50_000_000)])
def test_gathered_parameters_stay_within_max_live_plus_largest_module(max_live, prefetch):
    for peak, largest, prefetches, mode, losses0, losses3 in run_on_ranks(_live_bound, 2, max_live, prefetch):
        assert mode == "COMPLETE" and prefetches > 0
        assert peak <= min(max_live, 10**8) + largest, (peak, largest)
        assert_close_relative(torch.tensor(losses3), torch.tensor(losses0), 1e-6, "losses")


def _comm_volume_per_step():
    from parity import make_model

    world_size = torch.distributed.get_world_size()
    config = {"train_batch_size": BATCH, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3, "param_persistence_threshold": 0, "max_reuse_distance": 0}}
    engine, *_ = zerospeed.initialize(model=make_model(), config=config)
    padded_bytes = 4 * sum(p.partition_numel() * world_size for p in engine.module.parameters())
    zerospeed.comm.configure(enabled=True, prof_all=True)
    per_step = []
    for batch in global_batches(3, BATCH):
        zerospeed.comm.comms_logger.reset()
        engine.backward(engine(*micro_batch(batch, 0, torch.distributed.get_rank(), BATCH // world_size, world_size)))
        engine.step()
        per_step.append(zerospeed.comm.comms_logger.bytes_by_op())
    zerospeed.comm.configure(enabled=False)
    return padded_bytes, per_step, zerospeed.comm.prefers_in_place()


def test_comm_volume_is_two_gathers_and_one_reduce_scatter_per_step():
    for padded_bytes, per_step, in_place in run_on_ranks(_comm_volume_per_step, 2):
        for volume in per_step:  # step 1 records the trace, steps 2-3 prefetch from it
            norm_bytes = 8  # the squared gradient norm (float64)
            order_check_bytes = 2 * 2 * 8   # (count, hash) of each rank, int64 ([Note: gather-order check])
            assert volume["zero3.module_order_check"] == order_check_bytes
            # gloo: the all-gather is the in-place one; the reduce-scatter, logged as one, is there an
            # all-reduce of the rows ([Note: gloo temporaries])
            gather = "all_gather_in_place" if in_place else "all_gather_into_tensor"
            assert set(volume) == {gather, "reduce_scatter_tensor", "all_reduce", "zero3.module_order_check"}
            assert volume[gather] == 2 * padded_bytes
            assert volume["reduce_scatter_tensor"] == padded_bytes
            assert volume["all_reduce"] <= norm_bytes


def _breakdown(threshold):
    world_size = torch.distributed.get_world_size()
    zero = {"param_persistence_threshold": threshold}
    engine, _ = train(build_model("gpt"), _config(3, 1, world_size, 0.0, zero), world_size, 1, _batches(1))
    params = list({id(p): p for p in engine.module.parameters()}.values())
    psi = sum(p.ds_numel for p in params)
    persistent_bytes = 4 * sum(p.ds_numel for p in params if p.ds_persist)
    return engine.memory_breakdown(), psi, persistent_bytes


@pytest.mark.parametrize("threshold", [0, 64])
def test_memory_breakdown_is_16_psi_over_n_plus_persistent(threshold):
    for breakdown, psi, persistent_bytes in run_on_ranks(_breakdown, 2, threshold):
        expected = 16 * psi / 2
        assert abs(breakdown["total"] - persistent_bytes - expected) <= 0.02 * expected, breakdown
        assert breakdown["persistent_params"] == persistent_bytes
        assert (persistent_bytes > 0) == (threshold > 0)


class TinyMoE(torch.nn.Module):
    """Each row goes to the expert its sign picks: which experts run depends on each rank's data."""

    def __init__(self):
        super().__init__()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        use = (x[:, 0] > 0).long()
        out = torch.zeros_like(x)
        for index in sorted(set(use.tolist())):
            rows = use == index
            out[rows] = self.experts[index](x[rows])
        return out


class MoEModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.moe, self.head = torch.nn.Linear(8, 8), TinyMoE(), torch.nn.Linear(8, 4)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.head(self.moe(self.inp(x))), y)


def _moe_batches():
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(4, 8, generator=generator), torch.randn(4, 4, generator=generator)) for _ in range(4)]


def _train_moe():
    world_size, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    torch.manual_seed(0)
    model = MoEModel()
    assert len(zerospeed.zero.set_z3_leaf_modules(model, [TinyMoE])) == 1
    config = {"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": 3, "param_persistence_threshold": 0}}
    engine, *_ = zerospeed.initialize(model=model, config=config)
    used = []
    for batch in _moe_batches():
        x, y = micro_batch(batch, 0, rank, 4 // world_size, world_size)
        with torch.no_grad(), zerospeed.zero.GatheredParameters(list(model.inp.parameters())):
            used.append(sorted(set((model.inp(x)[:, 0] > 0).tolist())))  # the experts this rank runs
        engine.backward(engine(x, y))
        engine.step()
    from test_stage3 import full_params

    return used, full_params(engine)


def test_z3_leaf_module_with_data_dependent_experts_equals_single_process():
    """Ranks run different experts, so their gradient hooks differ; the reference is one process
    on the whole batch (stage 0's hook-driven all-reduce mis-pairs gradients on such models)."""
    torch.manual_seed(0)
    reference = MoEModel()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in _moe_batches():
        optimizer.zero_grad()
        (0.5 * (reference(x[:2], y[:2]) + reference(x[2:], y[2:]))).backward()
        optimizer.step()
    results = run_on_ranks(_train_moe, 2)
    assert any(u0 != u1 for u0, u1 in zip(results[0][0], results[1][0]))  # the ranks did diverge
    for _, params in results:
        for name, expected in reference.named_parameters():
            assert_close_relative(params[name], expected.detach(), 1e-6, name)


def _eval_between_steps(stage):
    world_size, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    torch.manual_seed(0)
    model = Reordering()
    config = {"train_batch_size": BATCH, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage, "param_persistence_threshold": 0}}
    engine, *_ = zerospeed.initialize(model=model, config=config)
    losses = []
    for batch in global_batches(3, BATCH):
        x, y = micro_batch(batch, 0, rank, BATCH // world_size, world_size)
        engine.backward(engine(x, y))
        engine.step()
        engine.eval()
        with torch.no_grad():  # forward only: no backward hooks, everything released after
            losses.append(engine(x, y).item())
        engine.train()
    gathered = [p for p in model.parameters() if getattr(p, "ds_persist", True) is False and p.numel() > 0]
    return losses, len(gathered)


def test_no_grad_evaluation_between_steps():
    for (losses0, _), (losses3, gathered) in zip(run_on_ranks(_eval_between_steps, 2, 0),
                                                 run_on_ranks(_eval_between_steps, 2, 3)):
        assert gathered == 0
        assert_close_relative(torch.tensor(losses3), torch.tensor(losses0), 1e-6, "eval losses")
