"""transformers `Trainer` with accelerate's `parallelism_config` (`sp_backend="deepspeed"`, sp 2):
Ulysses sequence parallelism (ALST) through the `deepspeed` alias (scripts/trainer_sp.py).

Accelerate calls `register_with_transformers` and `UlyssesSPDataLoaderAdapter`, the Trainer its own
loss aggregation over sequence shards. On 2 gloo ranks (sp 2, dp 1) the losses, gradient norms
(clipping binds) and learning rates equal the same model trained without sequence parallelism on one
rank, to fp32 rounding. Real DeepSpeed 0.19.8 runs the same script: equal losses, and its gradient
norm is exactly sp times ours (its ZeRO-1 gradients are sp times the sample's, docs/compatibility.md;
after clipping, Adam's update is the same).
"""

import os

import pytest

from client_runs import SCRIPTS, read_json, run
from test_trainer import torchrun, zerospeed_launcher

pytestmark = pytest.mark.timeout(1200)
TRAINER_SP = os.path.join(SCRIPTS, "trainer_sp.py")
SP = 2


@pytest.fixture(scope="module")
def runs(alias_dir, tmp_path_factory):
    from concurrent.futures import ThreadPoolExecutor

    root = str(tmp_path_factory.mktemp("trainer_sp"))
    out = {side: os.path.join(root, side) for side in ("zs_sp", "zs_plain", "ds_sp")}
    plain = zerospeed_launcher(alias_dir, [TRAINER_SP, out["zs_plain"], "1"])
    plain[plain.index("--num_gpus") + 1] = "1"
    jobs = [(zerospeed_launcher(alias_dir, [TRAINER_SP, out["zs_sp"], str(SP)]), alias_dir), (plain, alias_dir),
            (torchrun([TRAINER_SP, out["ds_sp"], str(SP)]), None)]
    with ThreadPoolExecutor(2) as pool:
        for future in [pool.submit(run, cmd, alias, root) for cmd, alias in jobs]:
            future.result()
    return {side: read_json(os.path.join(path, "result.json")) for side, path in out.items()}


def test_trainer_sequence_parallel_equals_full_sequences(runs):
    ours, plain = runs["zs_sp"]["history"], runs["zs_plain"]["history"]
    assert runs["zs_sp"]["engine"] == "zerospeed.runtime.engine.DeepSpeedEngine"
    assert [e["step"] for e in ours] == [e["step"] for e in plain] == [1, 2, 3, 4]
    for a, b in zip(plain, ours):
        for key in ("loss", "grad_norm", "learning_rate"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), f"step {a['step']} {key}"
    assert min(e["grad_norm"] for e in ours) > 0.5, "clipping must bind"


def test_trainer_sequence_parallel_against_deepspeed(runs):
    theirs, ours = runs["ds_sp"]["history"], runs["zs_sp"]["history"]
    assert runs["ds_sp"]["engine"] == "deepspeed.runtime.engine.DeepSpeedEngine"
    assert len(theirs) == len(ours)
    for a, b in zip(theirs, ours):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), f"step {a['step']}"
        assert a["grad_norm"] == pytest.approx(SP * b["grad_norm"], rel=1e-5), f"step {a['step']}"
