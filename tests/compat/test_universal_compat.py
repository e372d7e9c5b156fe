"""Universal checkpoints across DeepSpeed 0.19.8 and zerospeed, both ways (scripts/universal.py).

Each library trains stage 1, 2 and 3 (fp32, a WarmupDecayLR scheduler) on 2 ranks, saves, and
continues uninterrupted. Both libraries' `ds_to_universal` convert both libraries' checkpoints:
the four folders hold the same values (fp32, both Adam moments, step, param groups). Then
zerospeed resumes from the folder DeepSpeed converted from its own checkpoint, and DeepSpeed
from the one zerospeed converted from its own, each on 1 rank (another data-parallel size) with
`"checkpoint": {"load_universal": true}`: parameters, step, lr and scheduler after the load, and
the next losses and parameters, equal the writer's uninterrupted run at fp32 tolerance.
"""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from compat_compare import assert_close_lists
from compat_harness import REPO_ROOT, run_both, run_script

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "scripts", "universal.py")
RUNNER = os.path.join(HERE, "scripts", "universal_runner.py")
CASES = [{"stage": 1}, {"stage": 2}, {"stage": 3}]
NAMES = [f"stage{case['stage']}" for case in CASES]
STEPS, RESUME_STEPS = 3, 2
IMPLS = ("deepspeed", "zerospeed")


def _env(impl: str) -> dict[str, str]:
    from deepspeed_extensions import deepspeed_env

    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    if impl == "deepspeed":
        env.update(deepspeed_env())
    return env


def folder(root, converter: str, writer: str, name: str) -> str:
    return str(root / "uc" / f"{converter}-of-{writer}" / name / "universal")


@pytest.fixture(scope="module")
def runs(compat_root):
    root = compat_root / "universal"
    written = run_both(SCRIPT, str(root / "saved"), cases=CASES, steps=STEPS, resume_steps=RESUME_STEPS)

    def convert(converter: str) -> None:
        jobs = [{"input_folder": str(root / "saved" / writer / name / f"global_step{STEPS}"),
                 "output_folder": folder(root, converter, writer, name)} for writer in IMPLS for name in NAMES]
        path = str(root / f"jobs_{converter}.json")
        with open(path, "w") as handle:
            json.dump(jobs, handle)
        proc = subprocess.run([sys.executable, RUNNER, converter, path], env=_env(converter), capture_output=True,
                              text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(convert, IMPLS))
        loads = {impl: pool.submit(run_script, SCRIPT, impl, str(root / f"{impl}-loads"), world_size=1, cases=CASES,
                                   steps=STEPS, resume_steps=RESUME_STEPS,
                                   load_root=str(root / "uc" / f"{other}-of-{other}"))
                 for impl, other in (("zerospeed", "deepspeed"), ("deepspeed", "zerospeed"))}
        loaded = {impl: future.result() for impl, future in loads.items()}
    return {"root": root, "written": written, "loaded": loaded}


def _load(path: str):
    value = torch.load(path, weights_only=True)
    return value["param"] if isinstance(value, dict) else value


@pytest.mark.parametrize("writer", IMPLS)
@pytest.mark.parametrize("name", NAMES)
def test_both_converters_write_the_same_values(runs, name, writer):
    theirs_dir = folder(runs["root"], "deepspeed", writer, name)
    ours_dir = folder(runs["root"], "zerospeed", writer, name)
    theirs = {os.path.relpath(os.path.join(d, f), theirs_dir) for d, _, fs in os.walk(theirs_dir) for f in fs}
    ours = {os.path.relpath(os.path.join(d, f), ours_dir) for d, _, fs in os.walk(ours_dir) for f in fs}
    assert theirs <= ours, sorted(theirs - ours)
    extra = ours - theirs - {"zs_manifest.json"}
    assert all(path.endswith("/step.pt") for path in extra), sorted(extra)   # DeepSpeed's stage 3: none
    params = [path for path in theirs if path.startswith("zero/") and path != "zero/optimizer_state.pt"]
    assert {p.split("/")[-1] for p in params} >= {"fp32.pt", "exp_avg.pt", "exp_avg_sq.pt"}
    for path in params:
        a, b = _load(os.path.join(theirs_dir, path)), _load(os.path.join(ours_dir, path))
        assert torch.equal(torch.as_tensor(a).flatten(), torch.as_tensor(b).flatten()), f"{writer} {name} {path}"
    from zerospeed.checkpoint.manifest import load_file

    groups = [load_file(os.path.join(d, "zero", "optimizer_state.pt"))["param_groups"] for d in (theirs_dir, ours_dir)]
    assert [{k: v for k, v in g.items() if k != "params"} for g in groups[0]] == \
           [{k: v for k, v in g.items() if k != "params"} for g in groups[1]]


@pytest.mark.parametrize("loader,writer", [("zerospeed", "deepspeed"), ("deepspeed", "zerospeed")])
@pytest.mark.parametrize("name", NAMES)
def test_resume_from_the_other_librarys_universal_folder(runs, name, loader, writer):
    wrote, read = runs["written"][writer][0][name], runs["loaded"][loader][0][name]
    what = f"{loader} (1 rank) resuming {writer}'s {name} (2 ranks) through the universal format"
    assert "error" not in read, f"{what}: {read.get('error')}: {read.get('message')}"
    assert read["global_steps"] == STEPS and read["scheduler"] == wrote["scheduler"], what
    assert read["lr"] == pytest.approx(wrote["lr"], rel=1e-12), what
    assert read["params_saved"] == wrote["params_saved"], f"{what}: parameters after the load"
    for theirs, ours in zip(wrote["continued"], read["continued"]):
        assert_close_lists([theirs["loss"], theirs["lr"]], [ours["loss"], ours["lr"]], "fp32", what)
    for param, values in wrote["params"].items():
        assert_close_lists(values, read["params"][param], "fp32", f"{what} {param}")
