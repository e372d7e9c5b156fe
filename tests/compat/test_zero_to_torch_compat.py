"""zero_to_torch / `convert_zero_checkpoint_to_state_dict(dtype=)` on both libraries' checkpoints.

DeepSpeed 0.19.8 copies `zero_to_torch.py` beside `zero_to_fp32.py` into every checkpoint; so does
zerospeed. On the checkpoints of the suite's shared run (conftest.py `saved_runs`), written by
either library, both libraries' converters write the same files holding the same tensors, bit
for bit, in fp16 and bf16 (pickle and safetensors); and each library's copied script runs from
the save directory on the other library's checkpoint (zerospeed's imports nothing from zerospeed).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from compat_cases import PRECISION_CASES, case_name
from compat_harness import REPO_ROOT

RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "convert_runner.py")
CASES = [case for case in PRECISION_CASES if case["stage"] >= 1]
WRITERS = ("deepspeed", "zerospeed")
OUTPUTS = [("fp16", False), ("bf16", True)]   # (dtype, safe_serialization)


def _env(impl: str) -> dict[str, str]:
    from deepspeed_extensions import deepspeed_env

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if impl == "deepspeed":
        env.update(deepspeed_env())
    elif impl == "zerospeed":
        env["PYTHONPATH"] = REPO_ROOT
    return env   # a copied script alone: only what it imports itself


def _read(output_dir: str) -> dict[str, torch.Tensor] | str:
    if os.path.exists(os.path.join(output_dir, "error.txt")):
        with open(os.path.join(output_dir, "error.txt")) as handle:
            return "error: " + handle.read()
    if os.path.exists(os.path.join(output_dir, "model.safetensors")):
        from safetensors.torch import load_file

        return load_file(os.path.join(output_dir, "model.safetensors"))
    return torch.load(os.path.join(output_dir, "pytorch_model.bin"), weights_only=True)


@pytest.fixture(scope="module")
def converted(saved_runs, compat_root):
    """{(converter, writer, case, dtype): tensors}: each library's converter in one interpreter."""
    jobs: dict[str, list[dict]] = {impl: [] for impl in WRITERS}
    keys = {}
    for converter in WRITERS:
        for writer in WRITERS:
            for case in CASES:
                for dtype, safe in OUTPUTS:
                    out = str(compat_root / "zero_to_torch" / converter / writer / case_name(case) / dtype)
                    jobs[converter].append({"checkpoint_dir": str(compat_root / "saved" / writer / case_name(case)),
                                            "output_dir": out, "dtype": dtype, "safe_serialization": safe})
                    keys[(converter, writer, case_name(case), dtype)] = out
    procs = []
    for impl in WRITERS:
        path = str(compat_root / f"zero_to_torch_jobs_{impl}.json")
        with open(path, "w") as handle:
            json.dump(jobs[impl], handle)
        procs.append(subprocess.run([sys.executable, RUNNER, impl, path], env=_env(impl), capture_output=True,
                                    text=True, timeout=900))
    for proc in procs:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {key: _read(out) for key, out in keys.items()}


@pytest.mark.parametrize("dtype", [dtype for dtype, _ in OUTPUTS])
@pytest.mark.parametrize("case", CASES, ids=case_name)
def test_both_converters_write_the_same_tensors(converted, case, dtype):
    for writer in WRITERS:
        theirs = converted[("deepspeed", writer, case_name(case), dtype)]
        ours = converted[("zerospeed", writer, case_name(case), dtype)]
        assert not isinstance(theirs, str) and not isinstance(ours, str), (writer, theirs, ours)
        assert sorted(theirs) == sorted(ours), writer
        for name, tensor in theirs.items():
            assert ours[name].dtype == tensor.dtype == getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[dtype])
            assert torch.equal(ours[name], tensor), f"{writer}'s {case_name(case)} {name} in {dtype}"


@pytest.mark.parametrize("script_writer,checkpoint_writer", [("deepspeed", "zerospeed"), ("zerospeed", "deepspeed")])
def test_copied_scripts_run_on_the_other_librarys_checkpoint(saved_runs, compat_root, converted,
                                                             script_writer, checkpoint_writer):
    """`python <save_dir>/zero_to_torch.py <other save_dir> <out> --dtype bf16`: the copy beside
    `latest` imports its sibling zero_to_fp32.py; zerospeed's runs without the repository on the path."""
    name = case_name({"stage": 3, "dtype": "bf16"})
    script = str(compat_root / "saved" / script_writer / name / "zero_to_torch.py")
    out = str(compat_root / "zero_to_torch_cli" / script_writer)
    proc = subprocess.run([sys.executable, script, str(compat_root / "saved" / checkpoint_writer / name), out,
                           "--dtype", "bf16"], env=_env("deepspeed" if script_writer == "deepspeed" else "none"),
                          cwd=str(compat_root), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    written = _read(out)
    expected = converted[("deepspeed", checkpoint_writer, name, "bf16")]
    assert sorted(written) == sorted(expected)
    for key, tensor in written.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, expected[key]), key
