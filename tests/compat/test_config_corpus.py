"""Every real ds_config of tests/config_corpus (SOURCES.md) on DeepSpeed 0.19.8 and on zerospeed.

Each config is first filled as the HF Trainer fills it (``HfTrainerDeepSpeedConfig`` with fixed
training arguments: micro batch 2, accumulation 4, bf16, lr 3e-4, ...; a value the config sets
itself is kept, and the arguments follow the config's own batch sizes, as a user's must), then
built by `runtime.config.DeepSpeedConfig` in one process per library (world size 1). Both must
accept it or both refuse it, and where both accept, derive the same batch triangle, ZeRO stage,
precision, offload devices, clipping, optimizer and scheduler (scripts/config_corpus.py).

Two lists hold the only configs where the libraries part, each for a stated reason
(docs/compatibility.md, "Configuration"):

* `ZEROSPEED_REFUSES`: DeepSpeed runs the config, zerospeed refuses it naming a section it does not
  implement whose neglect would change the numbers (docs/config.md, "Top-level sections");
* `ZEROSPEED_WARNS`: DeepSpeed 0.19.8 refuses an unknown key inside a section; zerospeed drops it
  with a warning naming it (a key an older DeepSpeed or a fork defined, whose absence is harmless).
"""

from __future__ import annotations

import copy
import json
import os
from types import SimpleNamespace
from typing import Any

import pytest

from compat_harness import run_both

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(os.path.dirname(HERE), "config_corpus")
SCRIPT = os.path.join(HERE, "scripts", "config_corpus.py")
MANIFEST = json.load(open(os.path.join(CORPUS, "manifest.json")))
NAMES = [entry["file"] for entry in MANIFEST]

# corpus file -> the key path zerospeed's refusal names (DeepSpeed accepts the config).
ZEROSPEED_REFUSES: dict[str, str] = {
    "dse--benchmarks--autosp--configs--autosp_config.json": "compile",              # deepcompile: true
    "dse--training--DeepSpeed-ZenFlow--finetuning--zf_config.json": "zero_optimization.zenflow",
    "dse--training--bf16_master_weight--configs--bf16_full.json": "torch_autocast",  # enabled: true
    "dse--training--data_efficiency--gpt_finetuning--config--ds_config_gpt_base_random_ltd.json": "data_efficiency",
}
# corpus file -> the key zerospeed warns about and ignores (DeepSpeed refuses the config).
ZEROSPEED_WARNS: dict[str, str] = {
    # DeepSpeed 0.19.8's CompileConfig dropped the `disable` and `backend` keys older releases read;
    # zerospeed drops each unknown key of the section with a warning.
    "axolotl--zero1_torch_compile.json": "compile.disable",
    "axolotl--zero2_torch_compile.json": "compile.disable",
    # a key of the Megatron-DeepSpeed fork's ZeRO config (lenient checkpoint loading).
    "megatron-deepspeed--universal_checkpointing--ds_config.json": "zero_optimization.ignore_missing_optim_state",
}


def _args(config: dict[str, Any]) -> SimpleNamespace:
    """TrainingArguments as a user of this config sets them: its own batch sizes where concrete."""
    micro = config.get("train_micro_batch_size_per_gpu")
    micro = micro if isinstance(micro, int) else 2
    accumulation = config.get("gradient_accumulation_steps")
    total = config.get("train_batch_size")
    if not isinstance(accumulation, int):
        accumulation = total // micro if isinstance(total, int) and total % micro == 0 else 4
    return SimpleNamespace(world_size=1, per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation,
                           max_grad_norm=0.5, learning_rate=3e-4, adam_beta1=0.9, adam_beta2=0.95,
                           adam_epsilon=1e-7, weight_decay=0.01, save_on_each_node=False, fp16=False,
                           fp16_full_eval=False, bf16=True, bf16_full_eval=False,
                           get_warmup_steps=lambda num_training_steps: 10)


def fill_auto(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with "auto" filled by transformers' own HfTrainerDeepSpeedConfig (no mismatch check:
    a concrete value is the config author's, kept as HF keeps it)."""
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    class Filler(HfTrainerDeepSpeedConfig):
        def fill_match(self, ds_key_long, hf_val, hf_key=None, must_match=True):
            super().fill_match(ds_key_long, hf_val, hf_key, must_match=False)

    filler = Filler(copy.deepcopy(config))
    args = _args(config)
    filler.trainer_config_process(args)
    model = SimpleNamespace(config=SimpleNamespace(hidden_size=64))
    filler.trainer_config_finalize(args, model, num_training_steps=100)
    return filler.config


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    configs = {name: fill_auto(json.load(open(os.path.join(CORPUS, name)))) for name in NAMES}
    runs = run_both(SCRIPT, str(tmp_path_factory.mktemp("config_corpus")), world_size=1, configs=configs)
    return runs["deepspeed"][0], runs["zerospeed"][0]


def test_corpus_is_large_and_attributed():
    assert len(NAMES) >= 40
    files = {name for name in os.listdir(CORPUS) if name.endswith(".json") and name != "manifest.json"}
    assert files == set(NAMES)
    sources = open(os.path.join(CORPUS, "SOURCES.md")).read()
    for entry in MANIFEST:
        assert len(entry["commit"]) == 40 and entry["repo"] in sources and entry["path"] in sources, entry


@pytest.mark.parametrize("name", NAMES)
def test_corpus_config_side_by_side(outcomes, name):
    theirs, ours = outcomes[0][name], outcomes[1][name]
    if name in ZEROSPEED_REFUSES:
        assert theirs["error"] is None, theirs
        assert ours["error"] == "ConfigError", ours
        assert f"{ZEROSPEED_REFUSES[name]}: " in ours["message"] and "not implemented" in ours["message"], ours
        return
    if name in ZEROSPEED_WARNS:
        assert theirs["error"] in ("ValidationError", "DeepSpeedConfigError"), theirs
        assert ours["error"] is None and any(ZEROSPEED_WARNS[name] in w for w in ours["warnings"]), ours
        return
    assert (theirs["error"] is None) == (ours["error"] is None), (theirs, ours)
    if theirs["error"] is None:
        assert ours["derived"] == theirs["derived"]


def test_both_refuse_the_sections_deepspeed_removed(outcomes):
    """The corpus holds configs for removed features (compression, progressive layer drop): both
    libraries refuse them, each naming the section."""
    theirs, ours = outcomes
    for name, section in (("dse--compression--bert--config--ds_config_W1A8_Qgroup64_fp16.json", "compression_training"),
                          ("dse--training--bing_bert--deepspeed_bsz4k_progressive_layer_drop_config_seq128.json",
                           "progressive_layer_drop")):
        assert theirs[name]["error"] == "DeepSpeedConfigError" and section in theirs[name]["message"]
        assert ours[name]["error"] == "ConfigError" and f"{section}: removed from DeepSpeed" in ours[name]["message"]


def test_most_of_the_corpus_runs_on_both(outcomes):
    """The exceptions stay exceptions: at least 40 configs load on both with equal derived values."""
    theirs, ours = outcomes
    both = [name for name in NAMES if theirs[name]["error"] is None and ours[name]["error"] is None]
    assert len(both) >= 40
    assert all(theirs[name]["derived"] == ours[name]["derived"] for name in both)
