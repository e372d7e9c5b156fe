"""The per-node launcher: start this node's ranks with DeepSpeed's environment, supervise them.

``python -m zerospeed.launcher.launch --world_info=<b64> --node_rank=N --master_addr=A
--master_port=P [flags] script [args]`` is what the runner executes on every node (directly for
a single node, through pdsh / ssh for several). World info is DeepSpeed's: ``{host: [slots]}``
in node order; global ranks run consecutively over the nodes in that order.

Environment of every rank (DeepSpeed's names): ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``CROSS_RANK`` (node rank), ``CROSS_SIZE``
(number of nodes), ``CUDA_VISIBLE_DEVICES`` (this node's slots, when the node has CUDA), and
``--local_rank=N`` before the script's own arguments unless ``--no_local_rank``.
This module imports no training code, and torch only for multi-node jobs (the abort store), after
the ranks have started (so a rank's start never waits for the launcher's torch import).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import signal
import sys
import tempfile
import threading
import time

from zerospeed.launcher.hostfile import decode_world_info
from zerospeed.launcher.hang import HangWatch, hang_timeout_s
from zerospeed.launcher.lifeline import Guard
from zerospeed.launcher.rank_process import RankProcess, RankSpec, stop_all
from zerospeed.launcher.supervisor import AbortChannel, Outcome, supervise

__all__ = ["build_rank_specs", "check_node", "main", "version_tag"]

PID_FILE_DIR = "/tmp"


def version_tag() -> str:
    """What must match on every node: the Python version and zerospeed's version."""
    from zerospeed.version import __version__

    return f"python={platform.python_version()},zerospeed={__version__}"


def _uses_cuda() -> bool:
    requested = (os.environ.get("ZS_ACCELERATOR") or os.environ.get("DS_ACCELERATOR") or "").lower()
    if requested:
        return requested == "cuda"
    return os.path.exists("/dev/nvidiactl")


def build_rank_specs(world_info: dict[str, list[int]], node_rank: int, master_addr: str,
                     master_port: int, command: list[str], no_local_rank: bool = False,
                     cuda: bool = False) -> list[RankSpec]:
    """One ``RankSpec`` per slot of node ``node_rank``: argv and DeepSpeed's per-rank env."""
    hosts = list(world_info)
    if not 0 <= node_rank < len(hosts):
        raise ValueError(f"--node_rank {node_rank} is outside the {len(hosts)} nodes of the world info")
    slots = world_info[hosts[node_rank]]
    first_rank = sum(len(world_info[h]) for h in hosts[:node_rank])
    world_size = sum(len(s) for s in world_info.values())
    shared = {
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port), "WORLD_SIZE": str(world_size),
        "CROSS_RANK": str(node_rank), "CROSS_SIZE": str(len(hosts)), "LOCAL_SIZE": str(len(slots)),
    }
    if cuda:
        shared["CUDA_VISIBLE_DEVICES"] = ",".join(str(s) for s in slots)
    specs = []
    for local_rank in range(len(slots)):
        argv = list(command)
        if not no_local_rank:
            argv.insert(_script_index(command) + 1, f"--local_rank={local_rank}")
        env = {**shared, "RANK": str(first_rank + local_rank), "LOCAL_RANK": str(local_rank)}
        specs.append(RankSpec(first_rank + local_rank, local_rank, argv, env))
    return specs


def _script_index(command: list[str]) -> int:
    """Index of the script (or module) in ``command``, after ``python -u [-m]``."""
    if len(command) >= 3 and command[1] == "-u":
        return 3 if command[2] == "-m" else 2
    return 0


