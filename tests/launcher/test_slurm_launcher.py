"""``--launcher slurm`` on a real (one-node) Slurm cluster started by the test (``slurm_cluster``):
the runner's ``srun`` command runs a training step equal to the one-host run's result and a
torch reference, and a raising rank stops the other through ``--kill-on-bad-exit``.

``--force_multi`` takes the multi-node path with the one host of the hostfile. Needs root and
Debian's slurmctld, slurmd, slurm-client and munge; skips with the reason otherwise.
"""

import contextlib
import os
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
from slurm_cluster import missing, slurm_cluster

pytestmark = pytest.mark.skipif(missing() is not None, reason=f"a Slurm cluster: {missing()}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as c:
        yield c


def srun_job(cluster, tmp_path, mode):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"{cluster.node} slots=2\n")
    argv = launcher_argv("-H", str(hostfile), "--force_multi", "--launcher", "slurm",
                         "--master_port", str(free_port()), SCRIPT, mode, str(tmp_path), SPACED_ARG)
    # From an env file, not this environment (which srun's ALL would forward anyway): the value
    # reaches srun only through the runner's exports.
    env_file = tmp_path / "job_env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in LISTED.items()))
    return run_job(argv, env(**cluster.env, DS_ENV_FILE=str(env_file)), 180)


def test_training_step_through_srun(cluster, tmp_path):
    out = srun_job(cluster, tmp_path, "train")
    assert out.returncode == 0, out.stderr[-4000:]
    got = results(out.stdout)
    assert [(r["rank"], r["world"], r["master"], r["args"], r["listed"]) for r in got] == [
        (0, 2, cluster.node, [SPACED_ARG], LISTED["ZS_TEST_LIST"]),
        (1, 2, cluster.node, [SPACED_ARG], LISTED["ZS_TEST_LIST"])]
    assert got[0]["params"] == got[1]["params"]
    assert got[0]["params"] == pytest.approx(train_reference(), rel=1e-6, abs=1e-6)


def test_a_raising_rank_stops_the_job_through_srun(cluster, tmp_path):
    try:
        out = srun_job(cluster, tmp_path, "raise")
        elapsed = seconds_since_raise(tmp_path)
        output = out.stdout + out.stderr
        assert out.returncode != 0, output[-4000:]
        assert elapsed < fail_fast_bound(CROSS_HOST_FAIL_FAST_S), f"took {elapsed:.1f} s after the raise"
        assert "RuntimeError: boom from rank one" in output
        assert "task 1: Exited with exit code 1" in output
        assert alive(job_pids(tmp_path, 2)) == []  # the ranks and what they forked
    finally:
        with contextlib.suppress(FileNotFoundError):
            for pid in alive(job_pids(tmp_path, 2)):
                os.kill(pid, signal.SIGKILL)
