"""The offload placement decided once, without processes: which placement each config gives, and
where it puts each sub-group's (stage 3) or param group's (stages 1/2) master, gradient buffer and
base-optimizer params. The numbers these placements produce are tested end to end beside them
(test_offload.py, test_partial_offload.py, test_offload_param_nvme.py)."""

import types

import torch

from zerospeed.accelerator import get_accelerator
from zerospeed.ops.adam import DeepSpeedCPUAdam
from zerospeed.runtime.config import AioConfig
from zerospeed.runtime.zero.offload.group_placement import (GroupPlacement, OffloadGroupPlacement,
                                                            build_group_placement)
from zerospeed.runtime.zero.offload.offload_states import OffloadStates
from zerospeed.runtime.zero.offload.partition_home import (HostPartitions, NvmePartitions, PartitionHome,
                                                           build_partition_home)
from zerospeed.runtime.zero.offload.placement import DevicePlacement, OffloadPlacement, build_placement
from zerospeed.runtime.zero.offload_config import (DeepSpeedZeroOffloadOptimizerConfig,
                                                   DeepSpeedZeroOffloadParamConfig)

CPU = torch.device("cpu")
NUMEL = 40


def _zero_config(optimizer_block=None, param_block=None):
    return types.SimpleNamespace(offload_optimizer=optimizer_block, offload_param=param_block)


def _optimizer():
    return DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(1))], lr=1e-2)


def _holder(optimizer, block):
    return OffloadStates(optimizer, block, AioConfig(), NUMEL, "rank00")


def _place_sub_groups(placement, num_sub_groups, dtype=torch.float32):
    """Build `num_sub_groups` sub-groups of one param group as stage3.py does; (lps, masters, grads)."""
    lps, masters, grads = [], [], []
    for index in range(num_sub_groups):
        lp = placement.partitions.place(torch.arange(NUMEL, dtype=dtype))
        master = placement.master(index, lp)
        lps.append(lp)
        masters.append(master)
        grads.append(placement.grad_buffer(index, NUMEL, torch.float32, master.device))
    group = placement.optimizer.param_groups[0]
    placement.adopt(group, masters, 0)
    placement.finish()
    return lps, masters, grads


def test_partition_home_follows_offload_param(tmp_path):
    assert type(build_partition_home(None, AioConfig())) is PartitionHome
    assert type(build_partition_home(DeepSpeedZeroOffloadParamConfig(), AioConfig())) is PartitionHome
    host = build_partition_home(DeepSpeedZeroOffloadParamConfig(device="cpu"), AioConfig())
    assert type(host) is HostPartitions
    nvme = DeepSpeedZeroOffloadParamConfig(device="nvme", nvme_path=str(tmp_path))
    assert type(build_partition_home(nvme, AioConfig())) is NvmePartitions
    lp = torch.ones(NUMEL)
    placed = host.place(lp)
    assert placed.device.type == "cpu" and placed.data_ptr() != lp.data_ptr() and torch.equal(placed, lp)
    assert PartitionHome().place(lp) is lp


def test_without_offload_every_master_is_on_the_device():
    optimizer = _optimizer()
    placement = build_placement(optimizer, _zero_config(), None, AioConfig(), 3, CPU)
    assert type(placement) is DevicePlacement and placement.num_on_device == 3
    lps, masters, grads = _place_sub_groups(placement, 3)
    # fp32: the master is the partition itself ([Note: fp32 master sharing])
    assert all(m.data_ptr() == lp.data_ptr() for m, lp in zip(masters, lps))
    assert optimizer.param_groups[0]["params"] == masters and placement.device_optimizer is optimizer
    assert placement.subgroup_to_device(3) == {} and placement.sink is None
    bf16 = build_placement(_optimizer(), _zero_config(), None, AioConfig(), 1, CPU)
    lps, masters, _ = _place_sub_groups(bf16, 1, torch.bfloat16)
    assert masters[0].dtype == torch.float32 and masters[0].data_ptr() != lps[0].data_ptr()