def child_command(script: str, script_args: list[str], module: bool, no_python: bool) -> list[str]:
    if no_python:
        return [script, *script_args]
    return [sys.executable, "-u", *(["-m"] if module else []), script, *script_args]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m zerospeed.launcher.launch",
                                description="zerospeed per-node launcher (started by `zerospeed`)")
    p.add_argument("--world_info", required=True, help="base64 JSON {host: [slots]}")
    p.add_argument("--node_rank", type=int, default=0)
    p.add_argument("--master_addr", default="127.0.0.1")
    p.add_argument("--master_port", type=int, default=29500)
    p.add_argument("--module", action="store_true")
    p.add_argument("--no_python", action="store_true")
    p.add_argument("--no_local_rank", action="store_true")
    p.add_argument("--save_pid", type=int, default=0, help="write /tmp/<pid>.zerospeed")
    p.add_argument("--enable_each_rank_log", default="None")
    p.add_argument("--bind_cores_to_rank", action="store_true")
    p.add_argument("--bind_core_list", default=None)
    p.add_argument("--expect_versions", default=None, help="fail unless version_tag() equals this")
    p.add_argument("--log_level", default="info")
    p.add_argument("-q", "--quiet", action="store_true")
    p.add_argument("training_script")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return p.parse_args(argv)


def _log(args: argparse.Namespace, message: str) -> None:
    if not args.quiet and args.log_level in ("debug", "info"):
        print(f"[zerospeed launch] {message}", file=sys.stderr, flush=True)


def check_node(args: argparse.Namespace, host: str) -> None:
    if args.expect_versions and args.expect_versions != version_tag():
        raise ValueError(f"host {host!r} runs {version_tag()}, "
                         f"but the job was started with {args.expect_versions}")
    script = args.training_script
    if args.no_python:
        if shutil.which(script) is None:
            raise ValueError(f"executable {script!r} not found on host {host!r}")
    elif not args.module and not os.path.isfile(script):
        raise ValueError(f"user script {script!r} does not exist on host {host!r}")


