import shlex

import pytest

from zerospeed.launcher.hostfile import encode_world_info
from zerospeed.launcher.multinode_runner import Job, build_plan
from zerospeed.launcher.runner import forwarded_env, read_env_files

RES = {"node-a": [0, 1], "node-b": [0, 1]}
WI = encode_world_info(RES)


def job(**overrides):
    base = {"resources": RES, "master_addr": "10.0.0.1", "master_port": 29500, "user_script": "train.py",
            "user_args": ["--lr", "1 e-3"], "python": "/venv/bin/python", "cwd": "/work dir",
            "exports": {"PYTHONPATH": "/work dir", "NCCL_DEBUG": "INFO"},
            "launch_flags": ["--no_local_rank"], "hostfile": "/job/hostfile"}
    return Job(**{**base, **overrides})


def remote(node_rank):
    return ("export PYTHONPATH='/work dir'; export NCCL_DEBUG=INFO; cd '/work dir'; "
            f"/venv/bin/python -u -m zerospeed.launcher.launch --world_info={WI} --node_rank={node_rank} "
            "--master_addr=10.0.0.1 --master_port=29500 --no_local_rank train.py --lr '1 e-3'")


def test_pdsh():
    plan = build_plan("pdsh", job(ssh_port=2222, launcher_args=["-R", "ssh"]))
    assert plan.commands == [["pdsh", "-S", "-f", "1024", "-w", "node-a,node-b", "-R", "ssh", remote("%n")]]
    assert plan.env == {"PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS_APPEND": "-p 2222"}
    # the user's own pdsh ssh options stay in force
    mine = build_plan("pdsh", job(ssh_port=2222, pdsh_ssh_args="-i /k -o BatchMode=yes"))
    assert mine.env["PDSH_SSH_ARGS_APPEND"] == "-i /k -o BatchMode=yes -p 2222"


def test_ssh_one_command_per_node():
    plan = build_plan("SSH", job(ssh_port=2222))
    assert plan.commands == [["ssh", "-o", "BatchMode=yes", "-p", "2222", "node-a", remote("0")],
                             ["ssh", "-o", "BatchMode=yes", "-p", "2222", "node-b", remote("1")]]
    # the remote shell sees the arguments intact
    assert shlex.split(plan.commands[1][-1])[-3:] == ["train.py", "--lr", "1 e-3"]


def test_openmpi():
    plan = build_plan("openmpi", job())
    assert plan.commands == [[
        "mpirun", "-n", "4", "-hostfile", "/job/hostfile", "--mca", "btl", "^openib",
        "--mca", "btl_tcp_if_include", "eth0", "-x", "PYTHONPATH=/work dir", "-x", "NCCL_DEBUG=INFO",
        "-x", "UCX_TLS=tcp", "-x", "MASTER_ADDR=10.0.0.1", "-x", "MASTER_PORT=29500", "/venv/bin/python", "-u", "train.py", "--lr", "1 e-3"]]
    mine = build_plan("openmpi", job(launcher_args=["--mca", "btl_tcp_if_include", "ib0"], module=True))
    assert mine.commands[0].count("btl_tcp_if_include") == 1
    assert mine.commands[0][-5:] == ["-u", "-m", "train.py", "--lr", "1 e-3"]
    with pytest.raises(ValueError, match="openmpi takes its hosts from the hostfile"):
        build_plan("openmpi", job(filtered=True))


def test_mpich():
    plan = build_plan("mpich", job(exports={}, no_python=True))
    assert plan.commands == [[
        "mpirun", "-n", "4", "-ppn", "2", "-genv", "MASTER_ADDR", "10.0.0.1", "-genv", "MASTER_PORT",
        "29500", "-genv", "WORLD_SIZE", "4", "-genv", "LOCAL_SIZE", "2", "-hosts", "node-a,node-b",
        "train.py", "--lr", "1 e-3"]]
    with pytest.raises(ValueError, match="same number of slots on every node"):
        build_plan("mpich", job(resources={"node-a": [0, 1], "node-b": [0]}))


def test_slurm():
    plan = build_plan("slurm", job(exports={"NCCL_DEBUG": "INFO"}, launcher_args=["--comment", "x"]))
    assert plan.commands == [[
        "srun", "-n", "4", "--nodes=2", "--nodelist=node-a,node-b", "--kill-on-bad-exit=1",
        "--comment", "x", "--export=ALL,NCCL_DEBUG=INFO,MASTER_ADDR=10.0.0.1,MASTER_PORT=29500,WORLD_SIZE=4",
        "/venv/bin/python", "-u", "train.py", "--lr", "1 e-3"]]
    assert plan.env == {}
    # srun would split a value at its comma: such a variable travels in srun's environment
    listed = build_plan("slurm", job(exports={"NCCL_SOCKET_IFNAME": "eth0,eth1", "NCCL_DEBUG": "INFO"}))
    assert "NCCL_SOCKET_IFNAME" not in " ".join(listed.commands[0])
    assert listed.env == {"NCCL_SOCKET_IFNAME": "eth0,eth1"}


def test_unknown_launcher():
    with pytest.raises(ValueError, match="--launcher 'mvapich' is not one of pdsh, ssh"):
        build_plan("mvapich", job())


def test_forwarded_env_and_env_file(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / ".deepspeed_env").write_text("# mine\nFOO=bar=baz\nNCCL_DEBUG=WARN\n")
    env = forwarded_env({"PATH": "/bin", "PYTHONPATH": "/lib", "NCCL_DEBUG": "INFO", "GLOO_SOCKET_IFNAME": "veth0",
                         "SECRET": "no", "HOME": "/h"}, str(tmp_path))
    assert env == {"PATH": "/bin", "PYTHONPATH": f"{tmp_path}:/lib", "NCCL_DEBUG": "WARN",
                   "GLOO_SOCKET_IFNAME": "veth0", "FOO": "bar=baz"}
    (tmp_path / "bad_env").write_text("FOO=1\nnot a pair\n")
    with pytest.raises(ValueError, match="bad_env:2: expected KEY=VAL"):
        read_env_files([str(tmp_path / "bad_env")])
