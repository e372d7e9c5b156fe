"""What our files record so DeepSpeed can resume from them, without DeepSpeed installed.

(Resuming with real DeepSpeed is tests/compat/test_checkpoint_interop.py.)
"""

import io
import pickle
import pickletools
import zipfile

import torch

from zerospeed.checkpoint.safe_enums import load_deepspeed_file
from zerospeed.checkpoint.deepspeed_compat import (DEEPSPEED_GLOBALS, DeepSpeedDynamicLossScaler,
                                                   DeepSpeedLossScaler,
                                                   save_with_deepspeed_names)
from zerospeed.checkpoint.deepspeed_format import stage0_for_deepspeed, stage0_from_deepspeed, zero_state_for_deepspeed


def _globals_in(buffer: bytes) -> set[str]:
    """Every class/function a torch.save'd file references (read from its pickle opcodes)."""
    with zipfile.ZipFile(io.BytesIO(buffer)) as archive:
        data = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    found = set()
    for opcode, arg, _ in pickletools.genops(data):
        if opcode.name == "GLOBAL":
            found.add(arg.replace(" ", "."))
    return found


def _zero2_state():
    return {"loss_scaler": {"cur_scale": 1.0, "dynamic": False}, "dynamic_loss_scale": False, "overflow": False,
            "clip_grad": 0.0, "zero_stage": 2, "partition_count": [2], "group_paddings": [0],
            "single_partition_of_fp32_groups": [torch.arange(4.0)],
            "base_optimizer_state": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(4)}},
                                     "param_groups": [{"lr": 0.1, "params": [0]}]},
            "param_slice_mappings": [{"w": {"numel": 4, "start": 0}}]}


def test_optim_file_names_deepspeed_classes_and_loads_back_plain(tmp_path):
    buffer = io.BytesIO()
    save_with_deepspeed_names({"optimizer_state_dict": zero_state_for_deepspeed(_zero2_state())}, buffer)
    names = _globals_in(buffer.getvalue())
    assert {"deepspeed.runtime.fp16.loss_scaler.LossScaler", "deepspeed.runtime.zero.config.ZeroStageEnum",
            "deepspeed.utils.tensor_fragment.fragment_address"} <= names
    assert not any(name.startswith("zerospeed") for name in names), names
    path = tmp_path / "optim.pt"
    path.write_bytes(buffer.getvalue())
    loaded = load_deepspeed_file(str(path))["optimizer_state_dict"]
    assert loaded["loss_scaler"] == {"cur_scale": 1.0, "dynamic": False}
    assert loaded["zero_stage"] == 2 and type(loaded["zero_stage"]) is int
    assert loaded["param_slice_mappings"] == [{"w": {"numel": 4, "start": 0}}]
    assert loaded["ds_version"] == "0.19.8"   # DeepSpeed's stage-1 loader refuses < 0.3.17
    assert torch.equal(loaded["base_optimizer_state"]["state"][0]["exp_avg"], torch.ones(4))


def test_weights_only_refuses_the_file_without_the_allowlist(tmp_path):
    path = tmp_path / "optim.pt"
    with open(path, "wb") as handle:
        save_with_deepspeed_names({"x": zero_state_for_deepspeed(_zero2_state())}, handle)
    try:
        torch.load(path, weights_only=True)
    except pickle.UnpicklingError as error:
        assert "deepspeed.runtime.fp16.loss_scaler.LossScaler" in str(error)
    else:
        raise AssertionError("weights_only load accepted an unlisted class")
    with torch.serialization.safe_globals(DEEPSPEED_GLOBALS):
        torch.load(path, weights_only=True)


def test_dynamic_loss_scaler_carries_every_attribute_deepspeed_reads():
    scaler = zero_state_for_deepspeed({"loss_scaler": {"cur_scale": 8.0, "dynamic": True, "cur_iter": 5,
                                                       "last_overflow_iter": 2, "scale_factor": 2.0,
                                                       "scale_window": 10, "min_scale": 1.0, "delayed_shift": 2,
                                                       "cur_hysteresis": 1, "consecutive_hysteresis": False}})
    scaler = scaler["loss_scaler"]
    assert isinstance(scaler, DeepSpeedDynamicLossScaler) and isinstance(scaler, DeepSpeedLossScaler)
    assert {"cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window", "min_scale",
            "delayed_shift", "cur_hysteresis", "consecutive_hysteresis", "raise_error_at_min_scale", "dynamic",
            "dtype"} <= set(vars(scaler))


def test_stage0_shapes_round_trip():
    w, b = torch.nn.Parameter(torch.ones(2, 3)), torch.nn.Parameter(torch.zeros(3))
    torch_state = {"state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.full((2, 3), 0.5)},
                             1: {"step": torch.tensor(1.0), "exp_avg": torch.full((3,), 0.25)}},
                   "param_groups": [{"lr": 0.1, "params": [0, 1]}]}
    bare = stage0_for_deepspeed({"optimizer_state_dict": torch_state, "loss_scaler": {"cur_scale": 1.0}}, [2])
    assert bare["state"] is torch_state["state"] and bare["param_groups"] is torch_state["param_groups"]
    assert stage0_from_deepspeed(bare, None, 0.0)["optimizer_state_dict"]["state"] is torch_state["state"]
    masters = [w.detach().float(), b.detach().float()]
    unfused = stage0_for_deepspeed({"optimizer_state_dict": torch_state, "fp32_groups": masters,
                                    "loss_scaler": {"cur_scale": 1.0, "dynamic": False}}, [2])
    assert unfused["cur_scale"] == 1.0 and unfused["fp32_groups"] == [masters]   # per group, as DeepSpeed's
    assert stage0_from_deepspeed(unfused, None, 0.0)["fp32_groups"] == masters
    fused = {"optimizer_state_dict": {"state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.arange(9.0)}},
                                      "param_groups": [{"lr": 0.1, "params": [0]}]},
             "fp32_groups_flat": [torch.arange(9.0)], "clip_grad": 1.0}
    ours = stage0_from_deepspeed(fused, [[w, b]], 0.0)
    assert [m.tolist() for m in ours["fp32_groups"]] == [[[0.0, 1, 2], [3, 4, 5]], [6.0, 7, 8]]
    assert ours["optimizer_state_dict"]["state"][1]["exp_avg"].tolist() == [6.0, 7, 8]
    assert ours["optimizer_state_dict"]["param_groups"][0]["params"] == [0, 1] and ours["clip_grad"] == 1.0
