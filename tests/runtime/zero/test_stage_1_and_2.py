"""ZeRO 1/2 (`DeepSpeedZeroOptimizer`) against single-process torch on the same global batch.

The optimizer is driven the way the engine drives it (base_optimizer.py's contract) on a tiny
language model with tied embeddings, a frozen weight, two param groups (no weight decay on
biases, their own lr) and parameter counts that do not divide the world size.
"""

import io

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_on_ranks
from parity import (
    assert_close_relative,
    ds_optimizer_block,
    global_batches,
    make_model,
    micro_batch,
    reference_run,
)

import zerospeed
from zerospeed.comm import comms_logger
from zerospeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from zerospeed.runtime.precision import PrecisionSettings
from zerospeed.runtime.zero.config import DeepSpeedZeroConfig
from zerospeed.runtime.zero.partition import slab_real_numel
from zerospeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

VOCAB, DIM, HIDDEN, SEQ, GLOBAL_BATCH, NUM_STEPS = 11, 6, 7, 5, 8, 10


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.fc1 = torch.nn.Linear(DIM, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, DIM)
        self.frozen = torch.nn.Linear(DIM, DIM, bias=False)
        self.frozen.weight.requires_grad_(False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        hidden = self.frozen(hidden + self.fc2(torch.tanh(self.fc1(hidden))))
        logits = hidden @ self.embed.weight.t()          # tied output head
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return TinyLM().to(dtype)


def _groups(model):
    weights = [p for n, p in model.named_parameters() if not n.endswith("bias")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0, "lr": 2e-2}]


def _torch_optimizer(kind, model):
    groups = _groups(model)
    if kind == "SGD":
        return torch.optim.SGD(groups, lr=1e-2, momentum=0.9)
    return getattr(torch.optim, kind)(groups, lr=1e-2)


def _batches(num_steps, gas):
    generator = torch.Generator().manual_seed(1)
    return [[(torch.randint(VOCAB, (GLOBAL_BATCH, SEQ), generator=generator),
              torch.randint(VOCAB, (GLOBAL_BATCH, SEQ), generator=generator)) for _ in range(gas)]
            for _ in range(num_steps)]


def _reference(kind, gas, clip, skip_steps=()):
    model = _model()
    optimizer = _torch_optimizer(kind, model)
    losses = []
    for step, micro_batches in enumerate(_batches(NUM_STEPS, gas)):
        total = 0.0
        for tokens, targets in micro_batches:
            loss = model(tokens, targets) / gas
            loss.backward()
            total += loss.item()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
        if step not in skip_steps:
            optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _zero_config(stage, **overrides):
    return DeepSpeedZeroConfig(stage=stage, **overrides)


def _build(stage, kind="AdamW", precision=None, scaler=None, dtype=torch.float32, **zero):
    model = _model(dtype)
    optimizer = DeepSpeedZeroOptimizer(_torch_optimizer(kind, model), _zero_config(stage, **zero),
                                       precision or PrecisionSettings(), scaler or LossScaler(1.0),
                                       dist.group.WORLD, partition_grads=stage == 2,
                                       param_names={p: n for n, p in model.named_parameters()})
    return model, optimizer