def _core_sets(num_local: int, core_list: str | None) -> list[list[int]]:
    cores = ([int(c) for c in core_list.split(",")] if core_list
             else sorted(os.sched_getaffinity(0)))
    per_rank = max(1, len(cores) // num_local)
    return [cores[i * per_rank:(i + 1) * per_rank] or cores for i in range(num_local)]


def start_ranks(args: argparse.Namespace, host: str, specs: list[RankSpec], run_dir: str,
                guard: Guard | None = None) -> list[RankProcess]:
    log_dir = None if args.enable_each_rank_log in ("None", "", None) else args.enable_each_rank_log
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
    stamp = time.strftime("%Y%m%d%H%M%S")
    cores = _core_sets(len(specs), args.bind_core_list) if args.bind_cores_to_rank else None
    ranks = []
    for spec in specs:
        if cores is not None:
            spec.env["OMP_NUM_THREADS"] = str(len(cores[spec.local_rank]))
        log_path = os.path.join(log_dir, f"{stamp}_rank{spec.rank}.log") if log_dir else None
        rank = RankProcess(spec, host, os.path.join(run_dir, f"error_rank{spec.rank}.json"), log_path)
        if guard is not None:
            guard.watch(rank.pid)  # the rank leads its own process group: pgid == pid
        if cores is not None:
            # Set just after the fork: ranks are Python processes that start threads later.
            os.sched_setaffinity(rank.pid, cores[spec.local_rank])
        ranks.append(rank)
    return ranks


def report(outcome: Outcome, host: str, ranks: list[RankProcess] | None = None) -> None:
    """The final lines: each distinct traceback once, with the ranks that raised it (the failing
    rank's first), or why the node stopped."""
    if outcome.failed is not None:
        bar = "=" * 72
        blocks = [f"---- traceback of {_rank_names(group)} on host {host} ----\n{text}"
                  for text, group in distinct_tracebacks(outcome.failed, ranks or [outcome.failed])]
        print(f"\n{bar}\nzerospeed: {outcome.reason}\n" + "\n".join(blocks) + f"\n{bar}",
              file=sys.stderr, flush=True)
    elif outcome.reason and not outcome.reported:
        level = "warning" if outcome.exit_code == 0 else "error"
        print(f"zerospeed: {level}: {outcome.reason} (host {host})", file=sys.stderr, flush=True)


def distinct_tracebacks(failed: RankProcess, ranks: list[RankProcess]) -> list[tuple[str, list[RankProcess]]]:
    """(traceback, ranks that raised it) per distinct traceback, the failing rank's group first."""
    groups: dict[str, list[RankProcess]] = {failed.failure_text().rstrip(): [failed]}
    for rank in ranks:
        text = rank.held_traceback() if rank is not failed else None
        if text:
            groups.setdefault(text, []).append(rank)
    return [(text, sorted(group, key=lambda r: r.spec.rank)) for text, group in groups.items()]


def _rank_names(group: list[RankProcess]) -> str:
    if len(group) == 1:
        return f"rank {group[0].spec.rank} (local_rank {group[0].spec.local_rank})"
    return (f"ranks {', '.join(str(r.spec.rank) for r in group)} "
            f"(local_ranks {', '.join(str(r.spec.local_rank) for r in group)})")


def run(args: argparse.Namespace, stop: threading.Event, stop_signal: list[int]) -> int:
    world_info = decode_world_info(args.world_info)
    host = list(world_info)[args.node_rank] if 0 <= args.node_rank < len(world_info) else "?"
    check_node(args, host)
    command = child_command(args.training_script, args.training_script_args, args.module, args.no_python)
    specs = build_rank_specs(world_info, args.node_rank, args.master_addr, args.master_port,
                             command, args.no_local_rank, _uses_cuda())
    multi_node = len(world_info) > 1
    if multi_node:
        for spec in specs:
            spec.env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    pid_file = os.path.join(PID_FILE_DIR, f"{args.save_pid}.zerospeed") if args.save_pid else None
    with tempfile.TemporaryDirectory(prefix="zerospeed-launch-") as run_dir:
        watch = HangWatch(run_dir, hang_timeout_s(), host)
        watch.prepare(specs)
        guard = Guard()
        ranks = start_ranks(args, host, specs, run_dir, guard)
        _log(args, f"node {args.node_rank} ({host}): ranks {specs[0].rank}..{specs[-1].rank} "
                   f"of {specs[0].env['WORLD_SIZE']}, pids {[r.pid for r in ranks]}")
        try:
            # Made after the ranks started: this launcher's `import torch` (seconds on a loaded
            # machine) overlaps theirs, and their rendezvous waits for node 0's store.
            channel = _abort_channel(args, world_info, ranks) if multi_node else None
            if pid_file:
                with open(pid_file, "w") as f:
                    f.write("\n".join(str(p) for p in [os.getpid(), *(r.pid for r in ranks)]) + "\n")
            outcome = supervise(ranks, stop, stop_signal, channel, watch)
            guard.close()  # the ranks are stopped; otherwise the guard stops them as the launcher exits
        finally:
            if pid_file and os.path.exists(pid_file):
                os.remove(pid_file)
        report(outcome, host, ranks)
        return outcome.exit_code


def _abort_channel(args: argparse.Namespace, world_info: dict[str, list[int]],
                   ranks: list[RankProcess]) -> AbortChannel:
    try:
        return AbortChannel(args.master_addr, args.master_port, args.node_rank, len(world_info))
    except BaseException:
        stop_all(ranks, 0)
        raise


def install_signal_handlers() -> tuple[threading.Event, list[int]]:
    """SIGINT / SIGTERM / SIGHUP set an event the supervisor acts on (it stops all ranks)."""
    stop, received = threading.Event(), []

    def handler(signum: int, _frame: object) -> None:
        received.append(signum)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)
    return stop, received


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop, received = install_signal_handlers()
    try:
        return run(args, stop, received)
    except ValueError as exc:
        print(f"zerospeed: error: {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
