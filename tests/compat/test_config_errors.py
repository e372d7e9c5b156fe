"""ds_config mistakes and client additions: DeepSpeed 0.19.8 and zerospeed side by side.

Each case of scripts/config_errors.py goes through `runtime.config.DeepSpeedConfig` on both; the
test asserts what DeepSpeed does and the deliberate difference (docs/compatibility.md,
"Configuration"): zerospeed raises one `ConfigError` naming the key where DeepSpeed raises a
`TypeError`/`AssertionError`, converts or keeps a string silently, or ignores a key silently.
"""

import os

import pytest

from compat_harness import run_both

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "config_errors.py")

# case -> (DeepSpeed's outcome, zerospeed's outcome); an outcome is an exception type name, or
# ("loads", value) for a config that loads (value: what the engine would use, or None).
EXPECTED = {
    "tbs_negative": ("AssertionError", "ConfigError"),
    "tbs_string": ("TypeError", "ConfigError"),
    "fp16_enabled_yes": (("loads", None), "ConfigError"),          # "yes" -> True in DeepSpeed
    "overlap_comm_string": (("loads", True), "ConfigError"),       # silently converted in DeepSpeed
    "clipping_string": (("loads", None), "ConfigError"),           # kept as a string in DeepSpeed
    "lr_string": (("loads", None), "ConfigError"),
    "optimizer_without_type": (("loads", None), "ConfigError"),    # DeepSpeed fails at the first backward
    "steps_per_print_inf": (("loads", "inf"), ("loads", "None")),  # both: never print
    "dotted_key": (("loads", 500_000_000), ("loads", 1000)),       # DeepSpeed ignores dotted keys
    "msamp": (("loads", None), ("loads", None)),
    "unknown_top": (("loads", None), ("loads", None)),             # zerospeed warns
    "typo_top": (("loads", None), "ConfigError"),                  # did-you-mean in zerospeed
    "unknown_nested": ("ValidationError", ("loads", None)),        # zerospeed warns and ignores
    "typo_nested": ("ValidationError", "ConfigError"),
    "triangle": ("AssertionError", "ConfigError"),
    "stage_string": (("loads", 2), "ConfigError"),                 # DeepSpeed runs stage 2
    "sub_group_size_zero": (("loads", 0), ("loads", 0)),           # valid: one param per sub-group
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    runs = run_both(SCRIPT, str(tmp_path_factory.mktemp("config_errors")), world_size=1)
    return runs["deepspeed"][0], runs["zerospeed"][0]


def _outcome(result):
    return result["error"] if result["error"] else ("loads", result["value"])


@pytest.mark.parametrize("case", list(EXPECTED))
def test_config_case_side_by_side(outcomes, case):
    theirs, ours = outcomes
    assert (_outcome(theirs[case]), _outcome(ours[case])) == tuple(
        tuple(o) if isinstance(o, tuple) else o for o in EXPECTED[case]), (theirs[case], ours[case])


def test_zerospeed_errors_name_the_key(outcomes):
    _, ours = outcomes
    for case, key in (("tbs_negative", "train_batch_size"), ("tbs_string", "train_batch_size"),
                      ("fp16_enabled_yes", "fp16.enabled"), ("lr_string", "optimizer.params.lr"),
                      ("optimizer_without_type", "optimizer.type"), ("typo_top", "train_batch_sizes"),
                      ("overlap_comm_string", "zero_optimization.overlap_comm"),
                      ("clipping_string", "gradient_clipping"), ("stage_string", "zero_optimization.stage")):
        assert f"{key}:" in ours[case]["message"], (case, ours[case])
