"""`zerospeed` (DeepSpeed's `deepspeed` command): resolve resources, then launch one node or many.

``zerospeed [options] script [script args]``. The flags are DeepSpeed's runner flags
(``deepspeed/launcher/runner.py::parse_args``). Resources come from the hostfile (default ``/job/hostfile``;
when it is missing, this machine only: ``--num_gpus`` processes, or one per CUDA device, or one
on CPU), filtered by ``--include`` / ``--exclude`` / ``--num_nodes`` / ``--num_gpus``.

One host (and no ``--force_multi``): the per-node launcher runs in this process. Several hosts:
``multinode_runner`` builds the pdsh / ssh / mpirun / srun commands; this process runs them,
forwards the environment (PATH, PYTHONPATH with the current directory first, NCCL_* / GLOO_* /
ZS_* / ... and the ``KEY=VAL`` lines of ``~/.deepspeed_env`` and ``./.deepspeed_env``), and
stops the job everywhere when one node fails or this process is signalled.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from zerospeed.launcher import launch
from zerospeed.launcher.hostfile import DEFAULT_HOSTFILE, active_resources, encode_world_info, fetch_hostfile
from zerospeed.launcher.multinode_runner import Job, build_plan

__all__ = ["DEEPSPEED_ENVIRONMENT_NAME", "main", "parse_args"]

EXPORT_PREFIXES = ("NCCL_", "GLOO_", "PYTHON", "MLFLOW", "UCX_", "MV2_", "ZS_", "DS_", "TORCH_", "OMP_")
EXPORT_NAMES = ("PATH", "LD_LIBRARY_PATH")
ENV_FILE = ".deepspeed_env"
DEEPSPEED_ENVIRONMENT_NAME = ENV_FILE  # DeepSpeed's name for it (accelerate imports this one)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="zerospeed", description="zerospeed launcher (DeepSpeed's flags)")
    p.add_argument("-H", "--hostfile", default=DEFAULT_HOSTFILE, help="'host slots=N' per line")
    p.add_argument("-i", "--include", default="", help="NODE_SPEC[@NODE_SPEC...], NODE_SPEC=HOST[:SLOT,...]")
    p.add_argument("-e", "--exclude", default="", help="same syntax as --include")
    p.add_argument("--num_nodes", type=int, default=-1, help="use the first N hosts")
    p.add_argument("--num_gpus", "--num_accelerators", dest="num_gpus", type=int, default=-1,
                   help="slots 0..N-1 of each host (on CPU: N processes)")
    p.add_argument("--master_port", type=int, default=None, help="default: a free port (one node), 29500")
    p.add_argument("--master_addr", default="", help="default: 127.0.0.1 (one node), the first host")
    p.add_argument("--node_rank", type=int, default=-1, help="with --no_ssh: this node's rank")
    p.add_argument("--launcher", default="pdsh", help="pdsh, ssh, openmpi, mpich, slurm")
    p.add_argument("--launcher_args", default="", help="extra launcher arguments (shlex-split)")
    p.add_argument("--module", action="store_true", help="run the script as `python -m`")
    p.add_argument("--no_python", action="store_true", help="execute the script directly")
    p.add_argument("--no_local_rank", action="store_true", help="do not pass --local_rank=N")
    p.add_argument("--no_ssh", action="store_true", help="launch only this node (needs --node_rank)")
    p.add_argument("--no_ssh_check", action="store_true", help="accepted; no probe is made")
    p.add_argument("--force_multi", action="store_true", help="multi-node path even for one host")
    p.add_argument("--save_pid", action="store_true", help="write /tmp/<pid>.zerospeed")
    p.add_argument("--enable_each_rank_log", default="None", help="directory for one log per rank")
    p.add_argument("--bind_cores_to_rank", action="store_true")
    p.add_argument("--bind_core_list", default=None)
    p.add_argument("--ssh_port", type=int, default=None)
    p.add_argument("--log_level", default="info", choices=["debug", "info", "warning", "error", "critical"])
    p.add_argument("-q", "--quiet", action="store_true")
    p.add_argument("user_script", help="the training script (or module, or executable)")
    p.add_argument("user_args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.no_ssh and args.node_rank < 0:
        p.error("--no_ssh needs --node_rank")
    return args


def _local_device_count() -> int:
    requested = (os.environ.get("ZS_ACCELERATOR") or os.environ.get("DS_ACCELERATOR") or "").lower()
    if requested == "cpu" or (not requested and not os.path.exists("/dev/nvidiactl")):
        return 1
    import torch

    return max(1, torch.cuda.device_count())


def resolve_resources(args: argparse.Namespace) -> dict[str, list[int]]:
    hosts = fetch_hostfile(args.hostfile)
    include, num_gpus = args.include, args.num_gpus
    if hosts is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        if visible and not (include or args.exclude or num_gpus > 0 or args.num_nodes > 0):
            include = "localhost:" + visible
            del os.environ["CUDA_VISIBLE_DEVICES"]  # launch.py sets it per node again
            hosts = {"localhost": max(int(d) for d in visible.split(",")) + 1}
        else:
            hosts = {"localhost": num_gpus if num_gpus > 0 else _local_device_count()}
    return active_resources(hosts, include, args.exclude, args.num_nodes, num_gpus)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def launch_flags(args: argparse.Namespace) -> list[str]:
    """The flags of the per-node launcher that follow from the runner's."""
    flags = [f"--{name}" for name in ("module", "no_python", "no_local_rank", "bind_cores_to_rank")
             if getattr(args, name)]
    if args.save_pid:
        flags.append(f"--save_pid={os.getpid()}")
    if args.enable_each_rank_log != "None":
        flags.append(f"--enable_each_rank_log={args.enable_each_rank_log}")
    if args.bind_core_list:
        flags.append(f"--bind_core_list={args.bind_core_list}")
    if args.quiet:
        flags.append("--quiet")
    return [*flags, f"--log_level={args.log_level}", f"--expect_versions={launch.version_tag()}"]


