"""The key rules clients rely on (issue 15) and errors that name the key (issues 14, 17):
dotted keys, unknown keys, "auto", infinite steps_per_print, strings for numbers, parse errors."""

from __future__ import annotations

import warnings

import pytest

from zerospeed.runtime.config import DeepSpeedConfig
from zerospeed.runtime.config_utils import ConfigError, ConfigWarning


def _config(extra: dict, **kwargs) -> DeepSpeedConfig:
    return DeepSpeedConfig({"train_batch_size": 8, **extra}, **kwargs)


def _config_warnings(extra: dict) -> tuple[DeepSpeedConfig, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = _config(extra)
    return config, [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]


# --- keys clients send --------------------------------------------------------------------------


def test_infinite_steps_per_print_means_never():  # accelerate sets float("inf")
    assert _config({"steps_per_print": float("inf")}).steps_per_print is None


def test_dotted_top_level_keys_apply_as_the_nested_key_with_one_warning():  # TRL's prepare_deepspeed
    hidden = 48
    config, messages = _config_warnings({
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"},
        "zero_optimization.reduce_bucket_size": hidden * hidden,
        "zero_optimization.stage3_param_persistence_threshold": 10 * hidden,
        "zero_optimization.stage3_prefetch_bucket_size": 0.9 * hidden * hidden})
    zero = config.zero_config
    assert (zero.reduce_bucket_size, zero.param_persistence_threshold, zero.prefetch_bucket_size) \
        == (2304, 480, int(0.9 * hidden * hidden))
    assert len(messages) == 3 and all("applied as zero_optimization." in m for m in messages)


def test_an_explicit_nested_value_wins_over_a_dotted_key():
    config, messages = _config_warnings({"zero_optimization": {"stage": 3, "reduce_bucket_size": 1000},
                                         "zero_optimization.reduce_bucket_size": 2000})
    assert config.zero_config.reduce_bucket_size == 1000
    assert len(messages) == 1 and "ignored" in messages[0]


@pytest.mark.parametrize("extra", [
    {"msamp": {"enabled": False, "opt_level": "O1"}},               # accelerate
    {"my_client_flag": True},                                       # anything new at the top
    {"zero_optimization": {"stage": 1, "brand_new_knob": 3}},       # or in a section
    {"zero_optimization.my_client_flag": 1},                        # dotted, naming no real key
])
def test_unknown_keys_that_are_not_near_misses_warn_and_are_ignored(extra):
    config, messages = _config_warnings(extra)
    assert config.train_batch_size == 8
    assert len(messages) == 1
    assert "ignored" in messages[0]


@pytest.mark.parametrize(("extra", "path", "suggestion"), [
    ({"train_batch_sizes": 8}, "train_batch_sizes", "train_batch_size"),
    ({"zero_optimization": {"stage3_prefech_bucket_size": 1}}, "zero_optimization.stage3_prefech_bucket_size",
     "stage3_prefetch_bucket_size"),
    ({"fp16": {"enable": True}}, "fp16.enable", "enabled"),
])
def test_a_near_miss_typo_still_fails_with_did_you_mean(extra, path, suggestion):
    with pytest.raises(ConfigError) as info:
        _config(extra)
    assert f"{path}:" in str(info.value) and f"did you mean '{suggestion}'" in str(info.value)


def test_keys_accelerate_adds_are_accepted():
    config = _config({"fp16": {"enabled": True, "auto_cast": True}, "communication_data_type": "fp32"})
    assert config.fp16_auto_cast is True and str(config.communication_data_type) == "torch.float32"


def test_auto_is_accepted_everywhere_a_client_leaves_it():
    config = _config({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                      "gradient_clipping": "auto", "steps_per_print": "auto",
                      "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
                      "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                               "weight_decay": "auto"}},
                      "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                                 "warmup_num_steps": "auto"}},
                      "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                            "stage3_prefetch_bucket_size": "auto",
                                            "stage3_param_persistence_threshold": "auto"}})
    assert config.optimizer_params == {} and config.scheduler_params == {}
    assert config.zero_config.param_persistence_threshold == 100_000 and config.gradient_clipping == 1.0


# --- errors that name the key -------------------------------------------------------------------


