"""[Note: checkpoint contract] (checkpoint/contract.py): every optimizer wrapper answers
what the engine's save / load and `checkpoint/` ask, consistently, so neither asks the stage.

One `run_on_ranks` call builds every wrapper on 2 ranks (stages 0-3, bf16 at stage 1, optimizer
offload at stages 2 and 3, partial offload at stage 3), trains one step, and records its answers;
each is then checked against what the wrapper visibly holds (its state dict, the module's
parameters, the files a real save writes) and against DeepSpeed's file names."""

import os
import re

import pytest
import torch

import zerospeed
from distributed import run_on_ranks
from parity import global_batches, make_model, micro_batch
from zerospeed.checkpoint.full_state import FullOptimizerState
from zerospeed.checkpoint.layout import find_model_files
from zerospeed.checkpoint.manifest import load_file
from zerospeed.checkpoint.zero_checkpoint import discover, export_full_state
from zerospeed.runtime.base_optimizer import DeepSpeedOptimizer
from zerospeed.checkpoint.contract import CheckpointFiles, CheckpointLayout, NoOptimizer

GLOBAL_BATCH = 8
CPU_OFFLOAD = {"device": "cpu", "pin_memory": False}
CASES = {
    "stage0": (0, {}, {}),
    "stage0-bf16": (0, {"bf16": {"enabled": True}}, {}),
    "stage1-bf16": (1, {"bf16": {"enabled": True}}, {}),
    "stage2": (2, {}, {}),
    "stage2-offload": (2, {}, {"offload_optimizer": CPU_OFFLOAD}),
    "stage3": (3, {}, {}),
    "stage3-offload": (3, {}, {"offload_optimizer": CPU_OFFLOAD, "sub_group_size": 64}),
    "stage3-partial-offload": (3, {"bf16": {"enabled": True}},
                               {"offload_optimizer": {**CPU_OFFLOAD, "ratio": 0.5}, "sub_group_size": 64}),
}


def _engine(stage, precision, zero):
    config = {"train_batch_size": GLOBAL_BATCH, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero}, **precision}
    model = make_model()
    model.fc2.bias.requires_grad_(False)   # a frozen parameter: recorded apart at ZeRO
    engine, _, _, _ = zerospeed.initialize(model=model, config=config)
    x, y = micro_batch(global_batches(1, GLOBAL_BATCH)[0], 0, torch.distributed.get_rank(), GLOBAL_BATCH // 2, 2)
    dtype = next(p for p in engine.module.parameters()).dtype
    engine.backward(engine(x.to(dtype), y.to(dtype)))
    engine.step()
    return engine


def _masters(engine):
    """The fp32 masters the wrapper holds, whichever its layout (fp32 stage 0: the parameters)."""
    state = engine.optimizer.state_dict()
    for key in ("single_partition_of_fp32_groups", "fp32_flat_groups", "fp32_groups"):
        if key in state:
            return [t.float().clone() for t in state[key]]
    return [p.detach().float().clone() for p in engine.module.parameters() if p.requires_grad]


def _answers(engine, tmp_dir, name):
    wrapper, module = engine.optimizer, engine.module
    dp_rank = torch.distributed.get_rank()
    files = [wrapper.checkpoint_files(rank, 0) for rank in range(2)]
    frozen = wrapper.frozen_param_records(module)
    replicated = wrapper.replicated_state(engine.param_names)
    entry = wrapper.model_file_optimizer_state(engine.param_names)
    experts = [module.fc1.weight]
    with wrapper.gathered_parameters(experts):
        gathered = module.fc1.weight.detach().clone()
    try:
        consolidated = wrapper.consolidated_16bit_state_dict(module)
        consolidated_error = None
    except ValueError as error:
        consolidated, consolidated_error = None, str(error)
    state = wrapper.state_dict()
    before = _masters(engine)
    engine.save_checkpoint(tmp_dir, tag=name)
    tag_dir = os.path.join(tmp_dir, name)
    saved = discover(tag_dir, bf16_first=True)
    full = export_full_state(saved, load_file(find_model_files(tag_dir)[0]))
    wrapper.load_full_state(full, engine.param_names, load_optimizer_states=True)   # the resharded route
    after_full = _masters(engine)
    wrapper.load_full_state(FullOptimizerState(fp32=full.fp32), engine.param_names, load_optimizer_states=False)
    after_weights = _masters(engine)
    engine.destroy()
    return {
        "is_wrapper": isinstance(wrapper, DeepSpeedOptimizer),
        "files": files, "layout": wrapper.checkpoint_layout(), "saved_layout": saved.layout,
        "written": sorted(os.listdir(tag_dir)),
        "recorded_stage": int(state.get("zero_stage", 0)),
        "weights_in_optim": wrapper.weights_in_optimizer_files,
        "placeholders": all(p.numel() == 0 for p in module.parameters()),
        "gathered_full": tuple(gathered.shape) == (module.fc1.out_features, module.fc1.in_features),
        "gathered_equal": torch.equal(gathered, full.fp32["fc1.weight"].to(gathered.dtype)),   # lp = cast master
        "frozen": None if frozen is None else (dict(frozen[0]), sorted(frozen[1])),
        "replicated": None if replicated is None else (replicated.names, replicated.trainable, replicated.fp32_masters),
        "entry_names": None if entry is None else entry["param_names"],
        "consolidated_keys": None if consolidated is None else sorted(consolidated),
        "consolidated_error": consolidated_error,
        "full_names": sorted(full.fp32),
        "round_trip": all(torch.equal(a, b) for a, b in zip(before, after_full))
        and all(torch.equal(a, b) for a, b in zip(before, after_weights)),
        "hooks_left": sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in module.parameters())
        + sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in module.modules()),
        "low_precision": engine.bfloat16_enabled(), "dp_rank": dp_rank,
    }