def read_env_files(paths: list[str]) -> dict[str, str]:
    """``KEY=VAL`` lines of DeepSpeed-style env files (later files win); ``#`` starts a comment."""
    env: dict[str, str] = {}
    for path in paths:
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            for line_no, raw in enumerate(f, start=1):
                line = raw.strip()
                if not line or line.startswith("#"):
                    continue
                key, sep, value = line.partition("=")
                if not sep or not key.strip():
                    raise ValueError(f"{path}:{line_no}: expected KEY=VAL, got {line!r}")
                env[key.strip()] = value.strip()
    return env


def forwarded_env(environ: dict[str, str], cwd: str) -> dict[str, str]:
    exports = {k: v for k, v in environ.items() if k in EXPORT_NAMES or k.startswith(EXPORT_PREFIXES)}
    exports["PYTHONPATH"] = os.pathsep.join(p for p in (cwd, environ.get("PYTHONPATH", "")) if p)
    name = environ.get("DS_ENV_FILE", ENV_FILE)
    exports.update(read_env_files([os.path.join(os.path.expanduser("~"), name), os.path.join(cwd, name)]))
    return exports


def _first_host_address(args: argparse.Namespace, host: str) -> str:
    """DeepSpeed's default master address: the first of ``ssh <host> hostname -I``."""
    if args.launcher.lower() not in ("pdsh", "ssh"):
        return host
    port = ["-p", str(args.ssh_port)] if args.ssh_port else []
    # The same ssh options as the launch itself: --launcher_args for ssh, pdsh's own variable.
    ssh_args = shlex.split(args.launcher_args if args.launcher.lower() == "ssh"
                           else os.environ.get("PDSH_SSH_ARGS_APPEND", ""))
    try:
        out = subprocess.run(["ssh", "-o", "BatchMode=yes", *port, *ssh_args, host, "hostname -I"],
                             capture_output=True, text=True, timeout=30, check=True).stdout.split()
        return out[0] if out else host
    except (OSError, subprocess.SubprocessError):
        return host


def run_single_node(args: argparse.Namespace, resources: dict[str, list[int]], node_rank: int) -> int:
    argv = [f"--world_info={encode_world_info(resources)}", f"--node_rank={node_rank}",
            f"--master_addr={args.master_addr}", f"--master_port={args.master_port}",
            *launch_flags(args), args.user_script, *args.user_args]
    return launch.main(argv)


