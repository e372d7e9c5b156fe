"""`offload_optimizer.ratio < 1` at stage 3 (partial offload): the first sub-groups stay on the
device, stepped by torch's AdamW, the rest are offloaded; equal to the same run without offload.

Models, batches and the engine come from test_offload.py (DeepSpeedCPUAdam in every run). Its
native kernel agrees with torch's AdamW to 1-2 ulp (docs/ops.md) and its torch fallback bit for
bit, so the parity runs put the fallback in: any difference is then the offload machinery's.
With `sub_group_size` 100 each rank has 5 sub-groups: fc1.w, fc2.w, head.w (group 0), then
fc1.b + fc2.b and head.b (group 1, no weight decay).
"""

import contextlib
import copy
import os

import pytest
import torch
from distributed import run_on_ranks
from test_offload import WORLD_SIZE, _batches, _engine, _nvme, _params, _train

from zerospeed.ops import cpu_optimizer, torch_fallback
from zerospeed.ops.adagrad import DeepSpeedCPUAdagrad
from zerospeed.ops.adam import DeepSpeedCPUAdam
from zerospeed.runtime.config_utils import ConfigWarning
from zerospeed.runtime.zero.config import DeepSpeedZeroConfig
from zerospeed.runtime.zero.offload.host_memory_check import plan_host_bytes
from zerospeed.runtime.zero.offload.partial_offload import build_device_optimizer
from zerospeed.runtime.zero.sub_groups import num_sub_groups_on_device, offloaded_partition_numel

SUB_GROUP, NUM_SUB_GROUPS, NUM_STEPS = 100, 5, 6
# name: (dtype, offload device, ratio); "none" runs are the references
RUNS = {"none": ("fp32", None, 1.0), "cpu-0.5": ("fp32", "cpu", 0.5), "nvme-0.5": ("fp32", "nvme", 0.5),
        "cpu-0.25": ("fp32", "cpu", 0.25), "nvme-0.2": ("fp32", "nvme", 0.2), "cpu-0": ("fp32", "cpu", 0.0),
        "bf16-none": ("bf16", None, 1.0), "bf16-cpu-0.5": ("bf16", "cpu", 0.5),
        "bf16-nvme-0.5": ("bf16", "nvme", 0.5), "bf16-cpu-0": ("bf16", "cpu", 0.0)}


@contextlib.contextmanager
def _torch_fallback_kernels():
    real = cpu_optimizer.load_kernels
    cpu_optimizer.load_kernels = lambda builder: (torch_fallback, False)   # pooled worker: restored below
    try:
        yield
    finally:
        cpu_optimizer.load_kernels = real


def _offload(device, ratio, path):
    if device is None:
        return None
    return {**(_nvme(path) if device == "nvme" else {"device": "cpu"}), "ratio": ratio}


def _placement(optimizer):
    """(sub-groups, on the device, offloaded partitions, base-optimizer params == offloaded units,
    device masters are separate fp32 copies, offloaded masters are stand-ins for lp_flat)."""
    holder, n = optimizer.offload, optimizer.num_on_device
    same = [m.data_ptr() == lp.data_ptr() for m, lp in zip(optimizer.fp32_flat, optimizer.lp_flat)]
    base_params = sum(len(g["params"]) for g in optimizer.optimizer.param_groups)
    return (len(optimizer.fp32_flat), n, len(holder.partitions) if holder is not None else 0,
            holder is None or base_params == len(holder.units), not any(same[:n]), all(same[n:]))


def _partial_runs(tmp_path, names):
    results, batches = {}, _batches(NUM_STEPS)
    for name in names:
        dtype, device, ratio = RUNS[name]
        engine = _engine(3, _offload(device, ratio, os.path.join(tmp_path, name)), dtype, sub_group_size=SUB_GROUP)
        losses = _train(engine, batches, dtype)
        results[name] = (losses, _params(engine), _placement(engine.optimizer))
        engine.optimizer.close()
    return results


def _fallback_runs(tmp_path):
    with _torch_fallback_kernels():
        return _partial_runs(tmp_path, list(RUNS))


def test_partial_offload_equals_no_offload(tmp_path):
    for rank_results in run_on_ranks(_fallback_runs, WORLD_SIZE, str(tmp_path)):
        for name, (losses, params, placement) in rank_results.items():
            dtype, device, ratio = RUNS[name]
            on_device = int((1 - ratio) * NUM_SUB_GROUPS) if device is not None else NUM_SUB_GROUPS
            offloaded = NUM_SUB_GROUPS - on_device if device is not None else 0
            separate_masters = dtype == "bf16" or on_device == 0
            assert placement == (NUM_SUB_GROUPS, on_device, offloaded, True, separate_masters, True), name
            reference = rank_results["bf16-none" if dtype == "bf16" else "none"]
            assert losses == reference[0], name
            for key, value in reference[1].items():
                assert torch.equal(params[key], value), (name, key)


def _native_runs(tmp_path):
    return _partial_runs(tmp_path, ["none", "cpu-0.5"])


def test_partial_offload_with_native_cpu_adam_is_within_rounding(tmp_path):
    for rank_results in run_on_ranks(_native_runs, WORLD_SIZE, str(tmp_path)):
        (losses, params, _), (ref_losses, ref_params, _) = rank_results["cpu-0.5"], rank_results["none"]
        assert losses == pytest.approx(ref_losses, rel=1e-6)
        for key, value in ref_params.items():
            assert ((params[key] - value).abs() <= 1e-6 * (value.abs() + 1)).all(), key


