"""The hang report ([Note: hang report]): a rank stuck outside collectives while the others wait in
one is reported within the configured time, with every rank's Python stack, the stuck rank named,
and exit code 124; a merely slow step (no rank waiting in a collective) never trips it."""

import subprocess
import tempfile
import time

import pytest
from launcher_helpers import SCRIPT, alive, env, job_pids, launcher_argv

from zerospeed.launcher.hang import HANG_EXIT_CODE

TIMEOUT_S = 4.0


def run_hang_job(mode, timeout_s):
    """Run `rank_script.py <mode>` on 2 ranks; return (exit code, stderr, seconds to the report)."""
    pid_dir = tempfile.mkdtemp(prefix="zs-hang-")
    start = time.monotonic()
    out = subprocess.run(launcher_argv("--num_gpus", "2", SCRIPT, mode, pid_dir),
                         env=env(ZS_HANG_TIMEOUT_S=str(timeout_s), ZS_TEST_SLOW_S=str(2.5 * timeout_s),
                                 ZS_KILL_GRACE_S="1"),
                         check=False, capture_output=True, text=True, timeout=300)
    assert alive(job_pids(pid_dir, 2)) == []
    return out.returncode, out.stderr, time.monotonic() - start


def test_a_rank_stuck_outside_a_collective_is_reported_with_every_stack():
    code, stderr, elapsed = run_hang_job("hang", TIMEOUT_S)
    assert code == HANG_EXIT_CODE, stderr[-3000:]
    assert "rank 0 on host localhost has waited in all_reduce" in stderr
    assert "rank 1 on host localhost is not in a collective" in stderr
    assert "the rank(s) not in a collective on host localhost: 1" in stderr
    stack_0 = stderr[stderr.index("Python stack of rank 0"):stderr.index("Python stack of rank 1")]
    stack_1 = stderr[stderr.index("Python stack of rank 1"):]
    assert "all_reduce" in stack_0 and "rank_script.py" in stack_0
    assert "stuck_in_data_loader" in stack_1
    # Start-up (two torch imports on a loaded machine) + the timeout + the stack collection.
    assert elapsed < TIMEOUT_S + 60, f"the hang report took {elapsed:.0f} s"


def test_a_slow_step_is_not_a_hang():
    code, stderr, _ = run_hang_job("slow", TIMEOUT_S)
    assert code == 0, stderr[-3000:]
    assert "hang" not in stderr


@pytest.mark.parametrize("raw", ["abc", "-1"])
def test_a_bad_hang_timeout_names_the_variable(raw):
    from zerospeed.launcher.hang import hang_timeout_s

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ZS_HANG_TIMEOUT_S", raw)
        with pytest.raises(ValueError, match="ZS_HANG_TIMEOUT_S"):
            hang_timeout_s()

