"""`OffloadStates` on its own (no processes): unit-by-unit stepping, resident or swapped to files,
equals the base optimizer stepping whole partitions; state dicts round-trip; the memory check."""

import os
import types

import pytest
import torch

from zerospeed.ops.adam import DeepSpeedCPUAdam
from zerospeed.runtime.config import AioConfig
from zerospeed.runtime.zero.config import DeepSpeedZeroConfig
from zerospeed.runtime.zero.offload.host_memory_check import check_host_memory, plan_host_bytes
from zerospeed.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig
from zerospeed.runtime.zero.offload.offload_states import OffloadStates, plan_units

NUMELS, UNIT, STEPS = (5000, 2100), 1024, 4


def test_plan_units():
    assert plan_units(300, 128) == [(0, 128), (128, 128), (256, 44)]
    assert plan_units(5, 10) == [(0, 5)]
    assert plan_units(0, 10) == []


def _holder(device, tmp_path, dtype, buffer_count=2):
    torch.manual_seed(0)
    partitions = [torch.randn(n).to(dtype) for n in NUMELS]
    reference = [torch.nn.Parameter(p.float()) for p in partitions]
    ref_opt = DeepSpeedCPUAdam([{"params": [reference[0]]}, {"params": [reference[1]], "lr": 5e-3}],
                               lr=1e-2, weight_decay=0.1)
    opt = DeepSpeedCPUAdam([{"params": [torch.nn.Parameter(torch.zeros(1))]},
                            {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 5e-3}], lr=1e-2, weight_decay=0.1)
    block = DeepSpeedZeroOffloadOptimizerConfig(device=device, nvme_path=str(tmp_path), buffer_count=buffer_count)
    holder = OffloadStates(opt, block, AioConfig(block_size=1000), UNIT, "rank00")
    for group, partition in zip(opt.param_groups, partitions):
        group["params"] = holder.register(group, partition)
    return holder, partitions, reference, ref_opt


def _grads(seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=generator) for n in NUMELS]


def _step_both(holder, partitions, reference, ref_opt, seed):
    grads = _grads(seed)
    for param, grad in zip(reference, grads):
        param.grad = grad * 0.5
    ref_opt.step(fp16_param_groups=[[torch.empty_like(p, dtype=torch.bfloat16)] for p in reference]
                 if partitions[0].dtype == torch.bfloat16 else None)
    holder.step([g.clone() for g in grads], 0.5)


@pytest.mark.parametrize("device,dtype", [("cpu", torch.float32), ("nvme", torch.float32), ("nvme", torch.bfloat16)])
def test_unit_steps_equal_whole_partition(device, dtype, tmp_path):
    holder, partitions, reference, ref_opt = _holder(device, tmp_path, dtype)
    for step in range(STEPS):
        _step_both(holder, partitions, reference, ref_opt, step)
    for index, ref in enumerate(reference):
        assert torch.equal(holder.master_partition(index), ref.detach())
        assert torch.equal(partitions[index], ref.detach().to(dtype))
    ours, theirs = holder.optimizer_state_dict(), ref_opt.state_dict()
    assert ours["param_groups"] == theirs["param_groups"]
    for index in theirs["state"]:
        for key, value in theirs["state"][index].items():
            assert torch.equal(torch.as_tensor(ours["state"][index][key]), torch.as_tensor(value)), key
    if device == "nvme":
        swapper = holder.swapper
        state_bytes = sum(NUMELS) * 4 * 3
        assert holder.resident_state_bytes() == 0                        # all written back after the step
        assert 0 < holder.peak_resident_bytes <= swapper.staging_bytes < state_bytes
        assert swapper.file_bytes() >= state_bytes                       # the files hold the rest
        holder.close()
        assert not os.path.exists(swapper.swap_dir)


def test_nvme_state_dict_round_trip(tmp_path):
    holder, partitions, reference, ref_opt = _holder("nvme", tmp_path / "a", torch.float32, buffer_count=1)
    for step in range(2):
        _step_both(holder, partitions, reference, ref_opt, step)
    saved_state, saved_masters = holder.optimizer_state_dict(), [holder.master_partition(i) for i in range(2)]
    fresh, fresh_partitions, *_ = _holder("nvme", tmp_path / "b", torch.float32, buffer_count=3)
    fresh.load_optimizer_state_dict(saved_state)
    for index, master in enumerate(saved_masters):
        fresh.load_master_partition(index, master)
        assert torch.equal(fresh_partitions[index], master)
    for step in range(2, 4):
        _step_both(holder, partitions, reference, ref_opt, step)
        fresh.step(_grads(step), 0.5)
    for index in range(2):
        assert torch.equal(fresh.master_partition(index), holder.master_partition(index))
    holder.close()
    fresh.close()


