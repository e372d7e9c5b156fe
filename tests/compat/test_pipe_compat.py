"""Pipeline parallelism side by side with DeepSpeed 0.19.8: the same 1F1B training, the same
checkpoint files, and each library resuming from the other's pipeline checkpoint."""

import functools
import os

import pytest
import torch

from compat_harness import run_both, run_script
from zerospeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "pipe.py")
STEPS, RESUME = 2, 2


def _close(a, b, rtol=1e-6):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x == pytest.approx(y, rel=rtol, abs=1e-7)


@pytest.mark.parametrize("stage", [0, 1])
def test_pipeline_training_and_checkpoints_cross_with_deepspeed(tmp_path, stage):
    saved = run_both(SCRIPT, str(tmp_path / "save"), stage=stage, steps=STEPS, resume_steps=RESUME)
    for theirs, ours in zip(saved["deepspeed"], saved["zerospeed"]):
        _close(theirs["losses"], ours["losses"])
        assert theirs["params"].keys() == ours["params"].keys()
        for name in theirs["params"]:
            _close(theirs["params"][name], ours["params"][name])
        assert theirs["seed_error"] == "TypeError" and ours["seed_error"] is None  # DeepSpeed's defect, fixed
        ours_files = {f for f in ours["files"] if f.endswith(".pt") or f == "latest"}
        assert ours_files == {f for f in theirs["files"] if f.endswith(".pt") or f == "latest"}
    for writer, ranks in saved.items():   # zerospeed's zero_to_fp32 merges either library's pipeline checkpoint
        merged = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "save" / writer / "ckpt"))
        expected_params = {name: values for rank in ranks for name, values in rank["saved"].items()}
        assert list(merged) == sorted(expected_params, key=lambda name: int(name.split(".")[0]))
        for name, values in expected_params.items():
            assert merged[name].dtype == torch.float32 and merged[name].flatten().tolist() == values, (writer, name)
    expected = saved["deepspeed"]  # each continued from its own save: steps STEPS.. in "losses"[STEPS:]
    for reader, writer in (("zerospeed", "deepspeed"), ("deepspeed", "zerospeed")):
        run = functools.partial(run_script, SCRIPT, reader, str(tmp_path / f"{reader}-reads"), stage=stage, steps=0,
                                load_from=str(tmp_path / "save" / writer / "ckpt"), resume_steps=RESUME)
        crossed = run()
        for rank, result in enumerate(crossed):
            assert result["global_steps"] == STEPS + RESUME
            _close(result["losses"], expected[rank]["losses"][STEPS:])
            for name, values in expected[rank]["params"].items():
                _close(result["params"][name], values)
