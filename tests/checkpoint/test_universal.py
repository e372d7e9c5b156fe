"""Universal checkpoints inside zerospeed: convert, resume at another stage, crash safety, damage.

The cross-library side (DeepSpeed converts / loads) is tests/compat/test_universal_compat.py.
"""

import os
import shutil
import subprocess
import sys

import pytest
import torch

import zerospeed
from distributed import run_on_ranks
from parity import global_batches, make_model, micro_batch

from zerospeed.checkpoint.universal.convert import convert_to_universal

GLOBAL_BATCH, STEPS_BEFORE, STEPS_AFTER = 12, 3, 3
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def config_for(stage, world_size, universal=False):
    zero = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}
    cfg = {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world_size,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 4}},
           "zero_optimization": zero}
    return {**cfg, "checkpoint": {"load_universal": True}} if universal else cfg


def train(engine, batches):
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    losses = []
    for batch in batches:
        x, y = micro_batch(batch, 0, rank, GLOBAL_BATCH // world_size, world_size)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _save(stage, save_dir, steps=STEPS_BEFORE):
    batches = global_batches(STEPS_BEFORE + STEPS_AFTER, GLOBAL_BATCH)
    engine, _, _, _ = zerospeed.initialize(model=make_model(0), config=config_for(stage, 2))
    train(engine, batches[:steps])
    engine.save_checkpoint(save_dir)
    return train(engine, batches[STEPS_BEFORE:])


def _resume(stage, load_dir, resave_dir=None):
    batches = global_batches(STEPS_BEFORE + STEPS_AFTER, GLOBAL_BATCH)
    engine, _, _, _ = zerospeed.initialize(model=make_model(5), config=config_for(stage, 2, universal=True))
    try:
        path, _ = engine.load_checkpoint(load_dir)
    except Exception as error:  # noqa: BLE001 - the message is the result
        return f"{type(error).__name__}: {error}"
    if resave_dir is not None:   # what was loaded, in an ordinary checkpoint
        engine.save_checkpoint(resave_dir)
    return engine.global_steps, os.path.basename(os.path.dirname(path)), train(engine, batches[STEPS_BEFORE:])


def _convert(save_dir, output, env=None):
    """The CLI, as a user runs it, in its own process (a crash test kills it)."""
    args = [sys.executable, "-m", "zerospeed.checkpoint.ds_to_universal", "--input_folder",
            os.path.join(save_dir, f"global_step{STEPS_BEFORE}"), "--output_folder", output, "--inject_missing_state"]
    return subprocess.run(args, env={**os.environ, "PYTHONPATH": REPO, **(env or {})}, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{stage: (save_dir, losses of the uninterrupted run)} at 2 ranks."""
    root = tmp_path_factory.mktemp("universal")
    return {stage: (str(root / f"z{stage}"), run_on_ranks(_save, 2, stage, str(root / f"z{stage}"))[0])
            for stage in (1, 3)}


@pytest.mark.parametrize("saved_stage,loaded_stage", [(1, 3), (3, 2), (3, 3)])
def test_resume_from_a_universal_folder_at_another_stage(saved, tmp_path, saved_stage, loaded_stage):
    save_dir, expected = saved[saved_stage]
    proc = _convert(save_dir, str(tmp_path / "uc" / "universal"))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "uc" / "latest_universal").read_text() == "universal"
    resave = str(tmp_path / "resaved")
    result = run_on_ranks(_resume, 2, loaded_stage, str(tmp_path / "uc"), resave)[0]
    assert not isinstance(result, str), result   # the load's error
    steps, folder, resumed = result
    assert (steps, folder) == (STEPS_BEFORE, "universal")
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(expected), rtol=1e-5, atol=1e-7)
    # fp32 masters, both Adam moments and the step after the load: exactly the saved ones
    saved_state, loaded_state = (_full_state(os.path.join(d, f"global_step{STEPS_BEFORE}")) for d in (save_dir, resave))
    assert sorted(loaded_state.fp32) == sorted(saved_state.fp32)
    for name, value in saved_state.fp32.items():
        assert torch.equal(loaded_state.fp32[name], value), name
        assert sorted(loaded_state.moments[name]) == ["exp_avg", "exp_avg_sq"]
        for key, moment in saved_state.moments[name].items():
            assert torch.equal(loaded_state.moments[name][key], moment), (name, key)
        assert int(loaded_state.scalars[name]["step"]) == int(saved_state.scalars[name]["step"]) == STEPS_BEFORE
    assert loaded_state.param_groups == saved_state.param_groups


def _full_state(tag_dir):
    from zerospeed.checkpoint.layout import find_model_files
    from zerospeed.checkpoint.manifest import load_file
    from zerospeed.checkpoint.zero_checkpoint import discover, export_full_state

    return export_full_state(discover(tag_dir, bf16_first=False), load_file(find_model_files(tag_dir)[0]))


@pytest.mark.parametrize("point", ["universal_mid_params", "universal_before_rename", "universal_before_latest"])
def test_a_killed_conversion_never_leaves_latest_universal_on_a_partial_folder(saved, tmp_path, point):
    save_dir, expected = saved[3]
    output = str(tmp_path / "uc" / "universal")
    first = _convert(save_dir, output, {"ZEROSPEED_CHECKPOINT_CRASH_AT": point})
    assert first.returncode == -9, first.stderr   # SIGKILL at the point
    latest = tmp_path / "uc" / "latest_universal"
    if point == "universal_before_latest":   # the folder is complete; latest_universal not yet written
        assert not latest.exists() and os.path.isdir(output)
    else:
        assert not latest.exists() and not os.path.exists(output)
    assert _convert(save_dir, output).returncode == 0
    again = _convert(save_dir, output, {"ZEROSPEED_CHECKPOINT_CRASH_AT": point})   # over a complete folder
    assert again.returncode == -9
    assert latest.read_text() == "universal" and os.path.isdir(output)
    steps, _, resumed = run_on_ranks(_resume, 2, 3, str(tmp_path / "uc"))[0]
    assert steps == STEPS_BEFORE
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(expected), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_universal_file_is_refused_naming_it(saved, tmp_path, damage):
    save_dir, _ = saved[1]
    assert _convert(save_dir, str(tmp_path / "uc" / "universal")).returncode == 0
    victim = tmp_path / "uc" / "universal" / "zero" / "fc1.weight" / "exp_avg_sq.pt"
    data = bytearray(victim.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    message = run_on_ranks(_resume, 2, 1, str(tmp_path / "uc"))[0]
    assert isinstance(message, str) and message.startswith("CheckpointIntegrityError"), message
    assert str(victim) in message and ("truncated" if damage == "truncate" else "corrupt") in message


def test_refusals_name_what_is_wrong(saved, tmp_path):
    save_dir, _ = saved[1]
    tag_dir = os.path.join(save_dir, f"global_step{STEPS_BEFORE}")
    with pytest.raises(ValueError, match="universal_checkpoint_info.*--inject_missing_state"):
        convert_to_universal(tag_dir, str(tmp_path / "out" / "universal"))
    assert not os.path.exists(tmp_path / "out" / "universal")
    message = run_on_ranks(_resume, 2, 1, str(tmp_path))[0]   # no latest_universal there
    assert message.startswith("ValueError: Invalid for universal checkpoint") and "latest_universal" in message


@pytest.mark.parametrize("stage", [1, 3])
def test_streaming_in_chunks_writes_what_one_pass_writes(saved, tmp_path, stage):
    """[Note: streaming conversion]: one parameter per chunk (every optim file re-opened each
    time) gives the same files' values as the whole model in one chunk."""
    save_dir, _ = saved[stage]
    tag_dir = os.path.join(save_dir, f"global_step{STEPS_BEFORE}")
    convert_to_universal(tag_dir, str(tmp_path / "a" / "universal"), inject_missing_state=True, chunk_bytes=1)
    convert_to_universal(tag_dir, str(tmp_path / "b" / "universal"), inject_missing_state=True)
    zero_a, zero_b = tmp_path / "a" / "universal" / "zero", tmp_path / "b" / "universal" / "zero"
    names = sorted(os.listdir(zero_b))
    assert sorted(os.listdir(zero_a)) == names and "fc1.weight" in names
    for name in names:
        if name == "optimizer_state.pt":
            continue
        files = sorted(os.listdir(zero_b / name))
        assert files == sorted(os.listdir(zero_a / name)) == ["exp_avg.pt", "exp_avg_sq.pt", "fp32.pt", "step.pt"]
        for file in files:
            a = torch.load(zero_a / name / file, weights_only=True)
            b = torch.load(zero_b / name / file, weights_only=True)
            a, b = (a["param"], b["param"]) if isinstance(a, dict) else (a, b)
            assert torch.equal(a, b), (name, file)


def _altered_copy(tag_dir, target, **model_state_changes):
    """The tag directory copied without its manifest, its model-states file changed."""
    shutil.copytree(tag_dir, target)
    os.remove(os.path.join(target, "zs_manifest.json"))
    path = os.path.join(target, "mp_rank_00_model_states.pt")
    torch.save({**torch.load(path, weights_only=False), **model_state_changes}, path)
    return str(target)


def test_layouts_not_converted_are_refused_by_name(saved, tmp_path):
    """docs/checkpointing.md, the resharding matrix: what the converter cannot convert it names."""
    tag_dir = os.path.join(saved[1][0], f"global_step{STEPS_BEFORE}")
    megatron_tp = _altered_copy(tag_dir, tmp_path / "tp", mp_world_size=2)
    with pytest.raises(NotImplementedError, match="tensor-parallel checkpoint .mp_world_size 2. without .*autotp_shards"):
        convert_to_universal(megatron_tp, str(tmp_path / "out_tp"), inject_missing_state=True)
    deepspeed_moe = _altered_copy(tag_dir, tmp_path / "moe")
    shutil.copyfile(os.path.join(deepspeed_moe, "mp_rank_00_model_states.pt"),
                    os.path.join(deepspeed_moe, "layer_0_expert_0_mp_rank_00_model_states.pt"))
    with pytest.raises(NotImplementedError, match="MoE expert files without .*zs_moe_ep_sizes"):
        convert_to_universal(deepspeed_moe, str(tmp_path / "out_moe"), inject_missing_state=True)
    assert not os.path.exists(tmp_path / "out_tp") and not os.path.exists(tmp_path / "out_moe")
