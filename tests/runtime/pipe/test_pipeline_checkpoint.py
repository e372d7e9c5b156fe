"""Pipeline checkpoints: DeepSpeed's file layout, and resume continues bit for bit."""

import os

import pytest
import torch

import zerospeed
from distributed import run_on_ranks
from pipe_models import BASE_SEED, batches, lm_loss, micro_batches_of, tied_specs

MICRO, GAS = 2, 2


def _engine(num_stages, stage, scheduler=True, bf16=False):
    from zerospeed.pipe import PipelineModule

    dp = torch.distributed.get_world_size() // num_stages
    module = PipelineModule(tied_specs(2), num_stages=num_stages, loss_fn=lm_loss, seed_layers=True,
                            base_seed=BASE_SEED)
    config = {"train_batch_size": MICRO * GAS * dp, "train_micro_batch_size_per_gpu": MICRO,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": stage}}
    if bf16:
        config["bf16"] = {"enabled": True}
    if scheduler:
        config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_min_lr": 1e-3,
                                                                "warmup_max_lr": 1e-2}}
    engine, _, _, _ = zerospeed.initialize(model=module, config=config)
    return engine, dp


def _steps(engine, dp, data):
    dp_rank = engine.grid.get_data_parallel_rank()
    return [float(engine.train_batch(micro_batches_of(b, dp_rank, dp, MICRO, GAS))) for b in data]


def _save_then_continue(num_stages, stage, save_dir, bf16=False):
    engine, dp = _engine(num_stages, stage, bf16=bf16)
    data = batches("lm", 4, MICRO * GAS * dp)
    _steps(engine, dp, data[:2])
    engine.save_checkpoint(save_dir, client_state={"epoch": 3})
    saved = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    after = _steps(engine, dp, data[2:])
    return after, [p.detach().clone() for p in engine.module.parameters()], sorted(os.listdir(
        os.path.join(save_dir, "global_step2"))), saved


def _load_then_continue(num_stages, stage, save_dir, bf16=False):
    torch.manual_seed(99)  # a different init: everything must come from the checkpoint
    engine, dp = _engine(num_stages, stage, bf16=bf16)
    _, client = engine.load_checkpoint(save_dir)
    data = batches("lm", 4, MICRO * GAS * dp)
    after = _steps(engine, dp, data[2:])
    return after, [p.detach().clone() for p in engine.module.parameters()], client["epoch"], engine.global_steps


@pytest.mark.parametrize("world,num_stages,stage,bf16", [(2, 2, 0, False), (4, 2, 1, False), (4, 4, 1, True)])
def test_resume_from_a_pipeline_checkpoint_is_bit_for_bit(tmp_path, world, num_stages, stage, bf16):
    saved = run_on_ranks(_save_then_continue, world, num_stages, stage, str(tmp_path), bf16)
    resumed = run_on_ranks(_load_then_continue, world, num_stages, stage, str(tmp_path), bf16)
    for (losses, params, _files, _), (losses_r, params_r, epoch, steps) in zip(saved, resumed):
        assert losses == losses_r and epoch == 3 and steps == 4
        assert all(torch.equal(a, b) for a, b in zip(params, params_r))
    files = saved[0][2]
    # DeepSpeed's names: one file per layer with weights (layer 3's forward_fn use of the tied
    # embedding has none), one model-states file per stage, one optim file per stage and dp rank.
    assert {"layer_00-model_states.pt", "layer_01-model_states.pt", "layer_02-model_states.pt"} | {
        f"mp_rank_{s:02d}_model_states.pt" for s in range(num_stages)} <= set(files)
    assert not any(name.startswith("layer_03") for name in files)
    optim = sorted(name for name in files if name.endswith("optim_states.pt"))
    dp = world // num_stages
    prefix = "bf16_" if bf16 else ""
    assert optim == ([] if stage == 0 else sorted(f"{prefix}zero_pp_rank_{d}_mp_rank_{s:02d}_optim_states.pt"
                                                  for d in range(dp) for s in range(num_stages)))
    model_file = torch.load(tmp_path / "global_step2" / "mp_rank_01_model_states.pt", weights_only=True)
    assert model_file["module"] is None and model_file["mp_world_size"] == num_stages
    _check_zero_to_fp32(tmp_path, [result[3] for result in saved], bf16)


def _check_zero_to_fp32(save_dir, per_rank, bf16):
    """zero_to_fp32 of a pipeline checkpoint is the whole PipelineModule's state dict, fp32: with
    bf16 the masters from the optimizer files (which round to the saved bf16 weights), not those."""
    from zerospeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    merged = get_fp32_state_dict_from_zero_checkpoint(str(save_dir), tag="global_step2")
    expected = {name: value for rank_params in per_rank for name, value in rank_params.items()}
    assert list(merged) == ["tied_modules.embed.weight", "1.fc.weight", "1.fc.bias", "2.fc.weight", "2.fc.bias"]
    for name, value in expected.items():
        assert merged[name].dtype == torch.float32 and torch.equal(merged[name].to(value.dtype), value), name
    assert bf16 == any(not torch.equal(merged[name], value.float()) for name, value in expected.items())


def _weights_after_load(num_stages, save_dir):
    engine, _ = _engine(num_stages, 0, scheduler=False)
    engine.load_checkpoint(save_dir, load_optimizer_states=False)
    from pipe_models import pipeline_named_params

    return pipeline_named_params(engine.module)


def test_weights_load_under_another_stage_count(tmp_path):
    """Layer files are keyed by global layer index: 2-stage weights load into 1 stage."""
    saved = run_on_ranks(_save_then_continue, 2, 2, 0, str(tmp_path))
    del saved
    (two_a, two_b) = run_on_ranks(_weights_after_load, 2, 2, str(tmp_path))
    (one_a, one_b) = run_on_ranks(_weights_after_load, 2, 1, str(tmp_path))
    merged = {**two_a, **two_b}
    assert set(one_a) == set(merged)
    for name, value in one_a.items():
        assert torch.equal(value, merged[name]), name


def _load_only(num_stages, save_dir):
    engine, _ = _engine(num_stages, 0)
    engine.load_checkpoint(save_dir)


def test_a_corrupt_layer_file_is_named(tmp_path):
    """A pipeline load checks the manifest like every other load: a flipped byte in a layer file
    is refused by the file's name before any weight is used."""
    run_on_ranks(_save_then_continue, 2, 2, 0, str(tmp_path))
    layer_file = tmp_path / "global_step2" / "layer_01-model_states.pt"
    data = bytearray(layer_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    layer_file.write_bytes(bytes(data))
    with pytest.raises(Exception, match="layer_01-model_states.pt is corrupt"):
        run_on_ranks(_load_only, 2, 2, str(tmp_path))
