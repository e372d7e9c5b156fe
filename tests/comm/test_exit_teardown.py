"""[Note: gloo exit abort]: a gloo job that ends without destroying its groups exits 0, not SIGABRT.

Each case launches two real ranks with torchrun and lets their interpreters exit. The abort is a
race: without the teardown 9 of 20 such runs aborted (-6), so six clean runs in a row would happen
by chance with probability 0.55**6 < 3%.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "exit_script.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _launch(mode: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([REPO, *filter(None, [env.get("PYTHONPATH")])]))
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
            str(_port()), SCRIPT, mode]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)


def test_ranks_that_never_destroy_their_groups_exit_cleanly() -> None:
    for attempt in range(6):
        done = _launch("zerospeed")
        assert done.returncode == 0, (attempt, done.stderr[-3000:])
        assert done.stdout.count("initialized after teardown: False") == 2, done.stdout


def test_an_uncaught_exception_skips_the_teardown() -> None:
    """A failing rank must exit at once, never wait in a teardown: the groups are left as they are."""
    done = _launch("raise")
    assert done.returncode != 0
    assert "RuntimeError: the script failed" in done.stderr
    assert done.stdout.count("initialized after teardown: True") == 2, done.stdout


def test_importing_zerospeed_alone_leaves_torch_groups_alone() -> None:
    """Only a process in which ``init_distributed`` ran gets the teardown (torchrun reports either
    exit status here: such a script can still hit the abort)."""
    done = _launch("torch")
    assert done.stdout.count("initialized after teardown: True") == 2, done.stdout
