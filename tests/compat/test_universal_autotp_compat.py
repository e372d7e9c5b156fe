"""AutoTP checkpoints through the universal format, side by side with DeepSpeed 0.19.8.

Each library trains the same tiny Llama at tp 2 (ZeRO-1, AdamW) on 2 CPU ranks, saves, and converts
its own checkpoint with its own `ds_to_universal`: both folders hold the same parameters, each
whole (the tp pieces joined along the same dimension), with the same fp32 values and Adam
moments at fp32 tolerance (the two trainings agree to that, test_autotp_compat.py). DeepSpeed's
AutoTP folders carry no `cat_dim` (its affine maps say where pieces go); zerospeed's record the
split dimension there, DeepSpeed's meaning of `cat_dim`. Not crossed:
DeepSpeed's converter needs the `universal_checkpoint_info` its AutoTP writes, which zerospeed's
checkpoints do not carry, and zerospeed's converter refuses DeepSpeed's AutoTP checkpoints (no
`autotp_shards` record); docs/checkpointing.md, the resharding matrix. But the folders cross both
ways: zerospeed loads the folder DeepSpeed's converter wrote, and DeepSpeed the folder zerospeed's
wrote, at tp 2 and tp 1, continuing as zerospeed's uninterrupted run.
"""

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.compat
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "autotp_train.py")


def _convert(impl: str, tag_dir: str, output: str) -> None:
    from compat_harness import REPO_ROOT
    from deepspeed_extensions import deepspeed_env

    env = {**os.environ, "PYTHONPATH": REPO_ROOT, **(deepspeed_env() if impl == "deepspeed" else {})}
    module = "deepspeed" if impl == "deepspeed" else "zerospeed"
    extra = [] if impl == "deepspeed" else ["--inject_missing_state"]   # ours has no universal_checkpoint_info
    proc = subprocess.run([sys.executable, "-m", f"{module}.checkpoint.ds_to_universal", "--input_folder", tag_dir,
                           "--output_folder", output, *extra], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _param_files(folder: str) -> dict[str, dict]:
    """zero/<param>/<state>.pt -> {"param": tensor, "cat_dim": int}, fp32 and the Adam moments."""
    files = {}
    for name in os.listdir(os.path.join(folder, "zero")):
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            path = os.path.join(folder, "zero", name, f"{state}.pt")
            if os.path.exists(path):
                files[f"{name}/{state}"] = torch.load(path, weights_only=True)
    return files


def test_both_converters_join_autotp_pieces_alike(tmp_path) -> None:
    from compat_harness import run_both

    run_both(SCRIPT, str(tmp_path), steps=2, stage=1, adam=True)
    folders = {}
    for impl in ("deepspeed", "zerospeed"):
        folders[impl] = str(tmp_path / impl / "ckpt" / "t_universal")
        _convert(impl, str(tmp_path / impl / "ckpt" / "t"), folders[impl])
    theirs, ours = _param_files(folders["deepspeed"]), _param_files(folders["zerospeed"])
    assert theirs.keys() == ours.keys() and len(theirs) == 3 * 21   # 21 parameters, none frozen
    for key, value in theirs.items():
        assert ours[key]["param"].shape == value["param"].shape, key    # whole, not a tp piece
        # the two trainings agree to ~1e-5 of the gradient norm (test_autotp_compat.py), so the clipped
        # gradients to that, their squares (exp_avg_sq) to 2e-5, and Adam's normalised update can
        # carry that to an element whose moments are near zero: 1e-4 of the tensor's own scale. A piece
        # joined at the wrong place or along the wrong dimension is off by the scale itself.
        scale = value["param"].abs().max().item()
        torch.testing.assert_close(ours[key]["param"], value["param"], rtol=0, atol=1e-4 * scale,
                                   msg=lambda m, key=key: f"{key}: {m}")


def test_zerospeed_loads_deepspeeds_autotp_universal_folder_at_tp1(tmp_path) -> None:
    """DeepSpeed's tp=2 checkpoint converted by DeepSpeed's converter (pieces joined by its affine
    maps, no `cat_dim`) loads into zerospeed at tp 1 on one rank: the weights DeepSpeed held, bit
    for bit, and its step count."""
    from compat_harness import run_both, run_script

    written = run_both(SCRIPT, str(tmp_path), steps=2, stage=1, adam=True)
    ckpt = tmp_path / "deepspeed" / "ckpt"
    _convert("deepspeed", str(ckpt / "t"), str(ckpt / "t_universal"))
    read = run_script(SCRIPT, "zerospeed", str(tmp_path / "loads"), world_size=1, steps=0, stage=1, adam=True,
                      universal=True, load_from={"zerospeed": str(ckpt)})[0]
    assert read["global_steps"] == 2
    full = written["deepspeed"][0]["full"]
    assert read["loaded"].keys() == full.keys()
    for name, value in full.items():
        assert read["loaded"][name] == value, name


@pytest.mark.parametrize("loaded_tp", [2, 1])
def test_deepspeed_resumes_from_zerospeeds_autotp_universal_folder(tmp_path, loaded_tp) -> None:
    """zerospeed's tp=2 ZeRO-1 checkpoint converted by zerospeed's converter (whole parameters,
    `cat_dim` the split dimension) loads into DeepSpeed 0.19.8 with `"load_universal": true` at
    tp 2 and at tp 1 (DeepSpeed cuts its pieces by its own AutoTP layers' restore metadata): the
    weights zerospeed held, bit for bit, its step count, and the next two AdamW steps' losses and
    weights equal to zerospeed's uninterrupted run at fp32 tolerance (a lost moment shows at once:
    a fresh AdamW's first step is lr * sign(grad))."""
    from compat_compare import assert_close_lists
    from compat_harness import run_script

    written = run_script(SCRIPT, "zerospeed", str(tmp_path / "zerospeed"), world_size=2, steps=2, stage=1,
                         adam=True, then=2)[0]
    ckpt = tmp_path / "zerospeed" / "ckpt"
    _convert("zerospeed", str(ckpt / "t"), str(ckpt / "t_universal"))
    read = run_script(SCRIPT, "deepspeed", str(tmp_path / "deepspeed"), world_size=loaded_tp, steps=0, stage=1,
                      adam=True, universal=True, load_from={"deepspeed": str(ckpt)}, then=2)[0]
    assert read["global_steps"] == 2
    assert read["loaded"].keys() == written["full"].keys()
    for name, value in written["full"].items():
        assert read["loaded"][name] == value, name
    assert_close_lists(read["then_losses"], written["then_losses"], "fp32", "losses after the load")
    assert read["then_full"].keys() == written["then_full"].keys()
    for name, value in written["then_full"].items():
        assert_close_lists(read["then_full"][name], value, "fp32", f"{name} after two more steps")