@pytest.mark.parametrize(("extra", "expected"), [
    ({"train_batch_size": -2}, "train_batch_size: -2 has to be greater than 0"),
    ({"train_batch_size": "2"}, "train_batch_size: expected a number, got the string '2'"),
    ({"gradient_accumulation_steps": "4"}, "gradient_accumulation_steps: expected a number"),
    ({"fp16": {"enabled": "yes"}}, "fp16.enabled: expected a boolean (true/false), got the string 'yes'"),
    ({"zero_optimization": {"stage": 2, "overlap_comm": "true"}}, "zero_optimization.overlap_comm: expected a boolean"),
    ({"zero_optimization": {"reduce_bucket_size": "5e8"}}, "zero_optimization.reduce_bucket_size: expected a number"),
    # an IntEnum field: DeepSpeed 0.19.8 (pydantic's lax mode) silently runs stage 2
    ({"zero_optimization": {"stage": "2"}}, "zero_optimization.stage: expected a number, got the string '2'"),
    ({"zero_optimization": {"stage": 3, "sub_group_size": -1}}, "zero_optimization.sub_group_size"),
    ({"gradient_clipping": "1.0"}, "gradient_clipping: expected a number"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "1e-3"}}}, "optimizer.params.lr: expected a number"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "fast"}}}, "optimizer.params.lr"),
    ({"optimizer": {"type": "AdamW", "params": {"amsgrad": "yes"}}}, "optimizer.params.amsgrad"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "10"}}},
     "scheduler.params.warmup_num_steps"),
    ({"optimizer": {"params": {"lr": 1e-3}}}, "optimizer.type: missing"),
])
def test_config_errors_name_the_key_path(extra, expected):
    with pytest.raises(ConfigError) as info:
        _config(extra)
    assert expected in str(info.value)


def test_a_batch_triangle_that_cannot_close_names_the_values_and_the_world_size():
    with pytest.raises(ConfigError) as info:
        DeepSpeedConfig({"train_batch_size": 3, "train_micro_batch_size_per_gpu": 2}, world_size=2)
    message = str(info.value)
    assert "train_batch_size 3, train_micro_batch_size_per_gpu 2, gradient_accumulation_steps not set" in message
    assert "world_size 2 (from the world_size argument)" in message and "has to be greater than 0" not in message


# --- files --------------------------------------------------------------------------------------


def test_a_file_that_does_not_parse_is_one_line_naming_file_and_line(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text('{\n  "train_batch_size": 8,\n  "zero_optimization": {"stage": ]},\n  "fp16": {}\n}\n')
    with pytest.raises(ConfigError) as info:
        DeepSpeedConfig(str(path))
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}:3:") and "does not parse" in message


def test_lenient_hjson_still_reads(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text('{\n  // comment\n  train_batch_size: 8,\n  "zero_optimization": {"stage": 2,},\n}\n')
    assert DeepSpeedConfig(str(path)).zero_optimization_stage == 2


def test_zero_stage_given_as_a_number_still_reads():
    assert DeepSpeedConfig({"train_batch_size": 8, "zero_optimization": {"stage": 2}}).zero_optimization_stage == 2


def test_sub_group_size_zero_is_one_parameter_per_sub_group_as_in_deepspeed():
    """Not a bad config: DeepSpeed 0.19.8 allows 0 (`ge=0`) and its stage 3 then closes a sub-group
    after every parameter (`local_sub_group_size >= 0`); zerospeed cuts the same way."""
    from zerospeed.runtime.zero.sub_groups import plan_sub_groups

    config = _config({"zero_optimization": {"stage": 3, "sub_group_size": 0}})
    assert config.zero_config.sub_group_size == 0
    assert plan_sub_groups([5, 0, 7], 0) == [[0], [1], [2]]
    assert plan_sub_groups([5, 0, 7], 6) == [[0, 1, 2]]


@pytest.mark.parametrize("extra", [
    {"comms_config": {"verbose": False}},                                   # LLaMA-Factory fp8 / ALST examples
    {"monitor_config": {"enabled": True, "tag": "DeepSpeedMonitor"}},        # the same files
    {"_comment": "zero2 with AutoTP"},                                      # a JSON comment (near 'comet')
])
def test_keys_real_configs_carry_are_not_taken_for_typos(extra):
    """Near-misses of real keys (comms_logger, comet) that are themselves keys of published configs
    DeepSpeed ignores: one warning naming the key, never a did-you-mean error."""
    config, messages = _config_warnings(extra)
    assert config.train_batch_size == 8
    assert len(messages) == 1 and f"'{next(iter(extra))}'" in messages[0] and "ignored" in messages[0]


def test_data_parallel_size_is_a_deepspeed_key():
    """`initialize` reads it beside sequence_parallel_size (the (data, sequence) mesh): no warning."""
    config, messages = _config_warnings({"data_parallel_size": 1})
    assert messages == [] and config.model.data_parallel_size == 1


def test_a_typo_of_a_known_elsewhere_key_still_fails():
    with pytest.raises(ConfigError, match="did you mean 'comms_logger'"):
        _config({"comms_loger": {"enabled": True}})