def _train(model, optimizer, gas, num_steps=NUM_STEPS, poison=None):
    """The engine's calls, per the base_optimizer contract; returns global mean losses per step."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    rows = GLOBAL_BATCH // world_size
    losses, overflows = [], []
    for step, micro_batches in enumerate(_batches(num_steps, gas)):
        total = torch.zeros(())
        for micro, (tokens, targets) in enumerate(micro_batches):
            loss = model(tokens[rank * rows:(rank + 1) * rows], targets[rank * rows:(rank + 1) * rows]) / gas
            if poison is not None and step == poison and rank == 0:
                loss = loss * float("inf")
            optimizer.prepare_backward(micro == gas - 1)
            optimizer.scale_loss(loss).backward()
            optimizer.backward_epilogue(micro == gas - 1)
            total += loss.detach().float()
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item() / world_size)
        overflows.append(optimizer.overflow)
    return losses, overflows


def _parity(stage, kind, gas, clip, zero):
    precision = PrecisionSettings(clip_grad=clip)
    model, optimizer = _build(stage, kind, precision, **zero)
    losses, _ = _train(model, optimizer, gas)
    ref_losses, ref_params = _reference(kind, gas, clip)
    assert_close_relative(torch.tensor(losses), torch.tensor(ref_losses), 1e-6, "losses")
    for name, param in model.named_parameters():
        assert_close_relative(param.detach(), ref_params[name], 1e-6, name)
    return optimizer.get_global_grad_norm()


CASES = {
    "adamw": ("AdamW", 1, 0.0, {}),
    "adam-gas4-clip": ("Adam", 4, 0.5, {}),
    "sgd-clip": ("SGD", 1, 0.5, {}),
    "sgd-gas4-tiny-buckets-overlap": ("SGD", 4, 0.0, {"reduce_bucket_size": 6, "overlap_comm": True}),
    "adamw-gas4-tiny-buckets-overlap": ("AdamW", 4, 0.0, {"reduce_bucket_size": 6, "overlap_comm": True,
                                                          "allgather_bucket_size": 8}),
    "adamw-allreduce-tiny-buckets": ("AdamW", 1, 0.5, {"reduce_scatter": False, "reduce_bucket_size": 10}),
    "adamw-noncontiguous-roundrobin": ("AdamW", 4, 0.0, {"contiguous_gradients": False,
                                                         "round_robin_gradients": True,
                                                         "reduce_bucket_size": 12, "overlap_comm": True}),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("world_size", [1, 2])
def test_fp32_matches_single_process_torch(world_size, stage, case):
    run_on_ranks(_parity, world_size, stage, *CASES[case])


@pytest.mark.parametrize("stage", [1, 2])
def test_fp32_parity_on_four_ranks(stage):
    run_on_ranks(_parity, 4, stage, "AdamW", 4, 0.5, {"reduce_bucket_size": 8, "overlap_comm": True})


def test_clipping_is_active_in_the_clipped_cases():
    norms = run_on_ranks(_parity, 2, 2, "AdamW", 1, 0.0, {})
    assert norms[0] > 0.5 and norms[0] == pytest.approx(norms[1])


# --- low precision -----------------------------------------------------------------------------

def _bf16(stage, wide_dtype):
    """bf16 params; gradients accumulated and communicated in bf16, or in `wide_dtype`."""
    wide = wide_dtype or torch.bfloat16
    precision = PrecisionSettings(param_dtype=torch.bfloat16, grad_accum_dtype=wide,
                                  communication_dtype=wide, check_overflow=True)
    model, optimizer = _build(stage, "AdamW", precision, dtype=torch.bfloat16, reduce_bucket_size=20)
    losses, _ = _train(model, optimizer, gas=2)
    ref_losses, _ = _reference("AdamW", 2, 0.0)
    assert_close_relative(torch.tensor(losses), torch.tensor(ref_losses), 1e-2, "bf16 losses")
    assert optimizer.single_partition_of_fp32_groups[0].dtype == torch.float32


@pytest.mark.parametrize("wide_dtype", [None, torch.float32], ids=["bf16-grads", "fp32-grads"])
@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_within_1e2_of_fp32(stage, wide_dtype):
    run_on_ranks(_bf16, 2, stage, wide_dtype)


def _fp16_overflow(stage):
    precision = PrecisionSettings(param_dtype=torch.float16, grad_accum_dtype=torch.float32,
                                  communication_dtype=torch.float16, check_overflow=True)
    scaler = DynamicLossScaler(init_scale=2.0**10, scale_window=1000)
    model, optimizer = _build(stage, "AdamW", precision, scaler, dtype=torch.float16)
    losses, overflows = _train(model, optimizer, gas=1, poison=3)
    assert overflows == [i == 3 for i in range(NUM_STEPS)]
    assert scaler.cur_scale == 2.0**9
    ref_losses, _ = _reference("AdamW", 1, 0.0, skip_steps=(3,))
    finite = [i for i in range(NUM_STEPS) if i != 3]
    assert_close_relative(torch.tensor(losses)[finite], torch.tensor(ref_losses)[finite], 1e-2, "fp16 losses")


@pytest.mark.parametrize("stage", [1, 2])
def test_fp16_overflow_skips_the_step_on_every_rank(stage):
    run_on_ranks(_fp16_overflow, 2, stage)


# --- communication volume ----------------------------------------------------------------------

def _comm_volume(stage, reduce_scatter, bucket, **zero):
    model, optimizer = _build(stage, reduce_scatter=reduce_scatter, reduce_bucket_size=bucket, **zero)
    _train(model, optimizer, gas=1, num_steps=1)
    comms_logger.configure(enabled=True, prof_all=True)
    comms_logger.reset()
    try:
        _train(model, optimizer, gas=1, num_steps=1)
        records = list(comms_logger.records)
    finally:
        comms_logger.configure(enabled=False)
        comms_logger.reset()
    real = sum(g.layout.numel for g in optimizer.groups)
    padded = sum(g.layout.padded_numel for g in optimizer.groups)
    real_slabs = sum(1 for g in optimizer.groups for s in g.slabs if slab_real_numel(g.layout, s) > 0)
    largest = max(p.numel() for g in optimizer.groups for p in g.params)
    return [(r.op, r.msg_bytes) for r in records], real, padded, real_slabs, largest


def _grad_reduction_op(stage, reduce_scatter):
    if not reduce_scatter:
        return "all_reduce"
    return "reduce_scatter_tensor" if stage == 1 else "all_to_all_single"


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("reduce_scatter", [True, False])
def test_one_step_moves_the_2psi_bound(stage, reduce_scatter):
    bucket = 8   # stage 1: rows of 4, every slab message is 32 bytes; scalars are <= 8 bytes
    results = run_on_ranks(_comm_volume, 2, stage, reduce_scatter, bucket)
    records, real, padded, real_slabs, largest = results[0]
    big = [(op, size) for op, size in records if size > 8]   # scalars: the norm (fp32 has no overflow check)
    grad_calls = [size for op, size in big if op == _grad_reduction_op(stage, reduce_scatter)]
    gather_calls = [size for op, size in big if op == "all_gather_into_tensor"]
    if stage == 1:       # slabs of the padded flat buffer, pure-padding slabs skipped
        assert len(grad_calls) == real_slabs and all(size == bucket * 4 for size in grad_calls)
        assert (padded - 4) * 4 <= sum(grad_calls) <= padded * 4
    else:                # production-order buckets: every trainable gradient element exactly once
        assert sum(grad_calls) == real * 4
        assert len(grad_calls) >= real // largest and all(size <= largest * 4 for size in grad_calls)
    assert sum(gather_calls) == padded * 4                          # the updated parameters, once
    assert len(big) == len(grad_calls) + len(gather_calls)          # nothing else tensor-sized


def test_stage1_overlap_reduces_from_the_boundary_backward():
    """Stage 1 + overlap_comm: the boundary micro-batch's hooks send each slice to its owner, once."""
    records, real, padded, _, _ = run_on_ranks(_comm_volume, 2, 1, True, 8, overlap_comm=True)[0]
    big = [(op, size) for op, size in records if size > 8]
    assert {op for op, _ in big} == {"all_to_all_single", "all_gather_into_tensor"}
    assert sum(size for op, size in big if op == "all_to_all_single") == real * 4
    assert sum(size for op, size in big if op == "all_gather_into_tensor") == padded * 4


