"""A real two-host run: two network namespaces joined by a veth pair, an sshd in each, and the
job started with ``--launcher ssh`` from the first. Its result must equal the one-host run.

Needs root, ``ip`` (iproute2), ``sshd`` and ``ssh-keygen`` (Debian's openssh-server); skips
with the reason otherwise. Each host's end of the veth pair is named ``zs0`` so that
``GLOO_SOCKET_IFNAME=zs0`` (forwarded by the runner, like every ``GLOO_*`` variable) holds on both.
"""

import json
import os
import shutil
import subprocess
import time

import pytest
from launcher_helpers import SCRIPT, alive, env, free_port, job_pids, launcher_argv

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("ip") or not os.path.exists(SSHD) or not shutil.which("ssh-keygen"),
    reason="needs root, ip (iproute2), sshd and ssh-keygen (apt-get install openssh-server iproute2)")


def sh(*argv):
    subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30)


SSHD_CONFIG = """ListenAddress {addr}
HostKey {dir}/host_key
AuthorizedKeysFile {dir}/id.pub
PidFile {dir}/sshd_{name}.pid
PasswordAuthentication no
PermitRootLogin prohibit-password
StrictModes no
UsePAM no
"""


@pytest.fixture
def two_hosts(tmp_path):
    tag = f"{os.getpid() % 100000}"
    subnet = f"10.213.{os.getpid() % 250}"
    names = [f"zs{tag}a", f"zs{tag}b"]
    addrs = [f"{subnet}.1", f"{subnet}.2"]
    sshds = []
    try:
        for ns in names:
            sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", f"zs{tag}x", "type", "veth", "peer", "name", f"zs{tag}y")
        for ns, end, addr in zip(names, (f"zs{tag}x", f"zs{tag}y"), addrs):
            sh("ip", "link", "set", end, "netns", ns)
            sh("ip", "-n", ns, "link", "set", end, "name", "zs0")
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "zs0")
            sh("ip", "-n", ns, "link", "set", "zs0", "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "host_key"))
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "id"))
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
        for ns, addr in zip(names, addrs):
            config = tmp_path / f"sshd_{ns}.conf"
            config.write_text(SSHD_CONFIG.format(addr=addr, dir=tmp_path, name=ns))
            with open(tmp_path / f"sshd_{ns}.log", "w") as log:
                sshds.append(subprocess.Popen(["ip", "netns", "exec", ns, SSHD, "-D", "-e", "-f", str(config)],
                                              stderr=log))
        time.sleep(1.0)
        yield names, addrs, tmp_path
    finally:
        for proc in sshds:
            proc.terminate()
            proc.wait(timeout=10)
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)  # removes the veth pair too


def results(stdout):
    found = [json.loads(line[len("RESULT "):]) for line in stdout.splitlines() if line.startswith("RESULT ")]
    return sorted(found, key=lambda r: r["env"]["RANK"])


def test_two_hosts_over_ssh_equal_one_host(two_hosts, tmp_path):
    names, addrs, keys = two_hosts
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"{addrs[0]} slots=1\n{addrs[1]} slots=1\n")
    ssh_args = (f"-i {keys}/id -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null "
                "-o LogLevel=ERROR -o ConnectTimeout=10")
    port = free_port()
    (tmp_path / "pids").mkdir()
    # No --master_addr: the runner asks the first host (`ssh host hostname -I`), as DeepSpeed does.
    two = subprocess.run(["ip", "netns", "exec", names[0],
                          *launcher_argv("-H", str(hostfile), "--launcher", "ssh", f"--launcher_args={ssh_args}",
                                         "--master_port", str(port),
                                         SCRIPT, "env", str(tmp_path / "pids"))],
                         env=env(GLOO_SOCKET_IFNAME="zs0"), check=False, capture_output=True, text=True, timeout=180)
    assert two.returncode == 0, two.stderr[-4000:]
    one = subprocess.run(launcher_argv("--num_gpus", "2", SCRIPT, "env", str(tmp_path / "pids")),
                         env=env(), check=False, capture_output=True, text=True, timeout=120)
    assert one.returncode == 0, one.stderr[-4000:]
    got, expected = results(two.stdout), results(one.stdout)
    assert [r["sum"] for r in got] == [r["sum"] for r in expected] == [3.0, 3.0]
    assert [(r["env"]["CROSS_RANK"], r["env"]["CROSS_SIZE"], r["env"]["MASTER_ADDR"]) for r in got] == [
        ("0", "2", addrs[0]), ("1", "2", addrs[0])]

    # A rank that raises on the second host stops the first host's rank too, well within 30 s.
    (tmp_path / "pids_fail").mkdir()
    start = time.monotonic()
    fail = subprocess.run(["ip", "netns", "exec", names[0],
                           *launcher_argv("-H", str(hostfile), "--launcher", "ssh", f"--launcher_args={ssh_args}",
                                          "--master_addr", addrs[0], "--master_port", str(free_port()),
                                          SCRIPT, "raise", str(tmp_path / "pids_fail"))],
                          env=env(), check=False, capture_output=True, text=True, timeout=120)
    assert fail.returncode == 1 and time.monotonic() - start < 30
    assert f"traceback of rank 1 (local_rank 0) on host {addrs[1]}" in fail.stderr
    assert f"stopped: rank 1 on host {addrs[1]} failed" in fail.stderr
    assert alive(job_pids(tmp_path / "pids_fail", 2)) == []
