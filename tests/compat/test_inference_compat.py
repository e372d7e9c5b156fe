"""`init_inference` against the real DeepSpeed 0.19.8 on CPU: the same script, tp 2 on 2 ranks.

Both libraries cut the same tiny HF models with AutoTP; their logits agree to fp32 rounding and
their greedy tokens are identical, on every rank, and each equals the unsharded model. GPT-2 is
where they differ on purpose: DeepSpeed's AutoTP refuses it, zerospeed cuts it. With a DeepSpeed
checkpoint description both load the same safetensors file into the shards. (The harness sets
LOCAL_SIZE for both: DeepSpeed's CPU path needs it; tests/inference/test_inference_launch.py
runs zerospeed without it.)
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.compat
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "init_inference.py")
BOTH = ["llama", "mistral", "qwen2", "gpt_neox", "opt", "falcon", "phi"]


def _compare(runs: dict, kinds: list[str]) -> None:
    for rank, (theirs, ours) in enumerate(zip(runs["deepspeed"], runs["zerospeed"])):
        for kind in kinds:
            assert "error" not in theirs[kind] and "error" not in ours[kind], (rank, kind, theirs[kind], ours[kind])
            torch.testing.assert_close(torch.tensor(ours[kind]["logits"]), torch.tensor(theirs[kind]["logits"]),
                                       rtol=0, atol=1e-5, msg=lambda m, k=kind, r=rank: f"rank {r} {k}: {m}")
            assert ours[kind]["tokens"] == theirs[kind]["tokens"], (rank, kind)
            assert (ours[kind]["engine"], ours[kind]["module"]) == (theirs[kind]["engine"], theirs[kind]["module"])
        assert ours["llama"]["tokens"] == ours["reference"]["tokens"], "and both equal the unsharded model"


def test_init_inference_matches_deepspeed(tmp_path) -> None:
    from compat_harness import run_both

    runs = run_both(SCRIPT, str(tmp_path), kinds=[*BOTH, "gpt2"])
    _compare(runs, BOTH)
    for theirs, ours in zip(runs["deepspeed"], runs["zerospeed"]):
        assert "AutoTP not supported" in theirs["gpt2"]["error"] and "error" not in ours["gpt2"]


def test_checkpoint_description_matches_deepspeed(tmp_path) -> None:
    from compat_harness import run_both

    kinds = ["llama", "qwen2"]
    runs = run_both(SCRIPT, str(tmp_path), kinds=kinds, checkpoint=True)
    _compare(runs, kinds)
