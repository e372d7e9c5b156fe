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
    # keys of published configs DeepSpeed ignores, near-misses of real keys: never typos (warned)
    "comms_config": (("loads", None), ("loads", None)),            # LLaMA-Factory's fp8 ZeRO-3 example
    "comment_key": (("loads", None), ("loads", None)),             # "_comment", close to "comet"
    "data_parallel_size": (("loads", None), ("loads", None)),      # a DeepSpeed key (initialize's mesh)
    # sections DeepSpeed implements and zerospeed does not: refused when live, warned when inert
    "torch_autocast_on": (("loads", None), "ConfigError"),
    "torch_autocast_off": (("loads", None), ("loads", None)),
    "deepcompile_on": (("loads", None), "ConfigError"),
    "deepcompile_off": (("loads", None), ("loads", None)),
    "data_efficiency_on": (("loads", None), "ConfigError"),
    "data_efficiency_off": (("loads", None), ("loads", None)),
    "autoep_on": (("loads", None), "ConfigError"),
    "zenflow": (("loads", None), "ConfigError"),
    "hybrid_engine": (("loads", None), ("loads", None)),
    "autotuning": (("loads", None), ("loads", None)),
}
# Sections and zero_optimization keys DeepSpeed removed: both refuse them whenever present, naming them.
REMOVED = {**{f"removed_{key}": key for key in (
    "compression_training", "progressive_layer_drop", "sparse_attention", "elasticity", "amp", "nebula",
    "quantize_training", "sparse_gradients", "eigenvalue", "graph_harvesting", "curriculum_learning")},
    **{f"removed_zero_{key}": key for key in ("mics_shard_size", "mics_hierarchical_params_gather",
                                               "zeropp_loco_param")},
    **{f"initialize_{key}": key for key in (
        "compression_training", "progressive_layer_drop", "sparse_attention", "elasticity")}}
EXPECTED.update({case: ("DeepSpeedConfigError", "ConfigError") for case in REMOVED})


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


@pytest.mark.parametrize("case", list(REMOVED))
def test_removed_sections_are_refused_by_both_naming_the_section(outcomes, case):
    """DeepSpeed 0.19.8 refuses these at `DeepSpeedConfig` (so at `initialize`, the initialize_* cases)
    even when disabled; zerospeed refuses the same keys there, its message naming the key path and
    what to do."""
    theirs, ours = outcomes
    key = REMOVED[case]
    assert key in theirs[case]["message"].lower(), theirs[case]  # DeepSpeed writes "AMP", "Nebula"
    path = f"zero_optimization.{key}" if case.startswith("removed_zero_") else key
    assert f"{path}: removed from DeepSpeed" in ours[case]["message"], ours[case]
    assert "Remove" in ours[case]["message"]


@pytest.mark.parametrize("case", ["torch_autocast_on", "deepcompile_on", "data_efficiency_on", "autoep_on",
                                  "zenflow"])
def test_live_unimplemented_sections_are_refused_by_name(outcomes, case):
    """DeepSpeed runs these; zerospeed does not implement them and ignoring them would change the
    numbers, so it refuses, naming the section (a deliberate difference, docs/compatibility.md)."""
    _, ours = outcomes
    section = {"torch_autocast_on": "torch_autocast", "deepcompile_on": "compile",
               "data_efficiency_on": "data_efficiency", "autoep_on": "expert_parallel",
               "zenflow": "zero_optimization.zenflow"}[case]
    assert f"{section}: " in ours[case]["message"] and "not implemented by zerospeed" in ours[case]["message"]


KEYS_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "config_top_level_keys.py")
# Read by deepspeed.initialize itself (the (data, sequence) mesh), not by DeepSpeedConfig.
INITIALIZE_KEYS = ("sequence_parallel_size", "data_parallel_size")


def test_every_deepspeed_top_level_key_has_a_status_and_a_table_row(tmp_path):
    """The keys DeepSpeed 0.19.8's DeepSpeedConfig looks up (recorded while it builds a config) are
    each a zerospeed field, or a section zerospeed refuses or warns about by rule; and each has its
    row in docs/config.md's "Top-level sections" table."""
    from compat_harness import REPO_ROOT, run_script

    from zerospeed.runtime.config_root import DeepSpeedRootConfig
    from zerospeed.runtime.config_unimplemented import NOT_IMPLEMENTED, REMOVED_UPSTREAM
    from zerospeed.runtime.config_utils import valid_keys

    keys = run_script(KEYS_SCRIPT, "deepspeed", str(tmp_path), world_size=1)[0]["keys"]
    assert len(keys) > 50 and "zero_optimization" in keys and "progressive_layer_drop" in keys
    known = set(valid_keys(DeepSpeedRootConfig)) | set(REMOVED_UPSTREAM) | set(NOT_IMPLEMENTED)
    assert [key for key in [*keys, *INITIALIZE_KEYS] if key not in known] == []
    page = open(os.path.join(REPO_ROOT, "docs", "config.md")).read()
    table = page[page.index("## Top-level sections"):page.index("## A corpus of real configs")]
    assert [key for key in [*keys, *INITIALIZE_KEYS] if f"`{key}`" not in table] == []
