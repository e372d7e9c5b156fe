"""`engine.offload_states()` / `reload_states()` at ZeRO 0 to 3 (runtime/zero/state_offload.py).

The reference is the same engine that never offloads: a run that offloads and reloads every state
between every step, on 2 gloo ranks over the same batches, must give the same losses and final
parameters bit for bit. While offloaded, every listed tensor of the included types is on the
host on a new storage, and the storage it left has no bytes (freed); after reload the views the
wrappers keep share their flat buffers' storages again.
"""

import pytest
import torch
from distributed import run_on_ranks

import zerospeed
from zerospeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

IN, HIDDEN, OUT, MICRO, STEPS = 6, 10, 3, 2, 3
ALL = list(OffloadStateTypeEnum)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(IN, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, OUT)
        self.frozen = torch.nn.Linear(OUT, OUT, bias=False)
        self.frozen.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.frozen(self.fc2(torch.tanh(self.fc1(x))))


def _config(stage: int, bf16: bool, world_size: int, **zero) -> dict:
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 2,
              "train_batch_size": MICRO * 2 * world_size,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
              # at stage 3 the biases persist (gathered data kept), the weights are released
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 12, **zero}}
    if bf16:
        config["bf16"] = {"enabled": True}
    return config


def _engine(stage: int, bf16: bool, **zero):
    torch.manual_seed(0)
    model = Net()
    config = _config(stage, bf16, torch.distributed.get_world_size(), **zero)
    engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                          if p.requires_grad], config=config)
    return engine


def _micro_step(engine, index: int) -> float:
    generator = torch.Generator().manual_seed(1000 * index + torch.distributed.get_rank())
    x = torch.randn(MICRO, IN, generator=generator)
    y = torch.randn(MICRO, OUT, generator=generator)
    dtype = next(engine.module.parameters()).dtype
    loss = torch.nn.functional.mse_loss(engine(x.to(dtype)).float(), y)
    engine.backward(loss)
    engine.step()
    return loss.item()


def _full_params(engine, stage: int) -> list[torch.Tensor]:
    params = list(engine.module.parameters())
    if stage == 3:
        with zerospeed.zero.GatheredParameters(params):
            return [p.detach().clone() for p in params]
    return [p.detach().clone() for p in params]


def _check_offloaded(engine, include):
    """Snapshot the listed storages, offload, check each moved and its old storage freed; the bytes
    freed and (tensor, old storage, its bytes) for each tensor moved."""
    kinds = ALL if include is None else include
    listed = engine.optimizer.offloadable_state_tensors()
    # the storage objects keep the device storages (not their bytes) reachable after the offload
    before = [(kind, t, t.untyped_storage(), t.untyped_storage().data_ptr()) for kind in kinds for t in listed[kind]]
    sizes = {ptr: old.nbytes() for _, _, old, ptr in before if old.nbytes() > 0}
    engine.offload_states(include=include)
    checked = 0
    for kind, tensor, old, ptr in before:
        if ptr not in sizes:
            continue
        assert old.nbytes() == 0, f"{kind.value}: the device storage was not freed"
        if kind is not OffloadStateTypeEnum.contiguous_grad_buffer:
            assert tensor.device.type == "cpu"
            assert tensor.untyped_storage().data_ptr() != ptr   # (malloc may reuse another freed one)
            assert tensor.untyped_storage().nbytes() == sizes[ptr]
        checked += 1
    assert checked >= len(sizes)
    return sum(sizes.values()), [(t, old, sizes[ptr]) for _, t, old, ptr in before if ptr in sizes]


def _check_reloaded(moved) -> None:
    """Back on the storage it left (resized to its bytes again), so views nobody listed see them too."""
    for tensor, old, nbytes in moved:
        assert old.nbytes() == nbytes
        assert tensor.untyped_storage().data_ptr() == old.data_ptr()


def _check_views_share_storage(engine, stage: int) -> None:
    optimizer = engine.optimizer
    if stage == 0:   # no flat buffers: each parameter has its own storage
        return
    if stage == 3:
        for flat, params in zip(optimizer.lp_flat, optimizer.fp16_groups):
            for param in params:
                assert param.ds_tensor.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        return
    for group in optimizer.groups:
        flat_storage = group.lp_flat.untyped_storage().data_ptr()
        assert group.lp_partition.untyped_storage().data_ptr() == flat_storage
        for param in group.params:
            assert param.untyped_storage().data_ptr() == flat_storage


def _run(stage: int, bf16: bool, offload: bool, non_blocking: bool, include) -> dict:
    engine = _engine(stage, bf16)
    losses, freed = [], []
    for index in range(STEPS * 2):
        losses.append(_micro_step(engine, index))
        if offload:   # after every micro-step: mid-accumulation too (gradients held)
            nbytes, moved = _check_offloaded(engine, include)
            freed.append(nbytes)
            engine.reload_states(non_blocking=non_blocking)
            _check_reloaded(moved)
            _check_views_share_storage(engine, stage)
    return {"losses": losses, "params": _full_params(engine, stage), "freed": freed}


def _compare_runs(stage: int, bf16: bool, non_blocking: bool, include) -> dict:
    plain = _run(stage, bf16, False, non_blocking, include)
    offloaded = _run(stage, bf16, True, non_blocking, include)
    assert offloaded["losses"] == plain["losses"]
    for ours, theirs in zip(offloaded["params"], plain["params"]):
        assert torch.equal(ours, theirs)
    return {"losses": plain["losses"], "freed": offloaded["freed"]}