def _state_equal(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_state_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_state_equal(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return torch.is_tensor(b) and torch.equal(a, b)
    return type(a) is type(b) and a == b


def _resume(tmp_path):
    """Ratio 0.5 trains 4 steps and saves; an engine without offload loads that checkpoint, saves
    it again at once (same state dict) and trains 3 steps; a ratio-0.5 engine on nvme loads the
    second checkpoint and trains the same 3 steps. Both equal the uninterrupted ratio-0.5 run."""
    batches, ckpt = _batches(7), os.path.join(tmp_path, "ckpt")
    engine = _engine(3, _offload("cpu", 0.5, None), sub_group_size=SUB_GROUP)
    _train(engine, batches[:4])
    engine.save_checkpoint(ckpt, tag="partial")
    saved = copy.deepcopy(engine.optimizer.state_dict())
    expected = _train(engine, batches[4:]), _params(engine)
    plain = _engine(3, None, sub_group_size=SUB_GROUP)
    plain.load_checkpoint(ckpt, tag="partial")
    same_layout = _state_equal(plain.optimizer.state_dict(), saved)
    plain.save_checkpoint(ckpt, tag="plain")
    outcomes = [_train(plain, batches[4:]), _params(plain)]
    partial = _engine(3, _offload("nvme", 0.5, os.path.join(tmp_path, "swap")), sub_group_size=SUB_GROUP)
    partial.load_checkpoint(ckpt, tag="plain")
    outcomes += [_train(partial, batches[4:]), _params(partial)]
    partial.optimizer.close()
    exact = [outcomes[i] == expected[0] and all(torch.equal(outcomes[i + 1][k], v) for k, v in expected[1].items())
             for i in (0, 2)]
    return same_layout, exact


def _resume_with_fallback(tmp_path):
    with _torch_fallback_kernels():
        return _resume(tmp_path)


def test_partial_offload_checkpoint_moves_to_and_from_no_offload(tmp_path):
    for same_layout, exact in run_on_ranks(_resume_with_fallback, WORLD_SIZE, str(tmp_path)):
        assert same_layout
        assert exact == [True, True]


# --- without processes ------------------------------------------------------------------------------
@pytest.mark.parametrize("num,ratio,expected", [
    (4, 0.5, 2), (4, 0.25, 3), (4, 0.0, 4), (4, 1.0, 0), (5, 0.5, 2), (5, 0.2, 4),
    (10, 0.7, 3), (10, 0.9, 0),     # DeepSpeed's float truncation: int(0.0999... * 10) == 0
])
def test_sub_groups_on_device_follow_deepspeeds_rounding(num, ratio, expected):
    assert num_sub_groups_on_device(num, ratio) == expected


def test_host_memory_check_counts_only_offloaded_sub_groups():
    numels = [[512, 4096, 128], [65]]     # sub_group_size 100: 4 sub-groups, the last two offloaded
    assert offloaded_partition_numel(numels, 100, 0.5) == 128 + 65
    assert offloaded_partition_numel(numels, 100, 1.0) == 512 + 4096 + 128 + 65
    zero = DeepSpeedZeroConfig(stage=3, offload_optimizer={"device": "cpu", "ratio": 0.5})
    assert plan_host_bytes(10**6, 2, zero, offloaded_numel=1000).needed_bytes == (4 + 8) * 1000


def test_device_optimizer_follows_the_cpu_optimizers_groups():
    masters = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    cpu = DeepSpeedCPUAdam([{"params": [torch.nn.Parameter(torch.ones(1))]},
                            {"params": [torch.nn.Parameter(torch.ones(1))], "weight_decay": 0.5}], lr=0.1)
    device = build_device_optimizer(cpu, [[masters[0]], [masters[1]]])
    assert type(device) is torch.optim.AdamW
    cpu.param_groups[1]["lr"] = 0.25          # what a scheduler does
    for master in masters:
        master.grad = torch.ones_like(master)
    device.step()
    assert [g["lr"] for g in device.param_groups] == [0.1, 0.25] and device.param_groups[1]["weight_decay"] == 0.5
    assert type(build_device_optimizer(DeepSpeedCPUAdam(masters, adamw_mode=False), [masters])) is torch.optim.Adam
    with pytest.raises(ValueError, match="offload_optimizer.ratio.*DeepSpeedCPUAdagrad"):
        build_device_optimizer(DeepSpeedCPUAdagrad(masters), [masters])
    with pytest.raises(ValueError, match="offload_optimizer.ratio.*bias_correction"):
        build_device_optimizer(DeepSpeedCPUAdam(masters, bias_correction=False), [masters])


def test_ratio_config_checks():
    with pytest.raises(ValueError, match="Partial offloading only supported for ZeRO Stage 3"):
        DeepSpeedZeroConfig(stage=2, offload_optimizer={"device": "cpu", "ratio": 0.5})
    with pytest.warns(ConfigWarning, match="ratio is ignored"):
        DeepSpeedZeroConfig(stage=3, offload_optimizer={"device": "none", "ratio": 0.5})
    with pytest.raises(ValueError, match="ratio < 1 is not supported with offload_param.device 'nvme'"):
        DeepSpeedZeroConfig(stage=3, offload_optimizer={"device": "cpu", "ratio": 0.5},
                            offload_param={"device": "nvme", "nvme_path": "/x"})
