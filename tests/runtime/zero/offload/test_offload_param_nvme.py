"""`offload_param: nvme` at stage 3: parameter partitions swapped to files, read ahead of their
gathers along the trace, written by the optimizer step; equal to the same run without offload.

Models and batches come from test_offload.py; `max_in_cpu: 0` so every sub-group is swapped
(DeepSpeed's default of 1e9 elements would keep these small models in host memory).
"""

import glob
import os

import torch
from distributed import run_on_ranks
from test_offload import NUM_STEPS, WORLD_SIZE, _batches, _engine, _nvme, _params, _train

import zerospeed
from zerospeed.runtime.zero.param_state import ZeroParamStatus

BUFFER_SIZE, BUFFER_COUNT = 5000, 2
# Gather prefetch one parameter ahead, so the read-ahead from disk has the rest of the trace to do.
SMALL_PREFETCH = {"prefetch_bucket_size": 1000}


def _param_nvme(path, max_in_cpu=0):
    return {"device": "nvme", "nvme_path": str(path), "buffer_count": BUFFER_COUNT, "buffer_size": BUFFER_SIZE,
            "max_in_cpu": max_in_cpu, "pin_memory": True}


def _swap_figures(engine):
    swapper = engine.optimizer.param_swapper
    params = engine.optimizer.parameter_offload.params
    swapped = [p for p in params if p.zs_state.swapped is not None]
    partition_bytes = sum(p.partition_numel() * p.element_size() for p in swapped)
    return {"swapped": len(swapped), "params": len(params), "file_bytes": swapper.file_bytes(),
            "partition_bytes": partition_bytes,
            "swapped_resident_numel": sum(p.zs_state.partition.numel() for p in swapped),
            "lp_in_ram_plus_on_disk": sum(t.numel() for t in engine.optimizer.lp_flat) +
            sum(p.partition_numel() for p in swapped),
            "lp_total": sum(p.partition_numel() for p in params),
            "peak_ahead": swapper.peak_ahead_numel, "budget": swapper.budget_numel,
            "final_location": {p.ds_tensor.final_location for p in swapped}}


def _runs(tmp_path, dtype):
    batches, results = _batches(NUM_STEPS), {}
    runs = {"none": (None, None),
            "cpu+param-nvme": ({"device": "cpu"}, _param_nvme(os.path.join(tmp_path, "p1"))),
            "nvme+param-nvme": (_nvme(os.path.join(tmp_path, "o2")), _param_nvme(os.path.join(tmp_path, "p2"))),
            "cpu+param-nvme-half-in-cpu": ({"device": "cpu"}, _param_nvme(os.path.join(tmp_path, "p3"), 9000)),
            # ZeRO-Infinity parameter offload alone: optimizer states stay on the compute device
            "param-nvme-alone": (None, _param_nvme(os.path.join(tmp_path, "p4")))}
    for name, (offload, offload_param) in runs.items():
        engine = _engine(3, offload, dtype, offload_param, **SMALL_PREFETCH)
        figures = _swap_figures(engine) if offload_param is not None else None
        if figures is not None:
            swap_dir = engine.optimizer.param_swapper.swap_dir
            figures["under_nvme_path"] = swap_dir.startswith(offload_param["nvme_path"] + os.sep)
        losses = _train(engine, batches, dtype)
        if figures is not None:
            figures["peak_ahead"] = engine.optimizer.param_swapper.peak_ahead_numel
        results[name] = (losses, _params(engine), figures)
        if offload_param is not None:
            swap_dir = engine.optimizer.param_swapper.swap_dir
            engine.optimizer.close()
            figures["dir_left"] = os.path.exists(swap_dir)
    return results


def _check_equal_to_no_offload(results):
    for rank_results in results:
        reference = rank_results["none"]
        for name, (losses, params, figures) in rank_results.items():
            if name == "none":
                continue
            assert losses == reference[0], name
            for key, value in reference[1].items():
                assert torch.equal(params[key], value), (name, key)
            assert figures["swapped_resident_numel"] == 0 and not figures["dir_left"], (name, figures)
            assert figures["lp_in_ram_plus_on_disk"] == figures["lp_total"], (name, figures)
            assert figures["peak_ahead"] <= figures["budget"], (name, figures)        # read-ahead is bounded
            assert figures["final_location"] == {"nvme"}, name
        everything = rank_results["cpu+param-nvme"][2]
        assert everything["swapped"] == everything["params"]          # max_in_cpu 0: every partition on disk
        assert everything["file_bytes"] == everything["partition_bytes"]
        assert everything["peak_ahead"] > 0                           # partitions were read ahead of gathers
        alone = rank_results["param-nvme-alone"][2]
        assert alone["swapped"] == alone["params"] and alone["file_bytes"] == alone["partition_bytes"]
        assert all(figures["under_nvme_path"] for _, _, figures in list(rank_results.values())[1:])
        part = rank_results["cpu+param-nvme-half-in-cpu"][2]
        assert 0 < part["swapped"] < part["params"]                   # the first sub-groups stay in RAM


