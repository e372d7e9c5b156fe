"""Two "hosts" on this machine: network namespaces joined by a veth pair, an sshd in each.

Shared by the tests that start real multi-node jobs (ssh, pdsh, Open MPI). Each host's end of
the veth pair is named ``zs0`` so that ``GLOO_SOCKET_IFNAME=zs0`` (and Open MPI's
``*_if_include zs0``) hold on both. Needs root, ``ip`` (iproute2), ``sshd`` and ``ssh-keygen``
(openssh-server); ``missing()`` says what is absent so a test can skip with the reason.
The file system is shared, so the same Python, zerospeed and test script exist on both hosts.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from launcher_helpers import stop_process

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"

SSHD_CONFIG = """ListenAddress {addr}
HostKey {dir}/host_key
AuthorizedKeysFile {dir}/id.pub
PidFile {dir}/sshd_{name}.pid
PasswordAuthentication no
PermitRootLogin prohibit-password
StrictModes no
UsePAM no
"""


def missing(*tools: str) -> str | None:
    """Why the two hosts (plus ``tools``) cannot be set up here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    absent = [t for t in ("ip", "ssh", "ssh-keygen", *tools) if not shutil.which(t)]
    if not os.path.exists(SSHD):
        absent.append("sshd")
    return f"needs {', '.join(absent)} on PATH" if absent else None


@dataclass
class Hosts:
    names: list[str]  # the network namespaces
    addrs: list[str]  # each host's address on zs0
    key: Path  # the client's private key, accepted by both sshds

    @property
    def ssh_options(self) -> str:
        return (f"-i {self.key} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null "
                "-o LogLevel=ERROR -o ConnectTimeout=10 -o BatchMode=yes")

    def on(self, host: int, argv: list[str]) -> list[str]:
        """``argv`` run on host number ``host``."""
        return ["ip", "netns", "exec", self.names[host], *argv]

    def hostfile(self, path: Path, slots: int = 1) -> Path:
        path.write_text("".join(f"{a} slots={slots}\n" for a in self.addrs))
        return path


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30)


@contextlib.contextmanager
def two_hosts(workdir: Path) -> Iterator[Hosts]:
    """The hosts, torn down (sshds stopped, namespaces and the veth pair deleted) on exit."""
    tag = f"{os.getpid() % 100000}"
    subnet = f"10.213.{os.getpid() % 250}"
    names, addrs = [f"zs{tag}a", f"zs{tag}b"], [f"{subnet}.1", f"{subnet}.2"]
    sshds: list[subprocess.Popen] = []
    try:
        for ns in names:
            _sh("ip", "netns", "add", ns)
        _sh("ip", "link", "add", f"zs{tag}x", "type", "veth", "peer", "name", f"zs{tag}y")
        for ns, end, addr in zip(names, (f"zs{tag}x", f"zs{tag}y"), addrs):
            _sh("ip", "link", "set", end, "netns", ns)
            _sh("ip", "-n", ns, "link", "set", end, "name", "zs0")
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "zs0")
            _sh("ip", "-n", ns, "link", "set", "zs0", "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(workdir / "host_key"))
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(workdir / "id"))
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
        for ns, addr in zip(names, addrs):
            config = workdir / f"sshd_{ns}.conf"
            config.write_text(SSHD_CONFIG.format(addr=addr, dir=workdir, name=ns))
            with open(workdir / f"sshd_{ns}.log", "w") as log:
                sshds.append(subprocess.Popen(["ip", "netns", "exec", ns, SSHD, "-D", "-e", "-f", str(config)],
                                              stderr=log))
        hosts = Hosts(names, addrs, workdir / "id")
        _wait_for_sshd(hosts)
        yield hosts
    finally:
        for ns in names:  # whatever a test left running on a host: its launcher, pdsh, orted, ranks
            kill_all_in(ns)
        for proc in sshds:
            stop_process(proc, 10)
        for ns in names:  # deleting a namespace removes its veth end, and so the pair
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)


def kill_all_in(ns: str) -> None:
    """SIGKILL every process in network namespace ``ns`` (all were started by the test)."""
    found = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False)
    for pid in found.stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


def _wait_for_sshd(hosts: Hosts, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    for ns, addr in zip(hosts.names, hosts.addrs):
        while True:
            probe = subprocess.run(["ip", "netns", "exec", ns, "bash", "-c", f"exec 3<>/dev/tcp/{addr}/22"],
                                   capture_output=True, timeout=10)
            if probe.returncode == 0:
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"sshd on {addr} ({ns}) did not start")
            time.sleep(0.1)
