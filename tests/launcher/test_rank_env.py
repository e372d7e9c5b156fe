import sys

import pytest

from zerospeed.launcher.launch import build_rank_specs, check_node, child_command, parse_args, version_tag

WORLD = {"node-a": [0, 1], "node-b": [2, 3, 5]}


def test_ranks_are_consecutive_over_nodes_with_deepspeeds_env():
    cmd = child_command("train.py", ["--lr", "1"], module=False, no_python=False)
    specs = build_rank_specs(WORLD, 1, "10.0.0.1", 1234, cmd, cuda=True)
    assert [s.rank for s in specs] == [2, 3, 4]
    assert specs[2].env == {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234", "WORLD_SIZE": "5",
                            "CROSS_RANK": "1", "CROSS_SIZE": "2", "LOCAL_SIZE": "3",
                            "CUDA_VISIBLE_DEVICES": "2,3,5", "RANK": "4", "LOCAL_RANK": "2"}
    assert specs[2].argv == [sys.executable, "-u", "train.py", "--local_rank=2", "--lr", "1"]


@pytest.mark.parametrize("module, no_python, no_local_rank, argv", [
    (True, False, False, [sys.executable, "-u", "-m", "pkg.train", "--local_rank=0", "--x"]),
    (False, True, False, ["pkg.train", "--local_rank=0", "--x"]),
    (False, False, True, [sys.executable, "-u", "pkg.train", "--x"]),
])
def test_command_variants(module, no_python, no_local_rank, argv):
    cmd = child_command("pkg.train", ["--x"], module=module, no_python=no_python)
    spec = build_rank_specs({"h": [0]}, 0, "127.0.0.1", 1, cmd, no_local_rank=no_local_rank)[0]
    assert spec.argv == argv and "CUDA_VISIBLE_DEVICES" not in spec.env


def test_bad_node_rank():
    with pytest.raises(ValueError, match="--node_rank 2 is outside the 2 nodes"):
        build_rank_specs(WORLD, 2, "a", 1, ["x"])


def test_every_node_checks_versions_and_the_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    ok = parse_args(["--world_info=x", f"--expect_versions={version_tag()}", str(script)])
    check_node(ok, "node-b")
    with pytest.raises(ValueError, match=r"host 'node-b' runs python=.*, but the job was started with python=2.7"):
        check_node(parse_args(["--world_info=x", "--expect_versions=python=2.7,zerospeed=0.0", str(script)]),
                    "node-b")
    with pytest.raises(ValueError, match="executable 'no-such-tool' not found on host 'node-b'"):
        check_node(parse_args(["--world_info=x", "--no_python", "no-such-tool"]), "node-b")