@pytest.mark.parametrize("non_blocking", [False, True])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_offload_and_reload_every_step_trains_bit_for_bit(stage, bf16, non_blocking):
    results = run_on_ranks(_compare_runs, 2, stage, bf16, non_blocking, None)
    for result in results:
        assert all(freed > 0 for freed in result["freed"])
        assert len(set(result["losses"])) > 1   # it trained


def _partial(stage: int) -> dict:
    """Only the optimizer state: the parameters stay, an inference forward still runs; then only
    hp at fp32, whose storage is the lp flat buffer's, so the parameters move with it. The steps
    after the reload equal those of an engine that never offloaded."""
    plain = _engine(stage, False)
    plain_losses = [_micro_step(plain, i) for i in range(4)]
    engine = _engine(stage, False)
    losses = [_micro_step(engine, 0), _micro_step(engine, 1)]
    lp = engine.optimizer.lp_flat[0] if stage == 3 else engine.optimizer.groups[0].lp_flat
    before = lp.untyped_storage().data_ptr()
    engine.offload_states(include=[OffloadStateTypeEnum.optim_states])
    stays = lp.untyped_storage().nbytes() > 0 and lp.untyped_storage().data_ptr() == before
    with torch.no_grad():
        engine(torch.zeros(1, IN))
    engine.offload_states(include=["hp_params"])   # names as strings too
    states = sorted(s.value for s in engine._states_offloader.offloaded_states)
    moved_with_hp = lp.untyped_storage().data_ptr() != before
    engine.reload_states()
    losses += [_micro_step(engine, i) for i in range(2, 4)]
    return {"stays": stays, "states": states, "moved_with_hp": moved_with_hp, "losses": losses,
            "plain_losses": plain_losses}


@pytest.mark.parametrize("stage", [2, 3])
def test_offload_some_states_then_more_then_reload(stage):
    for result in run_on_ranks(_partial, 2, stage):
        assert result["stays"]
        assert result["states"] == ["hp_params", "optim_states"]
        assert result["moved_with_hp"]
        assert result["losses"] == result["plain_losses"]


def _errors() -> dict:
    found = {}

    def error(fn, *args, **kwargs):
        try:
            fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the type and message are the result
            return f"{type(exc).__name__}: {exc}"
        return None

    engine = _engine(2, False)
    _micro_step(engine, 0)
    found["nvme"] = error(engine.offload_states, device=OffloadDeviceEnum.nvme)
    found["unknown"] = error(engine.offload_states, include=["moments"])
    found["device"] = error(engine.offload_states, device="cuda")
    found["none"] = error(engine.offload_states, device=OffloadDeviceEnum.none)
    found["none_moved"] = engine._states_offloader.offloaded_states == set()
    engine.offload_states(include=[OffloadStateTypeEnum.lp_params])
    found["forward"] = error(engine, torch.zeros(1, IN))
    engine.reload_states()
    found["after"] = error(_micro_step, engine, 1)
    torch.manual_seed(0)
    config = _config(2, False, 1)
    del config["optimizer"]
    bare, _, _, _ = zerospeed.initialize(model=Net(), config=config)
    found["no_optimizer"] = error(bare.offload_states)
    found["no_optimizer_reload"] = error(bare.reload_states)
    params = _engine(3, False, offload_param={"device": "cpu"})
    found["offload_param"] = error(params.offload_states)
    return found


def test_errors_name_the_problem():
    found = run_on_ranks(_errors, 1)[0]
    assert found["nvme"] == "ValueError: NVMe offload is not supported for offloading states."
    assert "unknown state 'moments'" in found["unknown"] and "optim_states" in found["unknown"]
    assert found["device"].startswith("ValueError") and "OffloadDeviceEnum.cpu" in found["device"]
    assert found["none"] is None and found["none_moved"]
    assert found["forward"].startswith("RuntimeError") and "reload_states" in found["forward"]
    assert found["after"] is None
    assert "without an optimizer" in found["no_optimizer"]
    assert "without an optimizer" in found["no_optimizer_reload"]
    assert "offload_param" in found["offload_param"] and "offloaded parameters" in found["offload_param"]


def _with_optimizer_offload(stage: int) -> dict:
    """ZeRO-Offload keeps masters and optimizer state on the host already: those are left out
    (DeepSpeed's rule), the rest moves, and training continues bit for bit."""
    results = []
    for offload in (False, True):
        torch.manual_seed(0)
        engine = _engine(stage, True, offload_optimizer={"device": "cpu"})
        losses = []
        for index in range(4):
            losses.append(_micro_step(engine, index))
            if offload:
                engine.offload_states()
                results.append(sorted(s.value for s in engine._states_offloader.offloaded_states))
                engine.reload_states()
        results.append((losses, _full_params(engine, stage)))
    return {"states": results[1], "plain": results[0], "offloaded": results[-1]}


@pytest.mark.parametrize("stage", [2, 3])
def test_with_optimizer_offload_masters_and_moments_stay(stage):
    for result in run_on_ranks(_with_optimizer_offload, 2, stage):
        expected = ["contiguous_grad_buffer", "lp_params"] + ([] if stage == 3 else ["lp_grads"])
        assert result["states"] == sorted(expected)
        assert result["offloaded"][0] == result["plain"][0]
        assert all(torch.equal(a, b) for a, b in zip(result["offloaded"][1], result["plain"][1]))
