"""Stage 1's gradients as views of the flat gradient buffer ([Note: stage-1 gradients as views] in
zerospeed/runtime/zero/grad_views.py), through `zerospeed.initialize` on 2 gloo ranks.

A weight used twice (input projection and, transposed, in the body), a frozen layer, gradient
clipping, accumulation over 1 and 4 micro-batches, each reduction variant: each time a gradient
hook runs, every trainable `.grad` is its slot of the group's flat buffer; after the boundary and
after `step()` every `.grad` is None; no copy-like op reads or writes the buffer while gradients
accumulate, nor anywhere in a step where the reduction is in place; and the parameters equal
single-process PyTorch's on the same global batch. A `.grad` the user clears or replaces mid-window
is the gradient from there on, as in plain PyTorch (and DDP). bf16 parameters get views when they
accumulate in bf16 and none when `grad_accum_dtype` is fp32.
"""

import pytest
import torch

import zerospeed
from copy_counter import CopyCounter
from distributed import run_on_ranks
from parity import assert_close_relative, ds_optimizer_block, global_batches, micro_batch, torch_optimizer

NUM_STEPS, GLOBAL_BATCH, LR, WEIGHT_DECAY, CLIP = 6, 16, 1e-2, 0.01, 0.05


class _TiedAndFrozen(torch.nn.Module):
    """A weight used twice, a frozen layer, and a head (`alt`) the test can switch off."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 15, bias=False)
        self.frozen = torch.nn.Linear(15, 15)
        self.frozen.requires_grad_(False)
        self.back = torch.nn.Linear(15, 8)
        self.head = torch.nn.Linear(8, 4)
        self.alt = torch.nn.Linear(8, 4)
        self.use_alt = True

    def forward(self, x, y):
        hidden = torch.tanh(self.frozen(torch.tanh(self.proj(x))))
        tied = torch.tanh(hidden @ self.proj.weight + self.back(hidden))
        out = self.head(tied) + self.alt(tied) if self.use_alt else self.head(tied)
        return torch.nn.functional.mse_loss(out, y)


def _model():
    torch.manual_seed(0)
    return _TiedAndFrozen()


def _interfere(model, step, micro):
    """After micro-batch 0 of every step: `alt` is switched off and its weight's gradient cleared
    (it gets no more), and `head.weight`'s gradient is replaced by another tensor."""
    if micro != 0:
        return
    model.use_alt = False
    model.alt.weight.grad = None
    model.head.weight.grad = torch.full_like(model.head.weight, 0.01 * (step + 1))


