"""Multi-node command construction: pdsh, ssh, openmpi, mpich, slurm.

Pure functions from a ``Job`` (plain data) to a ``Plan``: the local commands to run side by side
(one for pdsh / mpirun / srun, one per node for ssh) and extra environment for them. Nothing
here starts a process, so tests compare argv lists.

pdsh and ssh run ``python -u -m zerospeed.launcher.launch`` on every node (which brings the
per-node fail-fast and the cross-node abort channel); the environment is forwarded explicitly as
``export K=V;`` in the remote shell command. openmpi, mpich and slurm start the user script
directly, one process per rank; ``zerospeed.comm.init_distributed`` maps their rank variables
(OMPI_*, PMI_*, SLURM_*), and their own runtimes stop the job when a rank fails
(mpirun does by default, srun is given ``--kill-on-bad-exit=1``).
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass, field

from zerospeed.launcher.hostfile import encode_world_info

__all__ = ["RUNNERS", "Job", "Plan", "build_plan", "remote_launch_command"]


@dataclass
class Job:
    """Everything a backend needs to know; built by ``runner.py``."""

    resources: dict[str, list[int]]
    master_addr: str
    master_port: int
    user_script: str
    user_args: list[str]
    python: str
    cwd: str
    exports: dict[str, str] = field(default_factory=dict)
    launch_flags: list[str] = field(default_factory=list)  # forwarded to launch.py (pdsh, ssh)
    launcher_args: list[str] = field(default_factory=list)  # --launcher_args, split
    module: bool = False
    no_python: bool = False
    hostfile: str = ""
    filtered: bool = False  # --include / --exclude / --num_nodes / --num_gpus were given
    ssh_port: int | None = None
    pdsh_ssh_args: str = ""  # the caller's PDSH_SSH_ARGS_APPEND (pdsh's extra ssh options)

    @property
    def num_ranks(self) -> int:
        return sum(len(slots) for slots in self.resources.values())


@dataclass
class Plan:
    commands: list[list[str]]
    env: dict[str, str] = field(default_factory=dict)


def remote_launch_command(job: Job, node_rank: str) -> str:
    """The shell command line run on a node: exports, cd, then the per-node launcher."""
    exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in job.exports.items())
    argv = [job.python, "-u", "-m", "zerospeed.launcher.launch",
            f"--world_info={encode_world_info(job.resources)}", f"--node_rank={node_rank}",
            f"--master_addr={job.master_addr}", f"--master_port={job.master_port}",
            *job.launch_flags, job.user_script, *job.user_args]
    quoted = " ".join(a if a == f"--node_rank={node_rank}" else shlex.quote(a) for a in argv)
    return f"{exports}cd {shlex.quote(job.cwd)}; {quoted}"


def _script_argv(job: Job) -> list[str]:
    if job.no_python:
        return [job.user_script, *job.user_args]
    return [job.python, "-u", *(["-m"] if job.module else []), job.user_script, *job.user_args]


def _slots_per_node(job: Job, launcher: str) -> int:
    counts = {len(slots) for slots in job.resources.values()}
    if len(counts) != 1:
        raise ValueError(f"--launcher {launcher} needs the same number of slots on every node, "
                         f"got { {h: len(s) for h, s in job.resources.items()} }")
    return counts.pop()


def pdsh_plan(job: Job) -> Plan:
    env = {"PDSH_RCMD_TYPE": "ssh"}
    if job.ssh_port is not None:  # added to the user's own ssh options, which stay in force
        env["PDSH_SSH_ARGS_APPEND"] = " ".join(a for a in (job.pdsh_ssh_args, f"-p {job.ssh_port}") if a)
    command = ["pdsh", "-S", "-f", "1024", "-w", ",".join(job.resources), *job.launcher_args,
               remote_launch_command(job, "%n")]
    return Plan([command], env)


def ssh_plan(job: Job) -> Plan:
    port = ["-p", str(job.ssh_port)] if job.ssh_port is not None else []
    return Plan([["ssh", "-o", "BatchMode=yes", *port, *job.launcher_args, host,
                  remote_launch_command(job, str(i))]
                 for i, host in enumerate(job.resources)])


def openmpi_plan(job: Job) -> Plan:
    if job.filtered:
        raise ValueError("--launcher openmpi takes its hosts from the hostfile: "
                         "--include / --exclude / --num_nodes / --num_gpus are not supported")
    mca = [] if "btl_tcp_if_include" in " ".join(job.launcher_args) else \
        ["--mca", "btl_tcp_if_include", "eth0"]
    # Open MPI gives each rank its rank and size (OMPI_COMM_WORLD_*), not the rendezvous
    # address: without MASTER_* a rank on another host would wait on its own 127.0.0.1.
    exports = {**job.exports, "UCX_TLS": "tcp", "MASTER_ADDR": job.master_addr,
               "MASTER_PORT": str(job.master_port)}
    env_args = [a for k, v in exports.items() for a in ("-x", f"{k}={v}")]
    return Plan([["mpirun", "-n", str(job.num_ranks), "-hostfile", job.hostfile,
                  "--mca", "btl", "^openib", *mca, *job.launcher_args, *env_args, *_script_argv(job)]])


def _rank_exports(job: Job) -> dict[str, str]:
    return {**job.exports, "MASTER_ADDR": job.master_addr, "MASTER_PORT": str(job.master_port),
            "WORLD_SIZE": str(job.num_ranks)}


def mpich_plan(job: Job) -> Plan:
    per_node = _slots_per_node(job, "mpich")
    exports = {**_rank_exports(job), "LOCAL_SIZE": str(per_node)}
    env_args = [a for k, v in exports.items() for a in ("-genv", k, v)]
    return Plan([["mpirun", "-n", str(job.num_ranks), "-ppn", str(per_node), *env_args,
                  "-hosts", ",".join(job.resources), *job.launcher_args, *_script_argv(job)]])


def slurm_plan(job: Job) -> Plan:
    # srun splits --export at every comma, values included; a value with a comma
    # (NCCL_SOCKET_IFNAME=eth0,eth1) goes through srun's own environment, which ALL forwards.
    exports = _rank_exports(job)
    inline = ",".join(f"{k}={v}" for k, v in exports.items() if "," not in v)
    return Plan([["srun", "-n", str(job.num_ranks), f"--nodes={len(job.resources)}",
                  f"--nodelist={','.join(job.resources)}", "--kill-on-bad-exit=1",
                  *job.launcher_args, f"--export=ALL,{inline}", *_script_argv(job)]],
                {k: v for k, v in exports.items() if "," in v})


RUNNERS: dict[str, Callable[[Job], Plan]] = {
    "pdsh": pdsh_plan,
    "ssh": ssh_plan,
    "openmpi": openmpi_plan,
    "mpich": mpich_plan,
    "slurm": slurm_plan,
}


def build_plan(launcher: str, job: Job) -> Plan:
    plan = RUNNERS.get(launcher.lower())
    if plan is None:
        raise ValueError(f"--launcher {launcher!r} is not one of {', '.join(RUNNERS)}")
    return plan(job)
