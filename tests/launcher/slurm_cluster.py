"""A one-node Slurm cluster of the test's own: munged, slurmctld and slurmd on this machine, with
their key, sockets, state and logs in a temporary directory and free ports, so nothing of the
system's configuration (``/etc/slurm``, ``/etc/munge``) is read or changed.

Needs root and Debian's ``slurmctld``, ``slurmd``, ``slurm-client`` and ``munge``; ``missing()``
says what is absent. Clients find the cluster through ``SLURM_CONF`` (``Cluster.env``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from launcher_helpers import stop_process

DAEMONS = ("munged", "slurmctld", "slurmd", "srun", "sinfo", "squeue", "scancel")

# proctrack/pgid: a cancelled step's processes are found by process group, so what a rank forked
# dies with it even after the rank itself has exited (linuxproc loses such orphans, and their
# open stdout keeps srun waiting 60 s for the step's I/O).
SLURM_CONF = """ClusterName=zstest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={dir}/munge.sock
CredType=cred/munge
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName={host} NodeAddr=127.0.0.1 CPUs=4 State=UNKNOWN
PartitionName=zstest Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (slurmd runs jobs as any user)"
    absent = [d for d in DAEMONS if not shutil.which(d)]
    return f"needs {', '.join(absent)} on PATH" if absent else None


@dataclass
class Cluster:
    node: str  # the node's name: this machine's hostname
    conf: Path

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def slurm_cluster(workdir: Path) -> Iterator[Cluster]:
    """The running cluster; on exit its jobs are cancelled and the three daemons stopped."""
    host = socket.gethostname().split(".")[0]
    for sub in ("state", "spool"):
        (workdir / sub).mkdir()
    key = workdir / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    conf = workdir / "slurm.conf"
    conf.write_text(SLURM_CONF.format(host=host, dir=workdir, ctld_port=_free_port(), slurmd_port=_free_port()))
    cluster = Cluster(host, conf)
    env = {**os.environ, **cluster.env}
    daemons: list[subprocess.Popen] = []
    try:
        for argv in (["munged", "-F", "-f", f"--key-file={key}", f"--socket={workdir}/munge.sock",
                      f"--pid-file={workdir}/munged.pid", f"--log-file={workdir}/munged.log",
                      f"--seed-file={workdir}/munged.seed"],
                     ["slurmctld", "-D", "-i", "-f", str(conf)],
                     ["slurmd", "-D", "-f", str(conf)]):
            with open(workdir / f"{argv[0]}.out", "w") as out:
                daemons.append(subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT))
        _wait_for_idle(cluster, env, workdir)
        yield cluster
    finally:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(["scancel", "--full", "--user=root"], env=env, capture_output=True, timeout=10)
            _wait_until_no_jobs(env)
        for proc in reversed(daemons):
            stop_process(proc, 15)


def _wait_for_idle(cluster: Cluster, env: dict[str, str], workdir: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = subprocess.run(["sinfo", "-h", "-n", cluster.node, "-o", "%t"], env=env,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        if state == "idle":
            return
        time.sleep(0.3)
    logs = "\n".join(p.read_text()[-2000:] for p in workdir.glob("*.out"))
    raise AssertionError(f"the test's Slurm node did not become idle:\n{logs}")


def _wait_until_no_jobs(env: dict[str, str], timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        jobs = subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True, timeout=10).stdout
        if not jobs.strip():
            return
        time.sleep(0.3)
