"""PEFT, TRL and Accelerate through the `deepspeed` alias, against real DeepSpeed 0.19.8 (2 gloo
ranks each, launched side by side): PEFT LoRA on a tiny Llama under ZeRO-3 (only adapter weights
trainable, the frozen base partitioned), TRL `SFTTrainer` at ZeRO-2, and a plain Accelerate loop
under `accelerate launch --use_deepspeed` (accelerate's own config path). Losses, learning rates
and saved weights equal DeepSpeed's."""

import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from client_runs import BIN, SCRIPTS, free_port, make_assets, read_json, run
from test_trainer import REFERENCE, ds_config

pytestmark = pytest.mark.timeout(1200)
PEFT_TRL = os.path.join(SCRIPTS, "peft_trl.py")
ACCELERATE_LOOP = os.path.join(SCRIPTS, "accelerate_loop.py")


def _torchrun(args: list[str], reference: bool) -> list[str]:
    return [os.path.join(BIN, "python"), "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "--master_port", str(free_port()), *([REFERENCE] if reference else []), *args]


def _accelerate(args: list[str], reference: bool) -> list[str]:
    return [os.path.join(BIN, "accelerate"), "launch", "--use_deepspeed", "--num_processes", "2", "--num_machines",
            "1", "--zero_stage", "2", "--gradient_accumulation_steps", "2", "--mixed_precision", "no",
            "--main_process_port", str(free_port()), *([REFERENCE] if reference else []), *args]


@pytest.fixture(scope="module")
def runs(alias_dir, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("clients"))
    assets = make_assets(root)
    configs = {}
    for stage in (2, 3):
        configs[stage] = os.path.join(root, f"ds_z{stage}.json")
        with open(configs[stage], "w") as handle:
            json.dump(ds_config(stage), handle)
    out = {f"{task}_{side}": os.path.join(root, f"{task}_{side}") for task in ("lora", "sft", "acc")
           for side in ("ds", "zs")}
    jobs = []
    for side, alias in (("ds", None), ("zs", alias_dir)):
        reference = alias is None
        for task, stage in (("lora", 3), ("sft", 2)):
            args = [PEFT_TRL, "--task", task, "--deepspeed", configs[stage], "--model", assets["model"],
                    "--text", assets["text"], "--output_dir", out[f"{task}_{side}"]]
            jobs.append((_torchrun(args, reference), alias))
        jobs.append((_accelerate([ACCELERATE_LOOP, "--output_dir", out[f"acc_{side}"]], reference), alias))
    with ThreadPoolExecutor(2) as pool:
        for future in [pool.submit(run, cmd, alias, root) for cmd, alias in jobs]:
            future.result()
    return out


def _assert_history(theirs: list[dict], ours: list[dict], what: str) -> None:
    assert len(theirs) == len(ours) == 3, what
    for a, b in zip(theirs, ours):
        for key in ("loss", "learning_rate", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-7), f"{what} step {a['step']} {key}"


def _assert_same_file(theirs: str, ours: str) -> None:
    from safetensors.torch import load_file

    a, b = load_file(theirs), load_file(ours)
    assert sorted(a) == sorted(b)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-6, atol=1e-6, msg=name)


def test_peft_lora_zero3_matches_deepspeed(runs):
    theirs, ours = read_json(os.path.join(runs["lora_ds"], "result.json")), read_json(os.path.join(runs["lora_zs"], "result.json"))
    assert ours["trainable"] == theirs["trainable"] and all("lora_" in n for n in ours["trainable"])
    assert ours["frozen_partitioned"] and theirs["frozen_partitioned"]
    _assert_history(theirs["history"], ours["history"], "LoRA ZeRO-3")
    _assert_same_file(os.path.join(runs["lora_ds"], "adapter_model.safetensors"),
                      os.path.join(runs["lora_zs"], "adapter_model.safetensors"))


def test_trl_sft_zero2_matches_deepspeed(runs):
    theirs, ours = read_json(os.path.join(runs["sft_ds"], "result.json")), read_json(os.path.join(runs["sft_zs"], "result.json"))
    _assert_history(theirs["history"], ours["history"], "SFT ZeRO-2")
    _assert_same_file(os.path.join(runs["sft_ds"], "model.safetensors"), os.path.join(runs["sft_zs"], "model.safetensors"))


def test_accelerate_launch_use_deepspeed_matches_deepspeed(runs):
    theirs, ours = read_json(os.path.join(runs["acc_ds"], "result.json")), read_json(os.path.join(runs["acc_zs"], "result.json"))
    assert theirs["engine"] == "deepspeed.runtime.engine.DeepSpeedEngine"
    assert ours["engine"] == "zerospeed.runtime.engine.DeepSpeedEngine"  # `deepspeed` was zerospeed
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-6, abs=1e-7)
    assert theirs["losses"][-1] != theirs["losses"][0]
    _assert_same_file(os.path.join(runs["acc_ds"], "model.safetensors"), os.path.join(runs["acc_zs"], "model.safetensors"))
