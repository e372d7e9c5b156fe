"""transformers `Trainer` through the `deepspeed` alias, against real DeepSpeed 0.19.8.

One unmodified run_clm-style script (scripts/run_clm.py) with an all-"auto" ds_config, gradient
accumulation, a WarmupDecayLR scheduler and `save_steps`, on 2 gloo ranks. zerospeed's side is
launched by the alias's `deepspeed --num_gpus 2` command (the issue's acceptance run); the
reference by torchrun. Per stage (2, 3):
- train 4 steps from `from_pretrained` (under ZeRO-3: inside `zero.Init`): losses, grad norms and
  learning rates equal DeepSpeed's; the final `model.safetensors` loads with plain transformers
  (no zerospeed) and equals DeepSpeed's;
- resume from step 2 (stage 2: from the checkpoint DeepSpeed wrote; stage 3: from our own, with
  the model built by `from_config` under `zero.Init`): steps 3-4 equal DeepSpeed's uninterrupted run.
"""

import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from client_runs import BIN, SCRIPTS, free_port, make_assets, read_json, run

STEPS, SAVE_STEPS = 4, 2
RUN_CLM = os.path.join(SCRIPTS, "run_clm.py")
REFERENCE = os.path.join(SCRIPTS, "ds_reference.py")
CONFIG_OVERRIDES = ("vocab_size=93,hidden_size=32,intermediate_size=64,num_hidden_layers=2,num_attention_heads=4,"
                    "num_key_value_heads=2,head_dim=8,max_position_embeddings=64")  # head_dim: set at __init__, not derived later


def ds_config(stage: int) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": "auto"}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size="auto", stage3_param_persistence_threshold="auto",
                    stage3_gather_16bit_weights_on_model_save=True)
    return {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto", "torch_adam": True}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                          "warmup_num_steps": "auto", "total_num_steps": "auto"}},
        "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
        "zero_optimization": zero,
    }


def script_args(assets: dict, config: str, output_dir: str, model: list[str], resume: str | None = None) -> list[str]:
    args = [RUN_CLM, "--deepspeed", config, "--output_dir", output_dir, *model,
            "--tokenizer_name", assets["tokenizer"], "--train_file", assets["text"], "--block_size", "16",
            "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--learning_rate", "1e-2",
            "--warmup_steps", "1", "--max_steps", str(STEPS), "--save_steps", str(SAVE_STEPS),
            "--logging_steps", "1", "--seed", "7", "--report_to", "none", "--use_cpu", "--weight_decay", "0.01",
            "--max_grad_norm", "0.5"]
    return args + (["--resume_from_checkpoint", resume] if resume else [])


