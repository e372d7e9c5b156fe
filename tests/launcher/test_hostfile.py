import pytest

from zerospeed.launcher.hostfile import (
    active_resources,
    decode_world_info,
    encode_world_info,
    parse_hostfile,
    parse_node_spec,
)

HOSTS = {"worker-0": 4, "worker-1": 2}


@pytest.mark.parametrize("text, expected", [
    ("worker-0 slots=4\nworker-1 slots=2\n", {"worker-0": 4, "worker-1": 2}),
    ("# comment\n\nworker-1 slots=2  # trailing\nworker-0 slots=1\n", {"worker-1": 2, "worker-0": 1}),
    ("10.0.0.1\tslots=8\n", {"10.0.0.1": 8}),
])
def test_hostfile_parses(text, expected):
    result = parse_hostfile(text, "hf")
    assert result == expected and list(result) == list(expected)


@pytest.mark.parametrize("text, message", [
    ("worker-0 slots=4\nworker-1 slot=2\n", "hf:2: bad hostfile entry 'worker-1 slot=2'"),
    ("worker-0\n", "hf:1: bad hostfile entry 'worker-0'"),
    ("worker-0 slots=x\n", "hf:1: bad hostfile entry"),
    ("worker-0 slots=0\n", "hf:1: host 'worker-0' has slots=0"),
    ("a slots=1\nb slots=1\na slots=2\n", "hf:3: hostfile contains multiple entries for 'a'"),
    ("# only a comment\n\n", "hf: hostfile is empty"),
])
def test_hostfile_errors_name_the_line(text, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(")):
        parse_hostfile(text, "hf")


@pytest.mark.parametrize("kwargs, expected", [
    ({}, {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1]}),
    ({"include": "worker-1"}, {"worker-1": [0, 1]}),
    ({"include": "worker-1:1@worker-0:0,2"}, {"worker-0": [0, 2], "worker-1": [1]}),  # hostfile order
    ({"exclude": "worker-0:1,3"}, {"worker-0": [0, 2], "worker-1": [0, 1]}),
    ({"exclude": "worker-0"}, {"worker-1": [0, 1]}),
    ({"exclude": "worker-1:0,1"}, {"worker-0": [0, 1, 2, 3]}),  # a host with no slots left is dropped
    ({"num_nodes": 1}, {"worker-0": [0, 1, 2, 3]}),
    ({"num_gpus": 2}, {"worker-0": [0, 1], "worker-1": [0, 1]}),
    ({"num_nodes": 1, "num_gpus": 3}, {"worker-0": [0, 1, 2]}),
])
def test_active_resources(kwargs, expected):
    result = active_resources(HOSTS, **kwargs)
    assert result == expected and list(result) == list(expected)


@pytest.mark.parametrize("kwargs, message", [
    ({"include": "worker-9"}, "--include: unknown host 'worker-9'"),
    ({"exclude": "worker-1:2"}, "--exclude: host 'worker-1' has no slot 2"),
    ({"include": "worker-0:1,x"}, "--include 'worker-0:1,x': bad slot 'x' for host 'worker-0'"),
    ({"include": "worker-0@"}, "--include 'worker-0@': empty node entry"),
    ({"include": "worker-0:1,1"}, "--include 'worker-0:1,1': host 'worker-0' lists a slot twice"),
    ({"include": "worker-0", "exclude": "worker-1"}, "--include and --exclude are mutually exclusive"),
    ({"include": "worker-0", "num_gpus": 1}, "--num_nodes / --num_gpus cannot be combined"),
    ({"exclude": "worker-0@worker-1"}, "no hosts or slots left"),
    ({"num_nodes": 3}, "--num_nodes 3: only 2 hosts available"),
    ({"num_gpus": 3}, "--num_gpus 3: host 'worker-1' has only 2 slots"),
])
def test_active_resources_errors_name_the_host_or_slot(kwargs, message):
    with pytest.raises(ValueError) as info:
        active_resources(HOSTS, **kwargs)
    assert str(info.value).startswith(message)


def test_node_spec_and_world_info_round_trip():
    assert parse_node_spec("a:0,2@b") == {"a": [0, 2], "b": []}
    resources = {"worker-1": [1], "worker-0": [0, 2]}
    decoded = decode_world_info(encode_world_info(resources))
    assert decoded == resources and list(decoded) == ["worker-1", "worker-0"]
