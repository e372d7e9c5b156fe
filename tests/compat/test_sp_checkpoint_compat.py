"""Sequence-parallel checkpoints against the real DeepSpeed 0.19.8 (sp 2 on 2 CPU ranks, ZeRO 1 and 3).

Both libraries write the same files (the ZeRO partitions over all sp x dp ranks, so one optim file
per rank), `zero_to_fp32` merges them into the same full weights, and each library loads the
other's checkpoint to exactly the fp32 weights it saved; at ZeRO 3, where both libraries' gradients
are the sample's, it continues the same trajectory (Adam: the moments must have come back). The trajectories agree although DeepSpeed's ZeRO-1 gradients are sp times ours under
sequence parallelism (its moments show the factor; docs/compatibility.md): Adam's update does not
change under a constant gradient scale, up to eps.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.compat
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "sp_checkpoint.py")
STAGES = (1, 3)
STEPS_AFTER_SAVE = 2


def _close(a, b, rtol=1e-5, atol=1e-7, msg=""):
    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=rtol, atol=atol, msg=lambda m: f"{msg}: {m}")


def test_sp_checkpoints_match_and_cross_load_with_deepspeed(tmp_path) -> None:
    from compat_harness import require_deepspeed, run_both

    require_deepspeed()
    runs = run_both(SCRIPT, str(tmp_path), stages=STAGES)
    for stage in map(str, STAGES):
        theirs, ours = runs["deepspeed"][0][stage], runs["zerospeed"][0][stage]
        assert ours["files"] == theirs["files"], stage
        _close(ours["losses"], theirs["losses"], msg=f"stage {stage} losses")
        assert ours["full"].keys() == theirs["full"].keys()
        for name, value in theirs["full"].items():
            _close(ours["full"][name], value, msg=f"stage {stage} zero_to_fp32 {name}")
            _close(ours["state"][name][2], ours["full"][name], rtol=0, atol=0, msg=f"stage {stage} {name}")
        scale = 2.0 if stage == "1" else 1.0   # DeepSpeed's ZeRO-1 SP gradient: sp times the sample's
        for name, (avg, avg_sq, _) in theirs["state"].items():
            _close(avg, [scale * x for x in ours["state"][name][0]], rtol=1e-4, atol=1e-9, msg=f"{stage} {name}")
            _close(avg_sq, [scale ** 2 * x for x in ours["state"][name][1]], rtol=1e-4, atol=1e-12,
                   msg=f"{stage} {name}")
    crossed = {"deepspeed": str(tmp_path / "zerospeed" / "ckpt"), "zerospeed": str(tmp_path / "deepspeed" / "ckpt")}
    loaded = run_both(SCRIPT, str(tmp_path / "cross"), stages=STAGES, load_from=crossed)
    for impl, other in (("deepspeed", "zerospeed"), ("zerospeed", "deepspeed")):
        for stage in map(str, STAGES):
            for rank, result in enumerate(loaded[impl]):
                got, saved = result[stage], runs[other][rank][stage]
                assert got["global_steps"] == 2
                # Exactly the weights the other library saved, and the same continuation: Adam with
                # lost or misplaced moments would move the weights by about lr.
                assert got["weights"] == {name: s[2] for name, s in saved["state"].items()}, f"{impl} {other} {stage}"
                # At ZeRO 1 the loaded moments are in the other library's gradient scale and the new
                # gradients in this one's: only the first loss (the loaded weights') must agree.
                continued = STEPS_AFTER_SAVE if stage == "3" else 1
                _close(got["losses"][:continued], saved["losses"][2:2 + continued],
                       msg=f"{impl} continuing {other}'s stage {stage}")
                if stage == "3":
                    for name, value in saved["end"].items():
                        _close(got["end"][name], value, msg=f"{impl} continuing {other}'s stage {stage}: {name}")