def run_multi_node(args: argparse.Namespace, resources: dict[str, list[int]]) -> int:
    cwd = os.path.abspath(".")
    job = Job(resources=resources, master_addr=args.master_addr, master_port=args.master_port,
              user_script=args.user_script, user_args=args.user_args, python=sys.executable, cwd=cwd,
              exports=forwarded_env(dict(os.environ), cwd), launch_flags=launch_flags(args),
              launcher_args=shlex.split(args.launcher_args), module=args.module,
              no_python=args.no_python, hostfile=args.hostfile, ssh_port=args.ssh_port,
              pdsh_ssh_args=os.environ.get("PDSH_SSH_ARGS_APPEND", ""),
              filtered=bool(args.include or args.exclude or args.num_nodes > 0 or args.num_gpus > 0))
    plan = build_plan(args.launcher, job)
    if not args.quiet:
        for command in plan.commands:
            print(f"[zerospeed] cmd = {shlex.join(command)}", file=sys.stderr, flush=True)
    stop, received = launch.install_signal_handlers()
    env = {**os.environ, **plan.env}
    procs = [subprocess.Popen(c, env=env, start_new_session=True) for c in plan.commands]
    uses_store = args.launcher.lower() in ("pdsh", "ssh")
    return _wait_for_nodes(procs, stop, received, args if uses_store else None)


def _failed_code(procs: list[subprocess.Popen]) -> int | None:
    """The exit code of the first command that failed (128 + signal if it was killed), if any."""
    for proc in procs:
        code = proc.poll()
        if code:
            return code if code > 0 else 128 - code
    return None


def _wait_for_nodes(procs: list[subprocess.Popen], stop: threading.Event, received: list[int],
                    store_args: argparse.Namespace | None) -> int:
    """Exit with the first non-zero code; on a failure or a signal, stop the job everywhere."""
    while any(p.poll() is None for p in procs) and _failed_code(procs) is None and not stop.is_set():
        stop.wait(0.2)
    failed_code = _failed_code(procs)
    if failed_code is None and not stop.is_set():
        return 0
    if failed_code is None:
        failed_code = 128 + (received[0] if received else signal.SIGTERM)
    if not stop.is_set():  # a node failed: the others normally stop themselves on its abort
        _wait_until(lambda: all(p.poll() is not None for p in procs), 3.0)
    # Node 0's launcher hosts the store; once it has exited the others see the store go.
    if store_args is not None and procs[0].poll() is None:
        _raise_remote_abort(store_args, "the zerospeed runner stopped the job")
    deadline = time.monotonic() + 30  # the node launchers stop their ranks on the abort
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline and not stop.is_set():
        time.sleep(0.2)
    _stop_commands(procs)
    return failed_code


def _stop_commands(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    """SIGTERM the node commands (ssh, pdsh, mpirun, srun) still running, SIGKILL them after
    `grace_s`: a client that ignores SIGTERM must not keep the runner waiting forever."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, sig)
        _wait_until(lambda: all(p.poll() is not None for p in procs), grace_s)
    for p in procs:
        p.wait()


def _wait_until(done: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.1)


def _raise_remote_abort(args: argparse.Namespace, message: str) -> None:
    from datetime import timedelta

    from torch.distributed import TCPStore

    with contextlib.suppress(Exception):  # node 0 is already gone: the others see that too
        store = TCPStore(args.master_addr, args.master_port, None, False, timedelta(seconds=3))
        if not store.check(["zerospeed/abort"]):
            store.set("zerospeed/abort", message)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["estimate"]:  # `zerospeed estimate ...`: the ZeRO memory estimator CLI
        from zerospeed.runtime.zero.estimate_cli import main as estimate_main

        return estimate_main(argv[1:])
    args = parse_args(argv)
    try:
        resources = resolve_resources(args)
    except ValueError as exc:
        print(f"zerospeed: error: {exc}", file=sys.stderr)
        return 2
    multi = len(resources) > 1 or args.force_multi
    if args.no_ssh:
        args.master_addr = args.master_addr or next(iter(resources))
        args.master_port = args.master_port or 29500
        return run_single_node(args, resources, args.node_rank)
    if not multi:
        args.master_addr = args.master_addr or "127.0.0.1"
        args.master_port = args.master_port or _free_port()
        return run_single_node(args, resources, 0)
    args.master_port = args.master_port or 29500
    args.master_addr = args.master_addr or _first_host_address(args, next(iter(resources)))
    try:
        return run_multi_node(args, resources)
    except ValueError as exc:
        print(f"zerospeed: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
