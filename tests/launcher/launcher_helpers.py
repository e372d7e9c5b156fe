"""Helpers shared by the launcher tests that run real processes."""

import os
import socket
import sys
import time

import psutil

SCRIPT = os.path.join(os.path.dirname(__file__), "rank_script.py")
CLI = os.path.join(os.path.dirname(sys.executable), "zerospeed")


def launcher_argv(*args):
    base = [CLI] if os.path.exists(CLI) else [sys.executable, "-m", "zerospeed.launcher.runner"]
    return [*base, *args]


def env(**extra):
    return {**os.environ, "OMP_NUM_THREADS": "1", "ZS_ACCELERATOR": "cpu", **extra}


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def job_pids(pid_dir, num_ranks):
    pids = []
    for rank in range(num_ranks):
        with open(os.path.join(pid_dir, f"rank{rank}.pids")) as f:
            pids += [int(p) for p in f.read().split()]
    return pids


def wait_for_pid_files(pid_dir, num_ranks, timeout_s=30):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(os.path.exists(os.path.join(pid_dir, f"rank{r}.pids")) for r in range(num_ranks)):
            time.sleep(0.1)  # the file is written in one call; let it land
            return job_pids(pid_dir, num_ranks)
        time.sleep(0.1)
    raise AssertionError("ranks did not start")


def alive(pids):
    living = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                living.append(pid)
        except psutil.NoSuchProcess:
            pass
    return living


# Fail-fast bounds, from the moment a rank raises (or the signal is sent) to the launcher's exit.
# Measured at 0.2-2.5 s on a loaded 2-core machine; a launcher that waited out a 5 s grace period
# before stopping the other ranks would exceed them.
FAIL_FAST_S = 4.5


def fail_fast_bound(base_s: float = FAIL_FAST_S) -> float:
    """`base_s`, stretched by how oversubscribed the CPUs were over the last minute: a launcher that
    reacts at once still takes longer when other work holds both cores (seen at 5.7 s under a load
    of 12 on 2 cores); on a quiet machine the bound is `base_s` itself."""
    return base_s * max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


def seconds_since_raise(pid_dir):
    with open(os.path.join(pid_dir, "raised_at")) as f:
        return time.time() - float(f.read())
