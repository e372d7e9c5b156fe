"""The runner's multi-node path with ``--launcher ssh``, where ``ssh`` is a stand-in on PATH that
runs the remote command on this machine: the real command lines, quoting, exported environment,
cross-node fail-fast and SIGTERM, without an ssh server. (A real two-host run over network
namespaces needs root, ``ip`` and ``sshd``: see ``test_two_hosts_netns.py``.)
"""

import json
import os
import signal
import subprocess
import time

from launcher_helpers import SCRIPT, alive, env, free_port, launcher_argv, wait_for_pid_files

FAKE_SSH = """#!/usr/bin/env bash
# ssh stand-in: skip options and the host, run the command here (as sshd would, through a shell)
while [[ "$1" == -* ]]; do [[ "$1" == -o || "$1" == -p ]] && shift; shift; done
shift  # host
exec bash -c "$1"
"""


def run_job(tmp_path, mode, **extra_env):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(FAKE_SSH)
    (bin_dir / "ssh").chmod(0o755)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    job_env = env(PATH=f"{bin_dir}:{os.environ['PATH']}", **extra_env)
    proc = subprocess.Popen(launcher_argv("-H", str(hostfile), "--launcher", "ssh", "--master_addr", "127.0.0.1",
                                          "--master_port", str(free_port()), SCRIPT, mode, str(pid_dir)),
                            env=job_env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, pid_dir


def test_ssh_job_runs_on_both_nodes(tmp_path):
    proc, _ = run_job(tmp_path, "env", NCCL_DEBUG="WARN")
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    results = [json.loads(line[len("RESULT "):]) for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert sorted((r["env"]["RANK"], r["env"]["CROSS_RANK"], r["sum"]) for r in results) == [
        ("0", "0", 3.0), ("1", "1", 3.0)]
    assert "export NCCL_DEBUG=WARN;" in stderr  # the printed command forwards the environment


def test_ssh_job_failure_and_sigterm(tmp_path):
    (tmp_path / "fail").mkdir()
    proc, pid_dir = run_job(tmp_path / "fail", "raise")
    pids = wait_for_pid_files(pid_dir, 2)
    start = time.monotonic()
    _, stderr = proc.communicate(timeout=60)
    print(f"fail-fast over ssh: {time.monotonic() - start:.1f} s from the ranks' start to the runner's exit")
    assert proc.returncode == 1 and time.monotonic() - start < 30
    assert "traceback of rank 1 (local_rank 0) on host node-b" in stderr
    assert "stopped: rank 1 on host node-b failed" in stderr
    assert alive(pids) == []

    (tmp_path / "term").mkdir()
    proc, pid_dir = run_job(tmp_path / "term", "sleep")
    pids = wait_for_pid_files(pid_dir, 2)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    deadline = time.monotonic() + 15
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive(pids) == [], f"left after {time.monotonic() - start:.1f} s"
    print(f"SIGTERM over ssh: all gone {time.monotonic() - start:.1f} s after the signal")
