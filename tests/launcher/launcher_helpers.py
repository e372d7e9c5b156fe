"""Helpers shared by the launcher tests that run real processes."""

import os
import signal
import socket
import subprocess
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


# The `train` mode of rank_script.py: one SGD step of a tiny model on a global batch of 8 split
# over the ranks; the reference is the same step in one process on the whole batch.
TRAIN_CONFIG = {"train_batch_size": 8, "gradient_clipping": 0.0,
                "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def train_batch():
    import torch

    x = torch.arange(32, dtype=torch.float32).reshape(8, 4) / 10
    return x, x.sum(1, keepdim=True) * 0.5 - 1


def train_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Linear(4, 1)


def train_reference():
    """The parameters after the step, computed in this process with plain torch."""
    import torch

    model = train_model()
    x, y = train_batch()
    torch.nn.functional.mse_loss(model(x), y).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= TRAIN_CONFIG["optimizer"]["params"]["lr"] * p.grad
    return [v for p in model.parameters() for v in p.detach().flatten().tolist()]


def results(output):
    """The RESULT lines of the ranks, sorted by rank (pdsh prefixes every line with its host)."""
    import json

    found = [json.loads(line.split("RESULT ", 1)[1]) for line in output.splitlines() if "RESULT " in line]
    return sorted(found, key=lambda r: r.get("rank", r.get("env", {}).get("RANK")))


# The remote-launcher tests (test_two_hosts_netns.py, test_slurm_launcher.py)
SPACED_ARG = "two words"  # must reach every rank as one argument through each launcher
LISTED = {"ZS_TEST_LIST": "eth0,eth1"}  # a forwarded variable whose value has a comma (srun splits there)
# From the raise on one host to the end of the job (before fail_fast_bound's stretch for load):
# measured 4-8 s under a load of 9-21 on 2 cores; ssh and pdsh add a remote session's teardown,
# srun its step's, to the ~2 s of the per-node launchers' cross-node abort.
CROSS_HOST_FAIL_FAST_S = 10.0


def run_job(argv, job_env, timeout_s):
    """Run a job to its end; on timeout stop it (the runner stops its remote commands)."""
    proc = subprocess.Popen(argv, env=job_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        raise AssertionError(f"job timed out after {timeout_s} s:\n{err[-4000:]}") from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def stop_process(proc, grace_s):
    """SIGTERM `proc`, SIGKILL it if it is still there after `grace_s`; reap it either way."""
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
