"""Pipeline checkpoints through the universal format, side by side with DeepSpeed 0.19.8.

Each library trains the 2-stage pipeline of scripts/pipe.py (ZeRO-1, AdamW) on 2 CPU ranks and
saves. Both libraries' `ds_to_universal` (with `--inject_missing_state`: neither library's
pipeline writes `universal_checkpoint_info`, and DeepSpeed's converter refuses without it) convert
both libraries' checkpoints: the four folders hold the same parameters (every stage's, by global
layer index), each with the same fp32 value and Adam moments, bit for bit.
"""

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.compat
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "pipe.py")
IMPLS = ("deepspeed", "zerospeed")


def _convert(converter: str, tag_dir: str, output: str) -> None:
    from compat_harness import REPO_ROOT
    from deepspeed_extensions import deepspeed_env

    env = {**os.environ, "PYTHONPATH": REPO_ROOT, **(deepspeed_env() if converter == "deepspeed" else {})}
    proc = subprocess.run([sys.executable, "-m", f"{converter}.checkpoint.ds_to_universal", "--input_folder", tag_dir,
                           "--output_folder", output, "--inject_missing_state"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _values(folder: str) -> dict[str, torch.Tensor]:
    values = {}
    for name in os.listdir(os.path.join(folder, "zero")):
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            path = os.path.join(folder, "zero", name, f"{state}.pt")
            if os.path.exists(path):
                value = torch.load(path, weights_only=True)
                values[f"{name}/{state}"] = value["param"] if isinstance(value, dict) else value
    return values


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both libraries' 2-stage runs (2 steps, saved, 2 more), each converted by both converters."""
    from compat_harness import run_both

    root = tmp_path_factory.mktemp("universal_pipeline")
    written = run_both(SCRIPT, str(root), stage=1, steps=2, resume_steps=2)
    folders = {}
    for writer in IMPLS:
        tag_dir = str(root / writer / "ckpt" / "global_step2")
        for converter in IMPLS:
            folders[converter, writer] = str(root / "uc" / f"{converter}-of-{writer}" / "universal")
            _convert(converter, tag_dir, folders[converter, writer])
    return {"root": root, "written": written, "folders": folders}


def test_both_converters_write_the_same_pipeline_folders(runs) -> None:
    folders = runs["folders"]
    for writer in IMPLS:
        theirs, ours = _values(folders["deepspeed", writer]), _values(folders["zerospeed", writer])
        assert theirs.keys() == ours.keys() and len(theirs) == 3 * 6, sorted(theirs)   # 3 layers x (weight, bias)
        for key, value in theirs.items():
            assert torch.equal(ours[key], value), f"{writer}'s checkpoint: {key}"


@pytest.mark.parametrize("loader,writer", [("zerospeed", "deepspeed"), ("deepspeed", "zerospeed")])
def test_resume_the_other_librarys_pipeline_at_one_stage_through_universal(runs, loader, writer) -> None:
    """The writer's 2-stage checkpoint, converted by the writer's converter, resumed by the loader at
    1 stage on 1 rank (the same global batch): the next losses equal the writer's uninterrupted run."""
    from compat_compare import assert_close_lists
    from compat_harness import run_script

    load_dir = os.path.dirname(runs["folders"][writer, writer])   # holds latest_universal
    read = run_script(SCRIPT, loader, str(runs["root"] / f"{loader}-loads"), world_size=1, stage=1, steps=0,
                      load_from=load_dir, resume_steps=2, num_stages=1, universal=True)[0]
    continued = runs["written"][writer][0]["losses"][2:]
    assert read["global_steps"] == 4 and len(read["losses"]) == 2
    assert_close_lists(continued, read["losses"], "fp32", f"{loader} at 1 stage resuming {writer}'s 2 stages")
