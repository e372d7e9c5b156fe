"""Launch-to-first-rank latency of the `zerospeed` launcher (issue 17, item 7).

    python benchmarks/launch_latency.py [--repeats 5]

Time from starting `zerospeed` to the moment the first rank process runs its script's first line
(tests/launcher/rank_script.py writes its pid file before importing anything heavy), for one
node (2 ranks) and for a two-node `--no_ssh` job on this machine (both launchers started at
once, one rank per node; the time until node 1's rank runs). Median of the repeats, in seconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "launcher"))

from launcher_helpers import SCRIPT, env, free_port, launcher_argv  # noqa: E402


def _first_rank_s(argv_per_node: list[list[str]], pid_dir: str, wanted: str) -> float:
    start = time.monotonic()
    procs = [subprocess.Popen(argv, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for argv in argv_per_node]
    while not os.path.exists(os.path.join(pid_dir, wanted)):
        time.sleep(0.005)
    elapsed = time.monotonic() - start
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.wait()
    return elapsed


def one_node() -> float:
    pid_dir = tempfile.mkdtemp()
    return _first_rank_s([launcher_argv("--num_gpus", "2", SCRIPT, "sleep", pid_dir)], pid_dir, "rank0.pids")


def two_nodes() -> float:
    pid_dir = tempfile.mkdtemp()
    hostfile = os.path.join(pid_dir, "hostfile")
    with open(hostfile, "w") as f:
        f.write("node-a slots=1\nnode-b slots=1\n")
    port = str(free_port())
    argv = [launcher_argv("-H", hostfile, "--no_ssh", "--node_rank", str(node), "--master_addr", "127.0.0.1",
                          "--master_port", port, SCRIPT, "sleep", pid_dir) for node in (0, 1)]
    return _first_rank_s(argv, pid_dir, "rank1.pids")  # node 1's rank: the last to start before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for name, fn in (("one node, 2 ranks", one_node), ("two nodes (--no_ssh), node 1", two_nodes)):
        times = [fn() for _ in range(args.repeats)]
        print(f"{name}: median {statistics.median(times):.2f} s (min {min(times):.2f}, max {max(times):.2f})")


if __name__ == "__main__":
    main()