def test_host_memory_check_names_the_numbers():
    zero = DeepSpeedZeroConfig(stage=2, offload_optimizer={"device": "cpu"})
    plan = plan_host_bytes(1_000_000_000, 2, zero, num_states=2, param_element_bytes=2, local_ranks=2)
    assert plan.needed_bytes == 2 * (4 + 8 + 2) * 500_000_000
    with pytest.raises(ValueError, match=r"needs 13\.039 GiB .* only 1\.000 GiB is available(.|\n)*nvme"):
        check_host_memory(plan, available_bytes=2**30)
    check_host_memory(plan, available_bytes=2**40)
    nvme = DeepSpeedZeroConfig(stage=3, sub_group_size=1000, offload_optimizer={"device": "nvme", "nvme_path": "/x"})
    assert plan_host_bytes(10**9, 2, nvme).needed_bytes == 4 * 4 * 3 * 1000
    check_host_memory(types.SimpleNamespace(per_rank_bytes={}, needed_bytes=0), available_bytes=0)


def test_swap_unit_numel_is_a_whole_stage3_sub_group_up_to_twice_sub_group_size():
    from zerospeed.runtime.zero.offload.host_memory_check import swap_unit_numel

    groups = [{"params": [torch.zeros(n) for n in (600, 600, 900, 100)]},
              {"params": [torch.zeros(3000), torch.zeros(10, requires_grad=False)]}]
    for param in groups[0]["params"] + groups[1]["params"][:1]:
        param.requires_grad_(True)
    # 2 ranks: partitions 300, 300, 450, 50 | 1500; sub_group_size 500 cuts [300, 300] [450, 50] | [1500]
    zero = DeepSpeedZeroConfig(stage=3, sub_group_size=500)
    assert swap_unit_numel(groups, zero, dp_world_size=2) == 1000              # 1500 capped at 2 x 500
    zero = DeepSpeedZeroConfig(stage=3, sub_group_size=800)                   # [300, 300, 450] [50] | [1500]
    assert swap_unit_numel(groups, zero, dp_world_size=2) == 1500
    assert swap_unit_numel(groups, DeepSpeedZeroConfig(stage=2, sub_group_size=800), dp_world_size=2) == 800


def test_host_memory_plan_counts_the_whole_partition_buffers():
    """Muon's whole-partition units have their own NVMe staging buffers ([Note: unit files]): one
    per unit up to buffer_count, each the largest unit times (1 + swapped states); states kept in
    memory count for every unit."""
    from zerospeed.runtime.zero.offload.host_memory_check import WholeUnits, whole_partition_numels

    nvme = DeepSpeedZeroConfig(stage=2, sub_group_size=1000,
                               offload_optimizer={"device": "nvme", "nvme_path": "/x", "buffer_count": 4})
    elementwise = 4 * 4 * 3 * 1000
    assert plan_host_bytes(10**6, 2, nvme, whole_units=WholeUnits([5000, 3000], 1)).needed_bytes == \
        elementwise + 2 * 4 * 2 * 5000
    assert plan_host_bytes(10**6, 2, nvme, whole_units=WholeUnits([5000, 3000], 0, 1)).needed_bytes == \
        elementwise + 2 * 4 * 1 * 5000 + 4 * 8000
    groups = [{"params": [torch.zeros(3000, requires_grad=True), torch.zeros(1001, requires_grad=True)]},
              {"params": [torch.zeros(10, requires_grad=True)]}]
    assert whole_partition_numels(groups, [True, False], nvme, dp_world_size=2) == [2001]
    stage3 = DeepSpeedZeroConfig(stage=3, sub_group_size=1000)
    assert whole_partition_numels(groups, [True, False], stage3, dp_world_size=2) == [1500, 501]


def test_whole_units_of_a_muon_optimizer():
    """Muon's groups are whole-partition units with the momentum in their files, or kept in memory."""
    from zerospeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
    from zerospeed.runtime.zero.offload.host_memory_check import whole_units_of

    matrices = [torch.nn.Parameter(torch.zeros(30, 20)), torch.nn.Parameter(torch.zeros(10, 10))]
    muon = MuonWithAuxAdam([{"params": matrices, "use_muon": True},
                            {"params": [torch.nn.Parameter(torch.zeros(7))], "use_muon": False}])
    zero = DeepSpeedZeroConfig(stage=2)
    units = whole_units_of(muon, zero, 2, ())
    assert (units.numels, units.num_swapped_states, units.num_kept_states) == ([350], 1, 0)
    kept = whole_units_of(muon, zero, 2, ("momentum_buffer",))
    assert (kept.num_swapped_states, kept.num_kept_states) == (0, 1)
    assert whole_units_of(DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(4))]), zero, 2, ()) is None
