"""TRL's trainers through the `deepspeed` alias against real DeepSpeed 0.19.8 (2 gloo ranks each,
the same script side by side, scripts/trl_rl.py): `SFTTrainer` at ZeRO-3 (ZeRO-2 is in
test_clients.py), `DPOTrainer` and `GRPOTrainer` (no vLLM: the policy generates, gathered once
under ZeRO-3 by TRL's `unwrap_model_for_generation`) at ZeRO-2 and ZeRO-3, each with the frozen
reference model TRL prepares itself (`deepspeed.initialize` without an optimizer; at ZeRO-3 built
under zero.Init). Per step: loss, grad norm, learning rate, rewards, KL, log-probs; and the saved
weights."""

import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from client_runs import SCRIPTS, make_assets, read_json, run
from test_clients import _assert_engines, _assert_same_file, _torchrun
from test_trainer import ds_config

pytestmark = pytest.mark.timeout(1200)
TRL_RL = os.path.join(SCRIPTS, "trl_rl.py")
CASES = [("sft", 3), ("dpo", 2), ("dpo", 3), ("grpo", 2), ("grpo", 3)]
NOT_COMPARED = {"step", "epoch", "step_time"}   # wall-clock, or the same by construction


def trl_config(stage: int) -> dict:
    """test_trainer's all-"auto" config without the scheduler block: the Trainer's linear schedule
    then trains from step 1 (DeepSpeed's WarmupDecayLR holds the learning rate at 0 for at least
    two steps), so the policy has left the reference model by steps 2 and 3 and DPO's rewards and
    GRPO's KL are not zero."""
    config = ds_config(stage)
    del config["scheduler"]
    return config


@pytest.fixture(scope="module")
def runs(alias_dir, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("trl"))
    assets = make_assets(root)
    configs = {}
    for stage in (2, 3):
        configs[stage] = os.path.join(root, f"ds_z{stage}.json")
        with open(configs[stage], "w") as handle:
            json.dump(trl_config(stage), handle)
    out, jobs = {}, []
    for side, alias in (("ds", None), ("zs", alias_dir)):
        for task, stage in CASES:
            out[(task, stage, side)] = os.path.join(root, f"{task}{stage}_{side}")
            args = [TRL_RL, "--task", task, "--deepspeed", configs[stage], "--model", assets["model"],
                    "--text", assets["text"], "--output_dir", out[(task, stage, side)]]
            jobs.append((_torchrun(args, alias is None), alias))
    with ThreadPoolExecutor(2) as pool:
        for future in [pool.submit(run, cmd, alias, root) for cmd, alias in jobs]:
            future.result()
    return out


@pytest.mark.parametrize("task,stage", CASES)
def test_trl_trainer_matches_deepspeed(runs, task, stage):
    theirs_dir, ours_dir = runs[(task, stage, "ds")], runs[(task, stage, "zs")]
    theirs, ours = read_json(os.path.join(theirs_dir, "result.json")), read_json(os.path.join(ours_dir, "result.json"))
    _assert_engines(theirs, ours)
    if task != "sft":   # TRL wrapped the frozen reference model in an engine without an optimizer
        assert theirs["ref_engine"] == "deepspeed.runtime.engine.DeepSpeedEngine"
        assert ours["ref_engine"] == "zerospeed.runtime.engine.DeepSpeedEngine"
    assert len(theirs["history"]) == len(ours["history"]) == 3
    for a, b in zip(theirs["history"], ours["history"]):
        assert sorted(a) == sorted(b)
        for key in sorted(set(a) - NOT_COMPARED):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), f"{task} ZeRO-{stage} step {a['step']} {key}"
    if task == "grpo":   # the policy learned something from non-trivial rewards
        assert any(e["reward_std"] > 0 for e in ours["history"]) and any(e["kl"] != 0 for e in ours["history"])
    if task == "dpo":
        assert ours["history"][-1]["rewards/margins"] != 0
    _assert_same_file(os.path.join(theirs_dir, "model.safetensors"), os.path.join(ours_dir, "model.safetensors"))
