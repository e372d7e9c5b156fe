"""Real two-host jobs through each remote launcher: ``ssh``, ``pdsh`` (its ssh rcmd module) and
Open MPI's ``mpirun``, started from the first of two network-namespace hosts (``netns_hosts``).

Per launcher: one training step whose parameters equal the one-host run's and a single-process
torch reference; and fail-fast: a rank raising on the second host stops the first host's rank,
the job exits non-zero and the traceback is shown. Needs root, iproute2 and openssh-server, plus
``pdsh`` / ``mpirun`` (openmpi-bin) for theirs; each skips with the reason otherwise.
"""

import contextlib
import os
import shlex
import shutil
import signal

import pytest
from launcher_helpers import (
    CROSS_HOST_FAIL_FAST_S,
    LISTED,
    SCRIPT,
    SPACED_ARG,
    alive,
    env,
    fail_fast_bound,
    free_port,
    job_pids,
    launcher_argv,
    results,
    run_job,
    seconds_since_raise,
    train_reference,
)
from netns_hosts import missing, two_hosts

pytestmark = pytest.mark.skipif(missing() is not None, reason=f"two netns hosts: {missing()}")

LAUNCHERS = [
    "ssh",
    pytest.param("pdsh", marks=pytest.mark.skipif(not shutil.which("pdsh"), reason="needs pdsh (apt: pdsh)")),
    pytest.param("openmpi", marks=pytest.mark.skipif(not shutil.which("mpirun"),
                                                     reason="needs mpirun (apt: openmpi-bin)")),
]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    with two_hosts(tmp_path_factory.mktemp("hosts")) as h:
        yield h


@pytest.fixture(scope="module")
def one_host(tmp_path_factory):
    """The same job on this machine: two ranks under the one-node launcher."""
    pid_dir = tmp_path_factory.mktemp("one_host")
    out = run_job(launcher_argv("--num_gpus", "2", SCRIPT, "train", str(pid_dir), SPACED_ARG), env(), 120)
    assert out.returncode == 0, out.stderr[-4000:]
    return results(out.stdout)


def launch_argv(hosts, launcher, tmp_path, mode, pid_dir):
    """The runner's command line on host 1, and its environment; no --master_addr: the runner
    finds it (``hostname -I`` of the first host over ssh / pdsh's ssh options, the hostfile's
    first host for mpirun)."""
    hostfile = hosts.hostfile(tmp_path / "hostfile")
    extra_env = {"GLOO_SOCKET_IFNAME": "zs0", **LISTED}
    if launcher == "ssh":
        launcher_args = hosts.ssh_options
    elif launcher == "pdsh":
        launcher_args, extra_env["PDSH_SSH_ARGS_APPEND"] = "", hosts.ssh_options
    else:  # root needs Open MPI's consent; its own ssh needs the key
        launcher_args = (f"--allow-run-as-root --mca plm_rsh_args {shlex.quote(hosts.ssh_options)} "
                         "--mca btl_tcp_if_include zs0")
    argv = launcher_argv("-H", str(hostfile), "--launcher", launcher, f"--launcher_args={launcher_args}",
                         "--master_port", str(free_port()), SCRIPT, mode, str(pid_dir), SPACED_ARG)
    return hosts.on(0, argv), env(**extra_env)


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_training_step_on_two_hosts_equals_one_host(hosts, one_host, launcher, tmp_path):
    argv, job_env = launch_argv(hosts, launcher, tmp_path, "train", tmp_path)
    out = run_job(argv, job_env, 180)
    assert out.returncode == 0, out.stderr[-4000:]
    got = results(out.stdout)
    assert [(r["rank"], r["world"], r["host"], r["master"], r["args"], r["listed"]) for r in got] == [
        (0, 2, [hosts.addrs[0]], hosts.addrs[0], [SPACED_ARG], LISTED["ZS_TEST_LIST"]),
        (1, 2, [hosts.addrs[1]], hosts.addrs[0], [SPACED_ARG], LISTED["ZS_TEST_LIST"])]
    if launcher != "openmpi":  # mpirun starts the ranks directly, without the per-node launcher
        assert [r["cross"] for r in got] == [["0", "2"], ["1", "2"]]
    # Same reduction over the same shards: the one-host run's parameters exactly.
    assert [r["params"] for r in got] == [r["params"] for r in one_host]
    # And the whole batch in one process, to fp32 rounding (the sum runs in another order).
    assert got[0]["params"] == pytest.approx(train_reference(), rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_raise_on_the_second_host_stops_the_first(hosts, launcher, tmp_path):
    argv, job_env = launch_argv(hosts, launcher, tmp_path, "raise", tmp_path)
    try:
        out = run_job(argv, job_env, 120)
        elapsed = seconds_since_raise(tmp_path)
        pids = job_pids(tmp_path, 2)  # [rank 0, its child, rank 1, its child]
        output = out.stdout + out.stderr
        assert out.returncode == 1, output[-4000:]
        assert elapsed < fail_fast_bound(CROSS_HOST_FAIL_FAST_S), f"took {elapsed:.1f} s after the raise"
        assert "RuntimeError: boom from rank one" in output
        if launcher == "openmpi":
            assert "mpirun detected that one or more processes exited with non-zero status" in output
            # Open MPI stops the ranks, not what a rank that exited by itself had forked.
            assert alive(pids[:1] + pids[2:3]) == []
        else:
            assert f"traceback of rank 1 (local_rank 0) on host {hosts.addrs[1]}" in output
            assert f"stopped: rank 1 on host {hosts.addrs[1]} failed" in output
            assert alive(pids) == []
    finally:
        with contextlib.suppress(FileNotFoundError):
            for pid in alive(job_pids(tmp_path, 2)):
                os.kill(pid, signal.SIGKILL)
