"""Two per-node launchers on this machine (``--no_ssh --node_rank N``), one per "host" of a hostfile.

This exercises the multi-node path without ssh: the node-0 launcher's store (shared with the
ranks), CROSS_RANK / CROSS_SIZE, and the cross-node abort when a rank on the other node fails.
"""

import json
import subprocess

from launcher_helpers import (
    FAIL_FAST_S,
    fail_fast_bound,
    SCRIPT,
    alive,
    env,
    free_port,
    launcher_argv,
    seconds_since_raise,
    wait_for_pid_files,
)


def start_nodes(tmp_path, mode):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    port = free_port()
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    nodes = [subprocess.Popen(launcher_argv("-H", str(hostfile), "--no_ssh", "--node_rank", str(n),
                                            "--master_addr", "127.0.0.1", "--master_port", str(port),
                                            SCRIPT, mode, str(pid_dir)),
                              env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n in (0, 1)]
    return nodes, pid_dir, port


def test_two_nodes_rendezvous_and_all_reduce(tmp_path):
    nodes, _, port = start_nodes(tmp_path, "env")
    outs = [node.communicate(timeout=120) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outs
    for node_rank, (stdout, _) in enumerate(outs):
        result = json.loads(stdout.split("RESULT ", 1)[1].splitlines()[0])
        assert result["sum"] == 3.0
        assert result["env"] == {"RANK": str(node_rank), "LOCAL_RANK": "0", "WORLD_SIZE": "2",
                                 "LOCAL_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                 "CROSS_RANK": str(node_rank), "CROSS_SIZE": "2"}


def test_a_failure_on_one_node_stops_the_other(tmp_path):
    nodes, pid_dir, _ = start_nodes(tmp_path, "raise")  # rank 1 (node-b) raises, rank 0 sleeps
    pids = wait_for_pid_files(pid_dir, 2)
    outs = [node.communicate(timeout=60) for node in nodes]
    elapsed = seconds_since_raise(pid_dir)
    assert all(node.returncode != 0 for node in nodes)
    # one abort check a second on the other node, then the same teardown
    assert elapsed < fail_fast_bound(FAIL_FAST_S + 1), f"cross-node fail-fast took {elapsed:.1f} s after the raise"
    assert "stopped: rank 1 on host node-b failed (exit code 1)" in outs[0][1]
    assert "traceback of rank 1 (local_rank 0) on host node-b" in outs[1][1]
    assert "RuntimeError: boom from rank one" in outs[1][1]
    assert alive(pids) == []
