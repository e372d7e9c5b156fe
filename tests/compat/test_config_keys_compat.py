"""ds_config keys the runtime reads, each set both ways, side by side with DeepSpeed 0.19.8
(scripts/config_keys.py): `fp16.auto_cast`, `zero_optimization.load_from_fp32_weights`,
`allgather_partitions`, `allgather_bucket_size`, `stage3_allgather_sequential`.

Each key is shown to matter where it should (the two settings differ) and to give DeepSpeed's
result under each setting; the one deliberate difference (auto_cast with fp16 off) is asserted
and listed in docs/compatibility.md ("Engine methods").
"""

import os

import pytest

from compat_harness import run_both

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "config_keys.py")
RANKS = range(2)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    runs = run_both(SCRIPT, str(tmp_path_factory.mktemp("config_keys")))
    for impl, per_rank in runs.items():
        for rank in RANKS:
            for check, value in per_rank[rank].items():
                assert "raised" not in value, (impl, rank, check, value)
    return runs["deepspeed"], runs["zerospeed"]


def test_fp16_auto_cast_casts_positional_floating_inputs_as_deepspeed(results):
    """With fp16 on, auto_cast=true hands forward fp16 copies of the floating positional inputs and
    leaves integer inputs and keyword arguments alone; false hands them over as given. Same dtypes,
    losses and output dtype as DeepSpeed under each setting (and with fp16 off and auto_cast off)."""
    deepspeed, zerospeed = results
    for rank in RANKS:
        ours, theirs = zerospeed[rank]["fp16_auto_cast"], deepspeed[rank]["fp16_auto_cast"]
        for case in ("enabled_True_auto_cast_True", "enabled_True_auto_cast_False", "enabled_False_auto_cast_False"):
            assert ours[case] == theirs[case], (rank, case)
        cast, uncast = ours["enabled_True_auto_cast_True"], ours["enabled_True_auto_cast_False"]
        assert cast["seen"] == {"x": "torch.float16", "index": "torch.int64", "y": "torch.float16",
                                "kwarg_scale": "torch.float32"}
        assert uncast["seen"] == {"x": "torch.float32", "index": "torch.int64", "y": "torch.float32",
                                  "kwarg_scale": "torch.float32"}
        assert cast["weight_dtype"] == cast["loss_dtype"] == "torch.float16"


def test_fp16_auto_cast_without_fp16_is_ignored(results):
    """Deliberate difference: with fp16 off, DeepSpeed 0.19.8 still casts the inputs to fp16 (a
    real fp32 model then fails with a dtype mismatch; this probe casts back, so its losses show the
    rounding); zerospeed applies auto_cast only when fp16 is enabled."""
    deepspeed, zerospeed = results
    for rank in RANKS:
        ours, theirs = zerospeed[rank]["fp16_auto_cast"], deepspeed[rank]["fp16_auto_cast"]
        assert theirs["enabled_False_auto_cast_True"]["seen"]["x"] == "torch.float16"
        assert theirs["enabled_False_auto_cast_True"]["losses"] != theirs["enabled_False_auto_cast_False"]["losses"]
        assert ours["enabled_False_auto_cast_True"] == ours["enabled_False_auto_cast_False"]


@pytest.mark.parametrize("stage", [1, 2])
def test_load_from_fp32_weights_chooses_the_masters_as_deepspeed(results, stage):
    """bf16 after three steps: the fp32 masters are not bf16 numbers. true restores them from the
    checkpoint's fp32 partitions, false rebuilds them from the bf16 weights, so the masters and the
    step after the load differ between the settings; each setting equals DeepSpeed bit for bit."""
    deepspeed, zerospeed = results
    for rank in RANKS:
        ours, theirs = zerospeed[rank]["fp32_weights_on_load"], deepspeed[rank]["fp32_weights_on_load"]
        from_fp32, from_bf16 = ours[f"stage{stage}_from_fp32_True"], ours[f"stage{stage}_from_fp32_False"]
        assert from_fp32["masters_equal_saved_masters"] and not from_fp32["masters_equal_bf16_weights"]
        assert from_bf16["masters_equal_bf16_weights"] and not from_bf16["masters_equal_saved_masters"]
        assert from_fp32["masters"] != from_bf16["masters"]
        assert from_fp32["then_params"] != from_bf16["then_params"]
        for setting in (True, False):
            key = f"stage{stage}_from_fp32_{setting}"
            assert ours[key] == theirs[key], (rank, key)


def test_allgather_keys_change_how_not_what(results):
    """allgather_partitions=false, allgather_bucket_size=8 (many small gathers) and
    stage3_allgather_sequential=true choose how updated parameters are gathered: the losses and
    weights equal the defaults' and DeepSpeed's under each setting."""
    deepspeed, zerospeed = results
    for rank in RANKS:
        ours, theirs = zerospeed[rank]["allgather_knobs"], deepspeed[rank]["allgather_knobs"]
        assert ours == theirs, rank
        assert len({str(value) for value in ours.values()}) == 1, ours