def torchrun(args: list[str]) -> list[str]:
    return [os.path.join(BIN, "python"), "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "--master_port", str(free_port()), REFERENCE, *args]


def zerospeed_launcher(alias: str, args: list[str]) -> list[str]:
    return [os.path.join(alias, "bin", "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), *args]


def history(output_dir: str) -> list[dict]:
    return [entry for entry in read_json(os.path.join(output_dir, "trainer_state.json"))["log_history"]
            if "loss" in entry]


pytestmark = pytest.mark.timeout(1200)  # six 2-rank launches of transformers, on 2 shared cores


@pytest.fixture(scope="module")
def runs(alias_dir, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("trainer"))
    assets = make_assets(root)
    pretrained = ["--model_name_or_path", assets["model"]]
    from_config = ["--model_type", "llama", "--config_overrides", CONFIG_OVERRIDES]
    out = {}
    for stage in (2, 3):
        config = os.path.join(root, f"ds_z{stage}.json")
        with open(config, "w") as handle:
            json.dump(ds_config(stage), handle)
        out[stage] = {side: os.path.join(root, f"{side}{stage}") for side in ("ds", "zs", "zs_resumed")}
        out[stage]["config"] = config
    with ThreadPoolExecutor(2) as pool:  # the two libraries side by side: start-up overlaps
        first = [pool.submit(run, torchrun(script_args(assets, out[s]["config"], out[s]["ds"], pretrained)), None, root)
                 for s in (2, 3)]
        first += [pool.submit(run, zerospeed_launcher(alias_dir, script_args(
            assets, out[s]["config"], out[s]["zs"], pretrained)), alias_dir, root) for s in (2, 3)]
        for future in first:
            future.result()
        resumes = {2: os.path.join(out[2]["ds"], f"checkpoint-{SAVE_STEPS}"),
                   3: os.path.join(out[3]["zs"], f"checkpoint-{SAVE_STEPS}")}
        second = [pool.submit(run, zerospeed_launcher(alias_dir, script_args(
            assets, out[s]["config"], out[s]["zs_resumed"], from_config if s == 3 else pretrained, resumes[s])),
            alias_dir, root) for s in (2, 3)]
        for future in second:
            future.result()
    return out


def assert_history_equal(theirs: list[dict], ours: list[dict], what: str) -> None:
    assert [e["step"] for e in theirs] == [e["step"] for e in ours], what
    for a, b in zip(theirs, ours):
        for key in ("loss", "grad_norm", "learning_rate"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-7), f"{what} step {a['step']} {key}"


@pytest.mark.parametrize("stage", [2, 3])
def test_training_matches_deepspeed(runs, stage):
    theirs, ours = history(runs[stage]["ds"]), history(runs[stage]["zs"])
    assert len(theirs) == STEPS
    assert_history_equal(theirs, ours, f"ZeRO-{stage} training")
    assert theirs[-1]["loss"] != theirs[0]["loss"]  # it trained
    for side in ("ds", "zs"):  # DeepSpeed's checkpoint layout: the engine, not DDP, trained
        for step in (SAVE_STEPS, STEPS):
            assert os.path.isdir(os.path.join(runs[stage][side], f"checkpoint-{step}", f"global_step{step}"))


@pytest.mark.parametrize("stage", [2, 3])
def test_resume_matches_uninterrupted_deepspeed_run(runs, stage):
    # The resumed run's log carries steps 1..SAVE_STEPS over from the checkpoint's trainer_state.
    theirs = [e for e in history(runs[stage]["ds"]) if e["step"] > SAVE_STEPS]
    ours = [e for e in history(runs[stage]["zs_resumed"]) if e["step"] > SAVE_STEPS]
    assert len(ours) == STEPS - SAVE_STEPS
    assert_history_equal(theirs, ours, f"ZeRO-{stage} resumed")


@pytest.mark.parametrize("stage", [2, 3])
def test_saved_model_loads_without_zerospeed_and_equals_deepspeeds(runs, stage):
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    theirs = load_file(os.path.join(runs[stage]["ds"], "model.safetensors"))
    for side in ("zs", "zs_resumed"):
        ours = load_file(os.path.join(runs[stage][side], "model.safetensors"))
        assert sorted(ours) == sorted(theirs)
        for name, tensor in theirs.items():
            torch.testing.assert_close(ours[name], tensor, rtol=1e-6, atol=1e-6, msg=f"{side} {name}")
    model = LlamaForCausalLM.from_pretrained(runs[stage]["zs"])
    torch.testing.assert_close(model.model.embed_tokens.weight.detach(), theirs["model.embed_tokens.weight"])


@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoint_dir_holds_every_file_deepspeeds_holds(runs, stage):
    """The HF checkpoint directory written through the alias holds every file DeepSpeed's holds:
    `zero_to_fp32.py` and `zero_to_torch.py` beside `latest` included. Ours adds the tag
    directory's integrity manifest (docs/compatibility.md)."""
    def names(side: str) -> set[str]:
        root = os.path.join(runs[stage][side], f"checkpoint-{SAVE_STEPS}")
        return {os.path.relpath(os.path.join(folder, name), root)
                for folder, _, files in os.walk(root) for name in files}

    theirs, ours = names("ds"), names("zs")
    assert {"zero_to_fp32.py", "zero_to_torch.py"} <= theirs
    assert theirs <= ours, f"missing from zerospeed's checkpoint: {sorted(theirs - ours)}"
    assert ours - theirs <= {f"global_step{SAVE_STEPS}/zs_manifest.json"}, sorted(ours - theirs)
