"""The launcher with real processes: env + all_reduce, fail-fast, signals, bad script, teardown abort."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from launcher_helpers import (
    fail_fast_bound,
    SCRIPT,
    alive,
    env,
    free_port,
    job_pids,
    launcher_argv,
    seconds_since_raise,
    wait_for_pid_files,
)


def test_two_ranks_see_deepspeeds_env_and_all_reduce(tmp_path):
    port = free_port()
    out = subprocess.run(launcher_argv("--num_gpus", "2", "--master_port", str(port), SCRIPT, "env",
                                       str(tmp_path), "--lr", "0.1"),
                         env=env(), check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    results = sorted((json.loads(line[len("RESULT "):]) for line in out.stdout.splitlines()
                      if line.startswith("RESULT ")), key=lambda r: r["env"]["RANK"])
    assert len(results) == 2
    for rank, result in enumerate(results):
        assert result["env"] == {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                                 "LOCAL_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                 "CROSS_RANK": "0", "CROSS_SIZE": "1"}
        assert result["argv"] == [f"--local_rank={rank}", "env", str(tmp_path), "--lr", "0.1"]
        assert result["sum"] == 3.0


def test_a_rank_that_raises_stops_the_job_fast(tmp_path):
    proc = subprocess.Popen(launcher_argv("--num_gpus", "2", SCRIPT, "raise", str(tmp_path)),
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids = wait_for_pid_files(tmp_path, 2)
    _, stderr = proc.communicate(timeout=60)
    elapsed = seconds_since_raise(tmp_path)
    assert proc.returncode != 0
    assert elapsed < fail_fast_bound(), f"fail-fast took {elapsed:.1f} s after the raise"
    final = stderr[stderr.rindex("zerospeed: rank 1 on host localhost failed"):]
    assert "traceback of rank 1 (local_rank 1) on host localhost" in final
    assert "RuntimeError: boom from rank one" in final
    assert stderr.count("RuntimeError: boom from rank one") == 1, "the traceback is printed once, in the final report"
    assert alive(pids) == [], "processes of the job are left"


def test_one_traceback_raised_by_every_rank_is_printed_once_with_its_ranks(tmp_path):
    """Issue 14.5: each distinct traceback once, with the ranks that raised it."""
    out = subprocess.run(launcher_argv("--num_gpus", "2", SCRIPT, "raise_both", str(tmp_path)),
                         env=env(ZS_KILL_GRACE_S="5"), check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert out.stderr.count("RuntimeError: boom from every rank") == 1, out.stderr
    assert "---- traceback of ranks 0, 1 (local_ranks 0, 1) on host localhost ----" in out.stderr
    assert alive(job_pids(tmp_path, 2)) == []


def test_sigterm_to_the_launcher_stops_every_process(tmp_path):
    proc = subprocess.Popen(launcher_argv("--num_gpus", "2", SCRIPT, "sleep", str(tmp_path)),
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids = wait_for_pid_files(tmp_path, 2)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert time.monotonic() - start < fail_fast_bound()
    assert alive(pids) == []
    assert "launcher received SIGTERM" in stderr


def _wait_until_dead(pids, timeout_s):
    deadline = time.monotonic() + timeout_s
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive(pids)


def test_sigkill_of_the_launcher_leaves_no_orphans(tmp_path):
    """[Note: lifeline]: the ranks die by the parent-death signal, their forked children by the guard."""
    proc = subprocess.Popen(launcher_argv("--num_gpus", "2", SCRIPT, "sleep", str(tmp_path)),
                            env=env(ZS_KILL_GRACE_S="1"), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    pids = wait_for_pid_files(tmp_path, 2)
    proc.kill()
    proc.communicate(timeout=30)
    assert _wait_until_dead(pids, 10) == [], "ranks or their children outlived the SIGKILLed launcher"


def test_a_missing_script_is_one_clear_error(tmp_path):
    missing = str(tmp_path / "no_such_train.py")
    out = subprocess.run(launcher_argv("--num_gpus", "2", missing), env=env(),
                         check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"zerospeed: error: user script {missing!r} does not exist on host 'localhost'"]


def test_bad_include_is_one_clear_error():
    out = subprocess.run(launcher_argv("--include", "localhost:5", SCRIPT), env=env(),
                         check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip() == "zerospeed: error: --include: host 'localhost' has no slot 5 (it has slots 0..0)"


@pytest.mark.parametrize("others_s, grace_s, ok", [(1, 15, True), (300, 1, False)])
def test_gloo_teardown_abort(tmp_path, others_s, grace_s, ok):
    """[Note: gloo teardown abort]: forgiven once the other ranks finish cleanly, not otherwise."""
    start = time.monotonic()
    out = subprocess.run(launcher_argv("--num_gpus", "2", SCRIPT, "teardown", str(tmp_path)),
                         env=env(ZS_TEST_OTHERS_S=str(others_s), ZS_TEARDOWN_GRACE_S=str(grace_s)),
                         check=False, capture_output=True, text=True, timeout=60)
    if ok:
        assert out.returncode == 0, out.stderr
        assert "counted as success" in out.stderr
    else:
        assert out.returncode == 128 + signal.SIGABRT
        assert "rank 1 on host localhost failed (killed by SIGABRT)" in out.stderr
        assert time.monotonic() - start < 30
    assert alive(job_pids(tmp_path, 2)) == []


def test_the_launcher_imports_no_training_code():
    code = ("import sys, zerospeed.launcher.runner, zerospeed.launcher.launch; "
            "print(sorted(m for m in sys.modules if m.startswith('zerospeed.runtime')))")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train_gpt.py")


def test_two_ranks_train_the_example(tmp_path):
    config = os.path.join(os.path.dirname(EXAMPLE), "configs", "zero2.json")
    out = subprocess.run(launcher_argv("--num_gpus", "2", EXAMPLE, "--deepspeed_config", config, "--steps", "3",
                                       "--save_dir", str(tmp_path / "run")),
                         env=env(), cwd=tmp_path, check=False, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "loss: first" in out.stdout