def test_offload_param_alone_keeps_a_separate_device_master():
    block = DeepSpeedZeroOffloadParamConfig(device="cpu")
    placement = build_placement(_optimizer(), _zero_config(param_block=block), None, AioConfig(), 2, CPU)
    lps, masters, _ = _place_sub_groups(placement, 2)
    assert isinstance(placement.partitions, HostPartitions)
    assert all(m.data_ptr() != lp.data_ptr() and torch.equal(m, lp) for m, lp in zip(masters, lps))


def test_partial_offload_places_the_last_sub_groups_in_offload_states():
    optimizer = _optimizer()
    block = DeepSpeedZeroOffloadOptimizerConfig(device="cpu", ratio=0.5)
    holder = _holder(optimizer, block)
    placement = build_placement(optimizer, _zero_config(block), holder, AioConfig(), 4, CPU)
    assert type(placement) is OffloadPlacement and placement.num_on_device == 2
    lps, masters, grads = _place_sub_groups(placement, 4, torch.bfloat16)
    device = get_accelerator().device_name()
    assert placement.subgroup_to_device(4) == {0: device, 1: device, 2: "cpu", 3: "cpu"}
    # offloaded: a stand-in over the partition, the real master a unit of OffloadStates
    assert [placement.offloaded(k) for k in range(4)] == [False, False, True, True]
    assert [p.data_ptr() for p in holder.partitions] == [lp.data_ptr() for lp in lps[2:]]
    assert all(m.data_ptr() == lp.data_ptr() for m, lp in zip(masters[2:], lps[2:]))
    # kept on the device: a separate fp32 master, as without offload
    assert all(m.dtype == torch.float32 and m.data_ptr() != lp.data_ptr() for m, lp in zip(masters[:2], lps[:2]))
    assert optimizer.param_groups[0]["params"] == [unit.master for unit in holder.units]
    assert isinstance(placement.device_optimizer, torch.optim.AdamW)
    assert placement.device_optimizer.param_groups[0]["params"] == masters[:2]
    assert all(g.device.type == "cpu" for g in grads[2:])


def test_full_offload_has_no_device_optimizer():
    optimizer = _optimizer()
    block = DeepSpeedZeroOffloadOptimizerConfig(device="cpu")
    placement = build_placement(optimizer, _zero_config(block), _holder(optimizer, block), AioConfig(), 3, CPU)
    _, masters, _ = _place_sub_groups(placement, 3)
    assert placement.num_on_device == 0 and placement.device_optimizer is None
    assert placement.subgroup_to_device(3) == {k: "cpu" for k in range(3)}


def test_stage_1_and_2_group_placement():
    optimizer = _optimizer()
    device = build_group_placement(optimizer, _zero_config(), None)
    assert type(device) is GroupPlacement and device.comm_device is None and device.sink is None
    group = optimizer.param_groups[0]
    lp = torch.zeros(NUMEL)
    assert device.master(group, lp) is lp and group["params"] == [lp]
    bf16 = torch.zeros(NUMEL, dtype=torch.bfloat16)
    master = device.master(group, bf16)
    assert master.dtype == torch.float32 and group["params"] == [master]

    optimizer = _optimizer()
    block = DeepSpeedZeroOffloadOptimizerConfig(device="cpu")
    holder = _holder(optimizer, block)
    offload = build_group_placement(optimizer, _zero_config(block), holder)
    assert type(offload) is OffloadGroupPlacement and offload.comm_device is not None
    group = optimizer.param_groups[0]
    assert offload.master(group, lp) is lp
    assert group["params"] == [unit.master for unit in holder.units] and holder.partitions == [lp]
    accumulated = torch.zeros(2 * NUMEL).narrow(0, NUMEL, NUMEL)
    assert device.partition_grad(accumulated) is accumulated
    host = offload.partition_grad(accumulated)
    assert host.device.type == "cpu" and host.data_ptr() != accumulated.data_ptr()
