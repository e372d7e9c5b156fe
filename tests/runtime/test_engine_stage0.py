"""Stage 0 through `zerospeed.initialize` equals single-process PyTorch on the same global batch."""

import pytest
import torch

import zerospeed
from copy_counter import CopyCounter
from distributed import run_on_ranks
from parity import (assert_close_relative, ds_optimizer_block, global_batches, make_model, micro_batch,
                    reference_run)

NUM_STEPS, GLOBAL_BATCH, LR, WEIGHT_DECAY = 10, 16, 1e-2, 0.01


def _train(world_size, gas, kind, clip, extra_config=None):
    rank = torch.distributed.get_rank()
    micro = GLOBAL_BATCH // (gas * world_size)
    config = {"train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": gas,
              "optimizer": ds_optimizer_block(kind, LR, WEIGHT_DECAY), "gradient_clipping": clip,
              **(extra_config or {})}
    engine, _, _, _ = zerospeed.initialize(model=make_model(), config=config)
    assert engine.train_micro_batch_size_per_gpu() == micro
    losses = []
    for batch in global_batches(NUM_STEPS, GLOBAL_BATCH):
        for k in range(gas):
            loss = engine(*micro_batch(batch, k, rank, micro, world_size))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    params = {name: p.detach().float().clone() for name, p in engine.module.named_parameters()}
    return losses, params, engine.global_steps, engine.micro_steps, engine.get_global_grad_norm()


def _check_against_reference(results, world_size, gas, kind, clip, rtol=1e-6):
    ref_losses, ref_params = reference_run(make_model(), global_batches(NUM_STEPS, GLOBAL_BATCH), kind, LR,
                                           WEIGHT_DECAY, clip)
    per_rank_losses = torch.tensor([r[0] for r in results])  # [rank, step * gas + k]
    step_losses = per_rank_losses.view(world_size, NUM_STEPS, gas).mean(dim=(0, 2))
    assert_close_relative(step_losses, torch.tensor(ref_losses), rtol, "losses")
    for _, params, global_steps, micro_steps, _ in results:
        assert (global_steps, micro_steps) == (NUM_STEPS, NUM_STEPS * gas)
        for name, expected in ref_params.items():
            assert_close_relative(params[name], expected, rtol, name)


CASES = [(w, g, kind, clip) for w in (1, 2, 4) for g in (1, 4) for kind in ("Adam", "AdamW", "SGD")
         for clip in (0.0, 0.05) if w == 2 or (kind == "AdamW")]


@pytest.mark.parametrize("world_size,gas,kind,clip", CASES)
def test_stage0_matches_single_process_torch(world_size, gas, kind, clip):
    results = run_on_ranks(_train, world_size, world_size, gas, kind, clip)
    _check_against_reference(results, world_size, gas, kind, clip)


def test_clipping_is_active_in_the_clipped_cases():
    """The clip value used above really clips: the unclipped grad norm is larger than it."""
    results = run_on_ranks(_train, 2, 2, 1, "AdamW", 0.0)
    assert results[0][4] > 0.05


@pytest.mark.parametrize("extra", [{"prescale_gradients": True}, {"gradient_predivide_factor": 2.0},
                                   {"zero_optimization": {"stage": 0, "reduce_bucket_size": 50}}])
def test_averaging_variants_and_small_buckets_give_the_same_result(extra):
    results = run_on_ranks(_train, 2, 2, 2, "AdamW", 0.0, extra)
    _check_against_reference(results, 2, 2, "AdamW", 0.0, rtol=1e-5)


