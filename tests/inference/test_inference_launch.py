"""`init_inference` at tp 2 started the two ways users start it: plain `torchrun` (no LOCAL_SIZE in
the environment; DeepSpeed 0.19.8 crashes there on CPU unless it is set) and the `zerospeed`
launcher. Each rank's logits and greedy tokens equal the unsharded model's."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys


SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch_script.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KINDS = ["llama", "qwen2"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_SIZE", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", ZS_ACCELERATOR="cpu",
               PYTHONPATH=os.pathsep.join([REPO, *filter(None, [os.environ.get("PYTHONPATH")])]))
    return env


def _check(out_dir: str, expect_local_size: str | None) -> None:
    for rank in range(2):
        with open(os.path.join(out_dir, f"rank{rank}.json")) as handle:
            report = json.load(handle)
        assert report["local_size"] == expect_local_size
        for kind in KINDS:
            result = report["results"][kind]
            assert result["diff"] <= 1e-5 and result["tokens"] and result["mp_world_size"] == 2, (rank, kind, result)


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_plain_torchrun_without_local_size(tmp_path) -> None:
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_port()),
          SCRIPT, str(tmp_path), *KINDS])
    _check(str(tmp_path), None)


def test_checkpoint_load_peak_rss_stays_below_a_full_copy(tmp_path) -> None:
    """Each rank's peak RSS rises by about its shards (+ one tensor and noise) while loading a
    ~84 MB fp32 Llama from safetensors at tp 2: well below one full copy of the model."""
    sys.path.insert(0, os.path.dirname(SCRIPT))
    from rss_script import write_checkpoint

    write_checkpoint(str(tmp_path / "ckpt"))
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_port()),
          os.path.join(os.path.dirname(SCRIPT), "rss_script.py"), str(tmp_path), str(tmp_path / "ckpt")])
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.json") as handle:
            report = json.load(handle)
        assert report["shard_bytes"] < 0.65 * report["model_bytes"]
        assert report["rise"] < 0.85 * report["model_bytes"], (rank, report)


def test_zerospeed_launcher(tmp_path) -> None:
    _run([sys.executable, "-m", "zerospeed.launcher.runner", "--num_gpus", "2", "--master_port", str(_port()),
          SCRIPT, str(tmp_path), *KINDS])
    _check(str(tmp_path), "2")