def _reference(gas, interfere):
    """Single-process PyTorch: each micro-batch is every rank's rows of it, accumulated in `.grad`."""
    model = _model()
    optimizer = torch_optimizer("AdamW", model.parameters(), LR, WEIGHT_DECAY)
    trainable = [p for p in model.parameters() if p.requires_grad]
    for step, batch in enumerate(global_batches(NUM_STEPS, GLOBAL_BATCH)):
        model.use_alt = True
        for micro in range(gas):
            rows = slice(micro * GLOBAL_BATCH // gas, (micro + 1) * GLOBAL_BATCH // gas)
            (model(batch[0][rows], batch[1][rows]) / gas).backward()
            if interfere:
                _interfere(model, step, micro)
        for param in trainable:   # a gradient cleared and never produced again reduces as zeros (DDP)
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        torch.nn.utils.clip_grad_norm_(trainable, CLIP)
        optimizer.step()
        optimizer.zero_grad()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _train(gas, zero, interfere=False):
    """Train; record, at every gradient hook, whether each trainable `.grad` is its view, and the
    copies touching the flat buffers (while accumulating, and in whole steps after the first)."""
    rank = torch.distributed.get_rank()
    micro_size = GLOBAL_BATCH // (gas * 2)
    config = {"train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": gas, "gradient_clipping": CLIP,
              "optimizer": ds_optimizer_block("AdamW", LR, WEIGHT_DECAY), "zero_optimization": {"stage": 1, **zero}}
    engine, optimizer, _, _ = zerospeed.initialize(model=_model(), config=config)
    groups = [g for g in optimizer.groups if g.params]
    views = {id(p): v for g in groups for p, v in zip(g.params, g.grad_views.views)}
    flats = {g.grads.untyped_storage().data_ptr() for g in groups}
    trainable = [p for p in engine.module.parameters() if p.requires_grad]
    are_views = []
    for param in trainable:   # after the optimizer's own hook, which was registered first
        param.register_post_accumulate_grad_hook(
            lambda _: are_views.append(all(p.grad is views[id(p)] for p in trainable)))
    accumulating, stepping, released = CopyCounter(flats), CopyCounter(flats), []
    for step, batch in enumerate(global_batches(NUM_STEPS, GLOBAL_BATCH)):
        engine.module.use_alt = True
        with stepping if step else CopyCounter(set()):
            for micro in range(gas):
                with accumulating if micro < gas - 1 else CopyCounter(set()):
                    engine.backward(engine(*micro_batch(batch, micro, rank, micro_size, 2)))
                if interfere:
                    _interfere(engine.module, step, micro)
                if micro == gas - 1:
                    released.append(all(p.grad is None for p in engine.module.parameters()))
                engine.step()
        released.append(all(p.grad is None for p in engine.module.parameters()))
    params = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    flats_after = {g.grads.untyped_storage().data_ptr() for g in groups}
    return (params, are_views, released, accumulating.count, stepping.count, flats == flats_after,
            engine.get_global_grad_norm())


VARIANTS = {
    "one-slab": {},
    "allreduce": {"reduce_scatter": False},
    "narrow-slabs": {"reduce_bucket_size": 40},
    "overlap": {"overlap_comm": True, "reduce_bucket_size": 40},
    "overlap-allreduce": {"overlap_comm": True, "reduce_scatter": False},
}
IN_PLACE = {"one-slab", "allreduce"}   # reduced where they lie: no copy anywhere in a step


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("gas", [1, 4])
def test_gradients_are_views_of_the_flat_buffer_and_match_torch(gas, variant):
    expected = _reference(gas, interfere=False)
    for params, are_views, released, accumulating, stepping, same_flats, norm in \
            run_on_ranks(_train, 2, gas, VARIANTS[variant]):
        assert are_views and all(are_views) and all(released) and same_flats
        assert accumulating == 0
        if variant in IN_PLACE:
            assert stepping == 0
        assert norm > CLIP   # clipping was active
        for name, want in expected.items():
            assert_close_relative(params[name], want, 1e-6, name)


@pytest.mark.parametrize("variant", ["one-slab", "overlap"])
def test_a_gradient_cleared_or_replaced_mid_window_is_the_gradient(variant):
    expected = _reference(4, interfere=True)
    for params, _, released, accumulating, *_ in run_on_ranks(_train, 2, 4, VARIANTS[variant], True):
        for name, want in expected.items():
            assert_close_relative(params[name], want, 1e-6, name)
        assert all(released) and accumulating == NUM_STEPS   # the replaced gradient, copied in once a step


def _grads_between_micro_batches(data_types):
    """bf16 parameters, 2 micro-batches: whether the groups have views, and the `.grad`s' dtypes
    (None where `.grad` is None) after the first micro-batch."""
    rank = torch.distributed.get_rank()
    config = {"train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": 2, "bf16": {"enabled": True},
              "optimizer": ds_optimizer_block("AdamW", LR, WEIGHT_DECAY), "zero_optimization": {"stage": 1},
              "data_types": data_types}
    engine, optimizer, _, _ = zerospeed.initialize(model=_model(), config=config)
    batch = global_batches(1, GLOBAL_BATCH)[0]
    engine.backward(engine(*(t.bfloat16() for t in micro_batch(batch, 0, rank, GLOBAL_BATCH // 4, 2))))
    dtypes = [None if p.grad is None else p.grad.dtype for p in engine.module.parameters() if p.requires_grad]
    return [g.grad_views is not None for g in optimizer.groups if g.params], dtypes


def test_views_only_where_gradients_accumulate_in_the_model_dtype():
    """bf16 accumulating in bf16: views; in fp32 (`grad_accum_dtype`): no `.grad` can be an fp32 view
    of a bf16 parameter, so gradients move into the buffer and `.grad` stays None, as before."""
    has_views, dtypes = run_on_ranks(_grads_between_micro_batches, 2, {})[0]
    assert all(has_views) and dtypes == [torch.bfloat16] * len(dtypes)
    has_views, dtypes = run_on_ranks(_grads_between_micro_batches, 2, {"grad_accum_dtype": "fp32"})[0]
    assert not any(has_views) and dtypes == [None] * len(dtypes)