def _comm_records_of_one_step(bucket_numel):
    from zerospeed.comm import comms_logger

    config = {"train_batch_size": GLOBAL_BATCH, "optimizer": ds_optimizer_block("AdamW", LR, WEIGHT_DECAY),
              "zero_optimization": {"stage": 0, "reduce_bucket_size": bucket_numel},
              "comms_logger": {"enabled": True}}
    engine, _, _, _ = zerospeed.initialize(model=make_model(), config=config)
    comms_logger.reset()
    x, y = micro_batch(global_batches(1, GLOBAL_BATCH)[0], 0, torch.distributed.get_rank(), GLOBAL_BATCH // 2, 2)
    engine.backward(engine(x, y))
    engine.step()
    records = [(r.op, r.msg_bytes, r.async_op) for r in comms_logger.records]
    comms_logger.configure(enabled=False)
    comms_logger.reset()
    return records, sum(p.numel() for p in engine.module.parameters())


def test_gradients_are_all_reduced_once_in_async_buckets_during_backward():
    records, num_params = run_on_ranks(_comm_records_of_one_step, 2, 200)[0]
    all_reduces = [r for r in records if r[0] == "all_reduce"]
    assert sum(r[1] for r in all_reduces) == 4 * num_params       # fp32 gradients, once
    assert all(r[2] for r in all_reduces)                          # launched asynchronously
    assert len(all_reduces) >= num_params // 200                   # in buckets of <= 200 elements


class _TwoExperts(torch.nn.Module):
    """Rows with a positive first feature go to expert 0, the rest to expert 1."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 8)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 4) for _ in range(2))

    def forward(self, x, y):
        hidden = torch.tanh(self.inp(x))
        positive = x[:, 0] > 0
        out = torch.zeros(x.shape[0], 4)
        for index, rows in enumerate((positive, ~positive)):
            if rows.any():
                out[rows] = self.experts[index](hidden[rows])
        return torch.nn.functional.mse_loss(out, y)


def _expert_batches():
    batches = global_batches(5, GLOBAL_BATCH)
    for x, _ in batches:  # rank 0's half positive, rank 1's half negative: each rank runs one expert
        x[: GLOBAL_BATCH // 2, 0] = x[: GLOBAL_BATCH // 2, 0].abs() + 0.1
        x[GLOBAL_BATCH // 2:, 0] = -x[GLOBAL_BATCH // 2:, 0].abs() - 0.1
    return batches


def _train_experts():
    torch.manual_seed(0)
    config = {"train_batch_size": GLOBAL_BATCH, "optimizer": ds_optimizer_block("AdamW", LR, WEIGHT_DECAY),
              "gradient_clipping": 0.0, "zero_optimization": {"stage": 0, "reduce_bucket_size": 40}}
    engine, _, _, _ = zerospeed.initialize(model=_TwoExperts(), config=config)
    for batch in _expert_batches():
        engine.backward(engine(*micro_batch(batch, 0, torch.distributed.get_rank(), GLOBAL_BATCH // 2, 2)))
        engine.step()
    return {name: p.detach().clone() for name, p in engine.module.named_parameters()}


def test_ranks_using_different_parameters_still_reduce_correctly():
    torch.manual_seed(0)
    _, ref_params = reference_run(_TwoExperts(), _expert_batches(), "AdamW", LR, WEIGHT_DECAY, 0.0)
    for params in run_on_ranks(_train_experts, 2):
        for name, expected in ref_params.items():
            assert_close_relative(params[name], expected, 1e-6, name)


class _TiedAndFrozen(torch.nn.Module):
    """A weight used twice (input projection and, transposed, the head) and a frozen layer."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 16, bias=False)
        self.frozen = torch.nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.back = torch.nn.Linear(16, 8)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x, y):
        hidden = torch.tanh(self.frozen(torch.tanh(self.proj(x))))
        tied = torch.tanh(hidden @ self.proj.weight + self.back(hidden))
        return torch.nn.functional.mse_loss(self.head(tied), y)


def _make_tied_and_frozen():
    torch.manual_seed(0)
    return _TiedAndFrozen()


def _train_with_views(gas):
    """Train, checking the gradients' storage: after every backward each trainable `.grad` is a view
    of the persistent bucket tensor, after every step it is None, and no copy-like op reads or
    writes a gradient's memory in a step after the first ([Note: gradients as bucket views])."""
    rank = torch.distributed.get_rank()
    micro = GLOBAL_BATCH // (gas * 2)
    config = {"train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": gas,
              "optimizer": ds_optimizer_block("AdamW", LR, WEIGHT_DECAY), "gradient_clipping": 0.05,
              "zero_optimization": {"stage": 0, "reduce_bucket_size": 40}}
    engine, _, _, _ = zerospeed.initialize(model=_make_tied_and_frozen(), config=config)
    trainable = [p for p in engine.module.parameters() if p.requires_grad]
    flat_storages, copies, views_seen = set(), [], []
    for step, batch in enumerate(global_batches(NUM_STEPS, GLOBAL_BATCH)):
        buffers = engine.optimizer._reducer.grad_buffers()
        counter = CopyCounter({b.untyped_storage().data_ptr() for b in buffers})
        with counter:
            for k in range(gas):
                engine.backward(engine(*micro_batch(batch, k, rank, micro, 2)))
                flat = engine.optimizer._reducer.grad_buffers()[0].untyped_storage().data_ptr()
                flat_storages.add(flat)
                views_seen.append(all(p.grad.untyped_storage().data_ptr() == flat for p in trainable))
                engine.step()
        assert all(p.grad is None for p in engine.module.parameters())
        if step:
            copies.append(counter.count)
    params = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    return params, len(flat_storages), copies, views_seen, engine.get_global_grad_norm()


@pytest.mark.parametrize("gas", [1, 4])
def test_gradients_accumulate_in_bucket_views_without_copies(gas):
    """Tied and frozen parameters, accumulation and clipping through the views: the single-process
    reference's parameters, one bucket tensor for the run, no gradient copied in any later step."""
    _, ref_params = reference_run(_make_tied_and_frozen(), global_batches(NUM_STEPS, GLOBAL_BATCH), "AdamW", LR,
                                  WEIGHT_DECAY, 0.05)
    for params, num_flats, copies, views_seen, norm in run_on_ranks(_train_with_views, 2, gas):
        assert num_flats == 1 and all(views_seen) and copies == [0] * (NUM_STEPS - 1)
        assert norm > 0.05   # clipping was active
        for name, expected in ref_params.items():
            assert_close_relative(params[name], expected, 1e-6, name)