def test_param_nvme_equals_no_offload_fp32(tmp_path):
    _check_equal_to_no_offload(run_on_ranks(_runs, WORLD_SIZE, str(tmp_path), "fp32"))


def test_param_nvme_equals_no_offload_bf16(tmp_path):
    _check_equal_to_no_offload(run_on_ranks(_runs, WORLD_SIZE, str(tmp_path), "bf16"))


def _resume(tmp_path):
    """4 steps with parameters on NVMe, save, 3 more; a fresh NVMe engine, one without offload and one
    with parameter offload alone load the checkpoint and train the same 3 steps."""
    batches = _batches(7)
    engine = _engine(3, {"device": "cpu"}, offload_param=_param_nvme(os.path.join(tmp_path, "a")))
    _train(engine, batches[:4])
    engine.save_checkpoint(os.path.join(tmp_path, "ckpt"), tag="t")
    expected = _train(engine, batches[4:]), _params(engine)
    engine.optimizer.close()
    outcomes = []
    for offload, offload_param in (({"device": "cpu"}, _param_nvme(os.path.join(tmp_path, "b"))), (None, None),
                                   (None, _param_nvme(os.path.join(tmp_path, "c")))):
        resumed = _engine(3, offload, offload_param=offload_param)
        resumed.load_checkpoint(os.path.join(tmp_path, "ckpt"), tag="t")
        got = _train(resumed, batches[4:]), _params(resumed)
        outcomes.append(got[0] == expected[0] and all(torch.equal(got[1][k], v) for k, v in expected[1].items()))
        resumed.optimizer.close()
    torch.distributed.barrier()  # the glob sees every rank's swap dir: wait until each rank has closed its own
    return outcomes, glob.glob(os.path.join(tmp_path, "[abc]", "zerospeed_offload", "*", "param", "*"))


def test_param_nvme_checkpoint_round_trip_is_exact(tmp_path):
    for outcomes, leftovers in run_on_ranks(_resume, WORLD_SIZE, str(tmp_path)):
        assert outcomes == [True, True, True]
        assert leftovers == []


def _edit_under_gathered(tmp_path):
    """GatheredParameters(modifier_rank=0) edits reach the swap files and every rank."""
    engine = _engine(3, {"device": "cpu"}, offload_param=_param_nvme(tmp_path))
    weight = engine.module.fc2.weight
    with zerospeed.zero.GatheredParameters([weight], modifier_rank=0):
        if torch.distributed.get_rank() == 0:
            weight.data.fill_(0.25)
    assert weight.zs_state.status is ZeroParamStatus.NOT_AVAILABLE and weight.zs_state.swapped is not None
    with zerospeed.zero.GatheredParameters([weight]):
        seen = weight.detach().clone()
    engine.optimizer.close()
    return bool((seen == 0.25).all())


def test_param_nvme_modifier_rank_edits_persist(tmp_path):
    assert run_on_ranks(_edit_under_gathered, WORLD_SIZE, str(tmp_path)) == [True, True]


def _param_cpu_alone():
    """`offload_param: cpu` without optimizer offload: partitions in host memory, masters and optimizer
    state on the compute device; equal to the run without offload."""
    batches = _batches(4)
    results = []
    for offload_param in (None, {"device": "cpu"}):
        engine = _engine(3, None, offload_param=offload_param)
        results.append((_train(engine, batches), _params(engine)))
    master_device = engine.optimizer.fp32_flat[0].device
    separate = engine.optimizer.fp32_flat[0].data_ptr() != engine.optimizer.lp_flat[0].data_ptr()
    return results, str(master_device), separate


def test_param_cpu_offload_alone_equals_no_offload():
    for results, master_device, separate in run_on_ranks(_param_cpu_alone, WORLD_SIZE):
        (reference_losses, reference_params), (losses, params) = results
        assert losses == reference_losses
        assert all(torch.equal(params[k], v) for k, v in reference_params.items())
        assert master_device == "cpu" and separate  # the compute device here; a copy, not the host partition