def _every_wrapper(tmp_dir):
    return {name: _answers(_engine(*case), tmp_dir, name) for name, case in CASES.items()}


@pytest.fixture(scope="module")
def answers(tmp_path_factory):
    return run_on_ranks(_every_wrapper, 2, str(tmp_path_factory.mktemp("contract")), timeout_s=600)


TRAINABLE = sorted(n for n, _ in make_model().named_parameters() if n != "fc2.bias")


@pytest.mark.parametrize("name", list(CASES))
def test_every_wrapper_answers_the_checkpoint_contract(answers, name):
    stage = CASES[name][0]
    for rank, answer in enumerate(a[name] for a in answers):
        assert answer["is_wrapper"]
        replicated = answer["replicated"] is not None
        layout = answer["layout"]
        # the layout is what its files record, and what a save of it reads back as
        assert layout == CheckpointLayout(answer["recorded_stage"], 1 if replicated else 2) == answer["saved_layout"]
        assert layout.zero_stage == stage
        # files: the optimizer state is in the model file exactly when it is replicated
        for dp_rank, files in enumerate(answer["files"]):
            assert isinstance(files, CheckpointFiles)
            assert (files.optim_states is None) == replicated
            assert (files.model_states is not None) == (dp_rank == 0 or answer["weights_in_optim"])
            prefix = "bf16_" if answer["low_precision"] else ""
            if files.optim_states is not None:
                assert files.optim_states == f"{prefix}zero_pp_rank_{dp_rank}_mp_rank_00_optim_states.pt"
            if files.model_states is not None:
                assert files.model_states == (f"zero_pp_rank_{dp_rank}_mp_rank_00_model_states.pt"
                                              if answer["weights_in_optim"] else "mp_rank_00_model_states.pt")
        named = {f for files in answer["files"] for f in (files.model_states, files.optim_states) if f}
        assert sorted(named) == sorted(f for f in answer["written"] if f.endswith(".pt"))
        # where the weights live: only in the optim files when the module holds placeholders
        assert answer["weights_in_optim"] == answer["placeholders"] == (stage == 3)
        assert answer["gathered_full"] and answer["gathered_equal"]
        # replicated state names every base-optimizer tensor; the model-file entry carries the names
        if replicated:
            names, trainable, fp32_masters = answer["replicated"]
            flat = [n for group in names for n in group]
            assert sorted(n for n, t in zip(flat, [t for g in trainable for t in g]) if t) == TRAINABLE
            assert fp32_masters == answer["low_precision"] and answer["entry_names"] == names
            assert answer["frozen"] is None
        else:
            assert answer["entry_names"] is None
            shapes, fragments = answer["frozen"]
            assert shapes == {"fc2.bias": make_model().fc2.bias.shape} and fragments == ["fc2.bias"]
        # 16-bit state dict: consolidated where the weights are partitioned, DeepSpeed's error elsewhere
        if answer["weights_in_optim"]:
            assert answer["consolidated_error"] is None
            assert (answer["consolidated_keys"] is not None) == (rank == 0)
        else:
            assert "only applicable where weights are partitioned" in answer["consolidated_error"]
        assert answer["full_names"] == TRAINABLE and answer["round_trip"]
        assert answer["hooks_left"] == 0


def test_no_optimizer_writes_the_module_only():
    nothing = NoOptimizer()
    assert nothing.checkpoint_files(0, 1) == CheckpointFiles("mp_rank_01_model_states.pt", None)
    assert nothing.checkpoint_files(1, 0) == CheckpointFiles(None, None)
    assert nothing.checkpoint_layout() == CheckpointLayout(0, 1) and not nothing.weights_in_optimizer_files
    model = make_model()
    names = {p: n for n, p in model.named_parameters()}
    assert nothing.param_shapes(names) is None and nothing.model_file_optimizer_state(names) is None
    assert nothing.replicated_state(names) is None and nothing.frozen_param_records(model) is None
    nothing.load_full_state(FullOptimizerState(fp32={"fc1.bias": torch.full_like(model.fc1.bias, 3.0)}), names, True)
    assert torch.equal(model.fc1.bias, torch.full_like(model.fc1.bias, 3.0))
    assert re.fullmatch(r"mp_rank_\d\d_model_states\.pt", nothing.checkpoint_files(0, 0).model_states)