def _default_buckets_volume(stage):
    records, real, padded, _, _ = _comm_volume(stage, True, 500_000_000)
    return records, real, padded


@pytest.mark.parametrize("stage", [1, 2])
def test_default_buckets_reduce_once_and_gather_once_per_group(stage):
    records, real, padded = run_on_ranks(_default_buckets_volume, 2, stage)[0]
    big = sorted((op, size) for op, size in records if size > 8)
    if stage == 1:       # one slab per group
        assert [op for op, _ in big] == ["all_gather_into_tensor"] * 2 + ["reduce_scatter_tensor"] * 2
        assert sum(size for _, size in big) == 2 * padded * 4       # exactly 2 Psi (padded), fp32
    else:                # one bucket for the whole backward
        assert [op for op, _ in big] == ["all_gather_into_tensor"] * 2 + ["all_to_all_single"]
        assert sum(size for _, size in big) == (real + padded) * 4


# --- memory -----------------------------------------------------------------------------------

def _memory(stage, dtype):
    precision = PrecisionSettings(param_dtype=dtype, grad_accum_dtype=dtype, communication_dtype=dtype)
    model, optimizer = _build(stage, "AdamW", precision, dtype=dtype)
    _train(model, optimizer, gas=1, num_steps=1)
    return optimizer.memory_breakdown(), sum(g.layout.padded_numel for g in optimizer.groups)


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_memory_breakdown_is_the_zero_paper_accounting(stage, dtype):
    world_size = 2
    breakdown, psi = run_on_ranks(_memory, world_size, stage, dtype)[0]
    lp_bytes = torch.tensor([], dtype=dtype).element_size()
    expected = {
        "lp_params": lp_bytes * psi,
        "grads": lp_bytes * psi // (world_size if stage == 2 else 1),
        "master_params": 0 if dtype == torch.float32 else 4 * psi // world_size,
        "optimizer_states": 8 * psi // world_size,
    }
    expected["total"] = sum(expected.values())
    assert breakdown == expected
    if dtype == torch.float32:   # 8 Psi + 8 Psi/N and 4 Psi + 12 Psi/N
        assert breakdown["total"] == (8 * psi + 8 * psi // 2 if stage == 1 else 4 * psi + 12 * psi // 2)


# --- state dict -------------------------------------------------------------------------------

def _round_trip(stage):
    model, optimizer = _build(stage, reduce_bucket_size=10)
    _train(model, optimizer, gas=2, num_steps=3)
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert state["zero_stage"] == stage and state["partition_count"] == [dist.get_world_size()] * 2
    owned = sum(m["numel"] for m in state["param_slice_mappings"][0].values())
    assert owned + state["group_paddings"][0] == optimizer.groups[0].layout.partition_numel

    continued, _ = _train(model, optimizer, gas=2, num_steps=3)
    fresh_model, fresh = _build(stage, reduce_bucket_size=10)
    fresh.load_state_dict(state)
    resumed, _ = _train(fresh_model, fresh, gas=2, num_steps=3)
    assert resumed == continued
    for (name, param), fresh_param in zip(model.named_parameters(), fresh_model.parameters()):
        assert torch.equal(param, fresh_param), name
    return sorted(state)


@pytest.mark.parametrize("stage", [1, 2])
def test_state_dict_round_trip_is_exact_and_weights_only_loadable(stage):
    keys = run_on_ranks(_round_trip, 2, stage)[0]
    assert set(keys) >= {"loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad", "base_optimizer_state",
                         "single_partition_of_fp32_groups", "zero_stage", "group_paddings", "partition_count",
                         "ds_version", "param_slice_mappings", "param_alignment_paddings"}


def _wrong_world_size_state():
    _model, optimizer = _build(2)
    state = optimizer.state_dict()
    state["partition_count"] = [3, 3]
    with pytest.raises(ValueError, match="partition_count"):
        optimizer.load_state_dict(state)


def test_loading_a_state_saved_on_another_world_size_is_a_clear_error():
    run_on_ranks(_wrong_world_size_state, 2)


def _grad_twice_without_epilogue():
    model, _optimizer = _build(2)
    (tokens, targets), = _batches(1, 1)[0]
    model(tokens, targets).backward()
    with pytest.raises(RuntimeError, match="Gradient computed twice"):
        model(tokens, targets).backward()


def test_stage2_rejects_a_second_backward_before_the_epilogue():
    run_on_ranks(_grad_twice_without_epilogue, 1)


# --- through zerospeed.initialize --------------------------------------------------------------

ENGINE_LR, ENGINE_WD = 1e-2, 0.01


def _engine_train(stage, gas, kind, clip, extra=None):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    micro = 16 // (gas * world_size)
    config = {"train_batch_size": 16, "gradient_accumulation_steps": gas, "gradient_clipping": clip,
              "optimizer": ds_optimizer_block(kind, ENGINE_LR, ENGINE_WD),
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 40, **(extra or {})}}
    engine, optimizer, _, _ = zerospeed.initialize(model=make_model(), config=config)
    assert isinstance(optimizer, DeepSpeedZeroOptimizer) and optimizer.zero_stage == stage
    losses = []
    for batch in global_batches(NUM_STEPS, 16):
        for k in range(gas):
            loss = engine(*micro_batch(batch, k, rank, micro, world_size))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses, {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


@pytest.mark.parametrize("stage,gas,kind,clip", [(1, 1, "AdamW", 0.0), (1, 4, "SGD", 0.05),
                                                 (2, 1, "SGD", 0.0), (2, 4, "AdamW", 0.05)])
def test_engine_matches_single_process_torch(stage, gas, kind, clip):
    results = run_on_ranks(_engine_train, 2, stage, gas, kind, clip, {"overlap_comm": gas == 4})
    ref_losses, ref_params = reference_run(make_model(), global_batches(NUM_STEPS, 16), kind, ENGINE_LR,
                                           ENGINE_WD, clip)
    losses = torch.tensor([r[0] for r in results]).view(2, NUM_STEPS, gas).mean(dim=(0, 2))
    assert_close_relative(losses, torch.tensor(ref_losses), 1e-6, "losses")
    for _, params in results:
        for name, expected in ref_params.items():
            assert_close_relative(params[name], expected, 1e-6, name)


def _engine_train_recording_bucket_layout(bucket_numel):
    """`_engine_train` at stage 2, recording whether each bucket was sent as it is ([Note: buckets
    fill from the end] in grad_buckets.py) or copied into owner order first."""
    from zerospeed.runtime.zero import grad_buckets

    outcomes, original = [], grad_buckets._is_laid_out

    def recording(slices, numel):
        outcomes.append(original(slices, numel))
        return outcomes[-1]

    grad_buckets._is_laid_out = recording
    try:
        result = _engine_train(2, 1, "AdamW", 0.0, {"reduce_bucket_size": bucket_numel})
    finally:
        grad_buckets._is_laid_out = original
    return result, outcomes


@pytest.mark.parametrize("bucket_numel", [500_000_000, 40])
def test_stage2_buckets_in_flat_order_are_sent_without_a_copy(bucket_numel):
    """One param group, gradients produced in reverse order: every bucket is already in owner order."""
    results = run_on_ranks(_engine_train_recording_bucket_layout, 2, bucket_numel)
    ref_losses, ref_params = reference_run(make_model(), global_batches(NUM_STEPS, 16), "AdamW", ENGINE_LR,
                                           ENGINE_WD, 0.0)
    losses = torch.tensor([losses for (losses, _), _ in results]).mean(dim=0)   # the global batch's
    assert_close_relative(losses, torch.tensor(ref_losses), 1e-6, "losses")
    for (_, params), outcomes in results:
        assert outcomes and all(outcomes), outcomes
        for name, expected in ref_params.items():
            assert_close_relative(params[name], expected, 1e-6, name)


def test_engine_bf16_within_1e2_of_fp32():
    results = run_on_ranks(_engine_train, 2, 2, 1, "AdamW", 0.0, None)
    bf16 = run_on_ranks(_bf16_engine_train, 2)
    fp32 = torch.tensor(results[0][0])
    assert_close_relative(torch.tensor(bf16[0]), fp32, 1e-2, "bf16 losses")


def _bf16_engine_train():
    rank = dist.get_rank()
    config = {"train_batch_size": 16, "optimizer": ds_optimizer_block("AdamW", ENGINE_LR, ENGINE_WD),
              "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}
    engine, _, _, _ = zerospeed.initialize(model=make_model(), config=config)
    losses = []
    for batch in global_batches(NUM_STEPS, 16):
        x, y = micro_batch(batch, 0, rank, 8, 2)
        loss = engine(x.bfloat16(), y.bfloat16())
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())
    return losses


def _ignored_option_warns():
    from zerospeed.runtime.config_utils import ConfigWarning

    # each key DeepSpeed's stage 1/2 honours and this implementation does not, named in its warning
    for key, value in (("elastic_checkpoint", True), ("parameter_alignment", True),
                       ("zero_quantized_gradients", True), ("zero_quantized_weights", True),
                       ("zero_hpz_partition_size", 2)):
        with pytest.warns(ConfigWarning, match=f"zero_optimization.{key}={value!r} is not implemented"):
            _build(1, **{key: value})


def test_an_unimplemented_option_warns():
    run_on_ranks(_ignored_option_warns, 1)


# --- reused stage-2 scratch ([Note: stage-2 scratch reuse] in grad_buckets.py) ---------------------

def _scratch_after_steps(overlap_comm):
    # the largest parameter fits a bucket (no piecewise reduction) and the 163 elements make >= 3 buckets
    model, optimizer = _build(2, reduce_bucket_size=VOCAB * DIM, overlap_comm=overlap_comm)
    _train(model, optimizer, gas=2, num_steps=1)
    first = optimizer.buckets.scratch_buffers()          # held: a fresh buffer cannot take their address
    _train(model, optimizer, gas=2, num_steps=2)
    later = optimizer.buckets.scratch_buffers()
    return len(first), optimizer.reducer.num_scratch_slots, len(later), all(a is b for a, b in zip(first, later))


@pytest.mark.parametrize("overlap_comm", [True, False])
def test_stage2_steps_allocate_no_new_bucket_buffers(overlap_comm):
    """Bucket, receive and sum buffers are allocated in the first step and reused by every later
    bucket: one of each per reduction that may be in flight, plus the one filling."""
    num_first, num_slots, num_later, same = run_on_ranks(_scratch_after_steps, 2, overlap_comm)[0]
    assert num_slots == (3 if overlap_comm else 1)
    assert num_first == 3 * num_slots and num_later == num_first and same
