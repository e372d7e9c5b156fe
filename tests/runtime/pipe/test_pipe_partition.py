"""Layer partitioning: DeepSpeed's boundaries, as plain ints, for each partition_method."""

import json
import os
import random
import subprocess
import sys

import pytest
import torch

from deepspeed_extensions import require_deepspeed

from zerospeed.pipe import LayerSpec
from zerospeed.runtime.pipe.partition import partition_balanced, partition_uniform, partition_weights

CASES = [([random.Random(seed).randint(0, 50) for _ in range(n)], parts)
         for seed, (n, parts) in enumerate([(n, p) for n in (1, 3, 7, 12, 20) for p in (1, 2, 3, 4, 8)])]


def test_uniform_gives_the_remainder_to_the_first_stages():
    assert partition_uniform(10, 4) == [0, 3, 6, 8, 10]
    assert partition_uniform(2, 4) == [0, 1, 2, 2, 2]


def test_balanced_returns_python_ints_and_contiguous_parts():
    parts = partition_balanced([5, 1, 1, 1, 5, 1], 3)
    assert all(type(p) is int for p in parts)
    assert parts[0] == 0 and parts[-1] == 6 and parts == sorted(parts)


def test_methods_and_errors():
    specs = [LayerSpec(torch.nn.Linear, 4, 4), LayerSpec(torch.nn.ReLU), LayerSpec(torch.nn.Linear, 4, 40),
             LayerSpec(torch.nn.ReLU), LayerSpec(torch.nn.Linear, 40, 4)]
    assert partition_weights("uniform", specs, 2) == [0, 3, 5]
    assert partition_weights("parameters", specs, 2) == partition_balanced([20, 0, 200, 0, 164], 2)
    assert partition_weights("type:linear", specs, 3) == partition_balanced([1, 0, 1, 0, 1], 3)
    with pytest.raises(ValueError, match="matched no layer"):
        partition_weights("type:conv", specs, 2)
    with pytest.raises(NotImplementedError, match="profile"):
        partition_weights("profile", specs, 2)


_DEEPSPEED = """
import json, sys
from deepspeed.runtime.utils import partition_balanced, partition_uniform
cases = json.loads(sys.argv[1])
print(json.dumps([[list(map(int, partition_balanced(w, p))), list(map(int, partition_uniform(len(w), p)))]
                  for w, p in cases]))
"""


def test_boundaries_equal_deepspeed():
    require_deepspeed()
    done = subprocess.run([sys.executable, "-c", _DEEPSPEED, json.dumps(CASES)], capture_output=True, text=True,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"}, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    for (weights, parts), (balanced, uniform) in zip(CASES, json.loads(done.stdout.strip().splitlines()[-1])):
        assert partition_balanced(weights, parts) == balanced, (weights, parts)
        assert partition_uniform(len(weights), parts) == uniform, (weights, parts)
