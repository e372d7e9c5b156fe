"""ds_config loading and validation: defaults, did-you-mean errors, "auto", aliases, deprecations."""

from __future__ import annotations

import base64
import json
import logging
import sys
import warnings

import pytest
import torch

from zerospeed.runtime.config import DeepSpeedConfig, DeepSpeedRootConfig, load_ds_config
from zerospeed.runtime.config_keys import validate_section
from zerospeed.runtime.config_utils import ConfigError, ConfigWarning, DeepSpeedConfigError
from zerospeed.runtime.zero.config import DeepSpeedZeroConfig, ZeroStageEnum
from zerospeed.runtime.zero.offload_config import OffloadDeviceEnum

BASE = {"train_batch_size": 8}


def _config(extra: dict, **kwargs) -> DeepSpeedConfig:
    return DeepSpeedConfig({**BASE, **extra}, **kwargs)


# ------------------------------------------------------------------------------------------
# defaults (DeepSpeed 0.19.8's, `deepspeed/runtime/config.py::DeepSpeedConfig`)


def test_top_level_defaults():
    config = _config({})
    assert config.gradient_clipping == 1.0
    assert config.steps_per_print is None
    assert (config.prescale_gradients, config.gradient_predivide_factor, config.gradient_allreduce_op) == (False, 1.0, "mean")
    assert config.communication_data_type is None
    assert (config.wall_clock_breakdown, config.memory_breakdown, config.dump_state) == (False, False, False)
    assert (config.zero_allow_untested_optimizer, config.zero_force_ds_cpu_optimizer) == (False, True)
    assert (config.dataloader_drop_last, config.log_level) == (False, None)
    assert (config.optimizer_name, config.optimizer_params, config.scheduler_name, config.scheduler_params) == (None,) * 4
    assert (config.fp16_enabled, config.bf16_enabled, config.zero_enabled, config.zero_optimization_stage) == (False, False, False, 0)
    assert config.dynamic_loss_scale_args is None and config.grad_accum_dtype is None


def test_zero_defaults_and_overlap_comm_follows_stage():
    zero = _config({}).zero_config
    assert zero.stage == ZeroStageEnum.disabled
    assert (zero.reduce_bucket_size, zero.allgather_bucket_size, zero.sub_group_size) == (500_000_000, 500_000_000, 10**9)
    assert (zero.prefetch_bucket_size, zero.param_persistence_threshold) == (50_000_000, 100_000)
    assert (zero.model_persistence_threshold, zero.max_live_parameters, zero.max_reuse_distance) == (sys.maxsize, 10**9, 10**9)
    assert zero.contiguous_gradients and zero.reduce_scatter and zero.overlap_comm is False
    assert zero.offload_param is None and zero.offload_optimizer is None
    assert _config({"zero_optimization": {"stage": 3}}).zero_config.overlap_comm is True
    assert _config({"zero_optimization": {"stage": 3, "overlap_comm": False}}).zero_config.overlap_comm is False
    assert _config({"zero_optimization": {"stage": 2, "overlap_comm": "auto"}}).zero_config.overlap_comm is False


def test_offload_defaults():
    zero = _config({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                          "offload_optimizer": {"device": "cpu"}}}).zero_config
    param, optim = zero.offload_param, zero.offload_optimizer
    assert param.device == OffloadDeviceEnum.cpu and param.pin_memory is True
    assert (param.buffer_count, param.buffer_size, param.max_in_cpu) == (5, 10**8, 10**9)
    assert (optim.buffer_count, optim.ratio, optim.cpuadam_cores_perc, optim.pipeline) == (4, 1.0, 0.8, False)
    assert zero.offload_optimizer_device == OffloadDeviceEnum.cpu


def test_fp16_dynamic_loss_scale_args():
    config = _config({"fp16": {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 500,
                               "hysteresis": 3, "consecutive_hysteresis": True, "min_loss_scale": 2}})
    assert config.loss_scale == 0 and config.initial_dynamic_scale == 4096.0
    assert config.dynamic_loss_scale_args == {"init_scale": 4096.0, "scale_window": 500, "delayed_shift": 3,
                                              "consecutive_hysteresis": True, "min_scale": 2}
    static = _config({"fp16": {"enabled": True, "loss_scale": 128}})
    assert static.loss_scale == 128.0 and static.dynamic_loss_scale_args is None


def test_monitor_and_misc_sections():
    config = _config({"tensorboard": {"enabled": True, "output_path": "/tmp/tb"},
                      "comms_logger": {"enabled": True, "prof_ops": ["all_reduce"]},
                      "flops_profiler": {"enabled": True}, "checkpoint": {"tag_validation": "fail"}})
    assert config.monitor_config.enabled and config.monitor_config.tensorboard.output_path == "/tmp/tb"
    assert config.monitor_config.wandb.project == "deepspeed" and config.monitor_config.csv_monitor.job_name == "DeepSpeedJobName"
    assert not _config({}).monitor_config.enabled
    assert config.comms_config.enabled and config.comms_config.prof_all and config.comms_config.prof_ops == ["all_reduce"]
    assert config.wall_clock_breakdown  # switched on by the flops profiler
    assert config.flops_profiler_config.profile_step == 1 and config.flops_profiler_config.detailed
    assert config.checkpoint_config.tag_validation == "Fail"
    assert config.aio_config.block_size == 1_048_576 and config.aio_config.overlap_events
    assert config.activation_checkpointing_config.partition_activations is False


@pytest.mark.parametrize(("name", "dtype"), [("fp32", torch.float32), ("float32", torch.float32),
                                             ("torch.float32", torch.float32), ("fp16", torch.float16),
                                             ("half", torch.float16), ("torch.float16", torch.float16),
                                             ("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16),
                                             ("torch.bfloat16", torch.bfloat16)])
def test_dtype_spellings(name, dtype):
    config = _config({"communication_data_type": name, "data_types": {"grad_accum_dtype": name}})
    assert config.communication_data_type is dtype and config.grad_accum_dtype is dtype


@pytest.mark.parametrize(("given", "name"), [("Adam", "adam"), ("ADAMW", "adamw"), ("Lamb", "lamb"),
                                             ("lion", "lion"), ("Adagrad", "adagrad"), ("SGD", "SGD"),
                                             ("RMSprop", "RMSprop")])
def test_optimizer_names(given, name):
    config = _config({"optimizer": {"type": given, "params": {"lr": 0.1, "weight_decay": "auto"}}})
    assert config.optimizer_name == name and config.optimizer_params == {"lr": 0.1}


# ------------------------------------------------------------------------------------------
# malformed configs: each names its key path, typos get the closest key


MALFORMED = [
    ({"trian_batch_size": 8}, "trian_batch_size", "train_batch_size"),
    ({"gradient_clippin": 1.0}, "gradient_clippin", "gradient_clipping"),
    ({"zero_optimisation": {"stage": 2}}, "zero_optimisation", "zero_optimization"),
    ({"fp16": {"enable": True}}, "fp16.enable", "enabled"),
    ({"bf16": {"enabeld": True}}, "bf16.enabeld", "enabled"),
    ({"zero_optimization": {"stgae": 2}}, "zero_optimization.stgae", "stage"),
    ({"zero_optimization": {"stage3_prefetch_bucket_sise": 10}}, "zero_optimization.stage3_prefetch_bucket_sise",
     "stage3_prefetch_bucket_size"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"devic": "cpu"}}},
     "zero_optimization.offload_optimizer.devic", "device"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memroy": True}}},
     "zero_optimization.offload_param.pin_memroy", "pin_memory"),
    ({"optimizer": {"type": "Adam", "param": {}}}, "optimizer.param", "params"),
    ({"scheduler": {"tpye": "WarmupLR"}}, "scheduler.tpye", "type"),
    ({"tensorboard": {"enabled": True, "output": "x"}}, "tensorboard.output", "output_path"),
    ({"comms_logger": {"verbos": True}}, "comms_logger.verbos", "verbose"),
    ({"checkpoint": {"writer": {"tipe": "FAST"}}}, "checkpoint.writer.tipe", "type"),
    ({"data_types": {"grad_acum_dtype": "fp32"}}, "data_types.grad_acum_dtype", "grad_accum_dtype"),
    ({"flops_profiler": {"profile_stp": 2}}, "flops_profiler.profile_stp", "profile_step"),
    ({"optimizer": {"type": "Adma"}}, "optimizer.type", "adam"),
    ({"scheduler": {"type": "WarmupLr"}}, "scheduler.type", "WarmupLR"),
    ({"communication_data_type": "fp17"}, "communication_data_type", "fp16"),
    ({"data_types": {"grad_accum_dtype": "bfloat61"}}, "data_types.grad_accum_dtype", "bfloat16"),
    # wrong types, negative sizes, out-of-range values
    ({"zero_optimization": {"reduce_bucket_size": "big"}}, "zero_optimization.reduce_bucket_size", None),
    ({"zero_optimization": {"reduce_bucket_size": -1}}, "zero_optimization.reduce_bucket_size", None),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "buffer_count": -2}}},
     "zero_optimization.offload_param.buffer_count", None),
    ({"zero_optimization": {"stage": 1, "allgather_bucket_size": 5}}, "zero_optimization.allgather_bucket_size", None),
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage", None),
    ({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}}, "zero_optimization.offload_optimizer.device", None),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}, "zero_optimization", None),
    ({"fp16": {"enabled": "maybe"}}, "fp16.enabled", None),
    ({"fp16": {"enabled": True, "loss_scale": -1}}, "fp16", None),
    ({"fp16": True}, "fp16", None),
    ({"gradient_clipping": -0.5}, "gradient_clipping", None),
    ({"gradient_allreduce_op": "avg"}, "gradient_allreduce_op", None),
    ({"steps_per_print": 0}, "steps_per_print", None),
    ({"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "max_grad_norm": 1.0}}}, "optimizer.params.max_grad_norm", None),
    ({"train_micro_batch_size_per_gpu": "four"}, "train_micro_batch_size_per_gpu", None),
]


@pytest.mark.parametrize(("extra", "path", "suggestion"), MALFORMED, ids=[case[1] for case in MALFORMED])
def test_malformed(extra, path, suggestion):
    with pytest.raises(ConfigError) as info:
        _config(extra)
    message = str(info.value)
    assert f"  {path}:" in message
    if suggestion is not None:
        assert f"did you mean '{suggestion}'?" in message


def test_error_types():
    assert DeepSpeedConfigError is ConfigError and issubclass(ConfigError, ValueError)


def test_fp16_and_bf16_both_enabled():
    with pytest.raises(ConfigError, match="bfloat16 and fp16 modes cannot be simultaneously enabled"):
        _config({"fp16": {"enabled": True}, "bfloat16": {"enabled": True}})


def test_max_grad_norm_points_to_gradient_clipping():
    with pytest.raises(ConfigError, match="gradient_clipping"):
        _config({"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}})


def test_stage_above_three_uses_deepspeeds_message():
    with pytest.raises(ConfigError, match="Maximum supported ZeRO stage is 3"):
        _config({"zero_optimization": {"stage": 5}})


def test_inconsistent_batch_triple():
    with pytest.raises(ConfigError, match=r"8 != 2 \* 2 \* 1"):
        _config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2})


def test_every_problem_is_listed():
    with pytest.raises(ConfigError) as info:
        _config({"fp16": {"enable": True}, "zero_optimization": {"stgae": 1}})
    assert "fp16.enable" in str(info.value) and "zero_optimization.stgae" in str(info.value)


def test_section_model_alone_reports_its_prefix():
    with pytest.raises(ConfigError, match=r"zero_optimization\.offload_optimizer\.devic.*did you mean 'device'"):
        validate_section(DeepSpeedZeroConfig, {"offload_optimizer": {"devic": "cpu"}}, "zero_optimization")


def test_assignment_is_validated():
    zero = _config({}).zero_config
    zero.stage = 2
    assert zero.stage == ZeroStageEnum.gradients
    with pytest.raises(ValueError):
        zero.reduce_bucket_size = "lots"


# ------------------------------------------------------------------------------------------
# "auto", aliases, deprecated keys, unimplemented keys


def test_auto_inside_sections_takes_the_default():
    config = _config({"gradient_clipping": "auto", "fp16": {"enabled": "auto", "loss_scale_window": "auto"},
                      "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                            "stage3_prefetch_bucket_size": "auto"}})
    assert config.gradient_clipping == 1.0 and config.fp16_enabled is False
    assert config.fp16.loss_scale_window == 1000
    assert config.zero_config.reduce_bucket_size == 500_000_000 and config.zero_config.prefetch_bucket_size == 50_000_000
    assert "zero_optimization.reduce_bucket_size" in config.resolved_auto_keys


@pytest.mark.parametrize("spelling", ["prefetch_bucket_size", "stage3_prefetch_bucket_size"])
def test_stage3_aliases(spelling):
    zero = _config({"zero_optimization": {"stage": 3, spelling: 1234,
                                          "stage3_max_live_parameters": 99, "param_persistence_threshold": 7,
                                          "stage3_gather_16bit_weights_on_model_save": True}}).zero_config
    assert (zero.prefetch_bucket_size, zero.max_live_parameters, zero.param_persistence_threshold) == (1234, 99, 7)
    assert zero.gather_16bit_weights_on_model_save is True


def test_bfloat16_alias():
    assert _config({"bfloat16": {"enabled": True}}).bf16_enabled


def test_deprecated_cpu_offload():
    with pytest.warns(ConfigWarning, match="cpu_offload"):
        zero = _config({"zero_optimization": {"stage": 2, "cpu_offload": True}}).zero_config
    assert zero.offload_optimizer.device == OffloadDeviceEnum.cpu


def test_deprecated_fp16_weights_on_save():
    with pytest.warns(ConfigWarning, match="stage3_gather_fp16_weights_on_model_save"):
        zero = _config({"zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True}}).zero_config
    assert zero.gather_16bit_weights_on_model_save is True


def test_deprecated_bool_zero_optimization():
    with pytest.warns(ConfigWarning, match="zero_optimization"):
        config = _config({"zero_optimization": True, "allgather_size": 1000})
    assert config.zero_optimization_stage == 1 and config.zero_config.allgather_bucket_size == 1000


def test_loss_scale_keys_under_bf16_warn_and_are_ignored():
    with pytest.warns(ConfigWarning, match="loss_scale_window"):
        config = _config({"bf16": {"enabled": True, "loss_scale_window": 100}})
    assert config.bf16_enabled and config.dynamic_loss_scale_args is None


def test_unimplemented_sections_that_cannot_change_the_numbers_warn_once_each():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = _config({"hybrid_engine": {"enabled": True},
                          "torch_autocast": {"enabled": False}, "autotuning": {"enabled": True}})
    messages = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
    assert len(messages) == 3
    for key in ("hybrid_engine", "torch_autocast", "autotuning"):
        assert sum(f"section '{key}'" in message for message in messages) == 1, (key, messages)
    assert config.train_batch_size == 8


@pytest.mark.parametrize(("extra", "named"), [
    ({"progressive_layer_drop": {"enabled": False}}, "progressive_layer_drop: removed from DeepSpeed"),
    ({"elasticity": {"enabled": True}}, "elasticity: removed from DeepSpeed"),
    ({"amp": {"enabled": False}}, "amp: removed from DeepSpeed"),
    ({"compile": {"deepcompile": True}}, "compile: DeepCompile"),
    ({"compile": {"deepcompile": True, "passes": ["z3"]}}, "compile: DeepCompile"),
    ({"compile": {"autoep_non_moe": True}}, "compile: compiling around AutoEP layers"),
    ({"torch_autocast": {"enabled": True}}, "torch_autocast: torch.autocast"),
    ({"data_efficiency": {"enabled": True}}, "data_efficiency: data efficiency"),
    ({"expert_parallel": {"enabled": True}}, "expert_parallel: AutoEP"),
    ({"weight_quantization": {"post_init_quant": {"fc": {}}}}, "weight_quantization: ZeRO weight"),
    ({"zero_optimization": {"stage": 2, "zenflow": {"topk_ratio": 0.1}}}, "zero_optimization.zenflow: ZenFlow"),
    ({"zero_optimization": {"stage": 3, "mics_shard_size": -1}}, "zero_optimization.mics_shard_size: removed"),
])
def test_unimplemented_sections_that_would_change_the_numbers_are_refused_by_name(extra, named):
    with pytest.raises(ConfigError) as info:
        _config(extra)
    assert named in str(info.value)


def test_all_refusals_are_listed_at_once():
    with pytest.raises(ConfigError) as info:
        _config({"sparse_attention": {}, "compression_training": {}, "trian_batch_size": 2})
    message = str(info.value)
    assert "sparse_attention:" in message and "compression_training:" in message


# ------------------------------------------------------------------------------------------
# loading


def test_hjson_file_with_comments(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text("""{
        // HJSON: comments and trailing commas
        "train_batch_size": 16,
        "zero_optimization": {"stage": 2,},  # another comment
    }""")
    config = DeepSpeedConfig(str(path), world_size=2)
    assert (config.train_micro_batch_size_per_gpu, config.zero_optimization_stage) == (8, 2)


def test_duplicate_keys(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 8, "fp16": {"enabled": true, "enabled": false}, "train_batch_size": 4}')
    with pytest.raises(ValueError, match=r"Duplicate keys in DeepSpeed config: \['enabled'\]"):
        load_ds_config(str(path))


def test_base64():
    encoded = base64.urlsafe_b64encode(json.dumps({"train_batch_size": 4}).encode()).decode()
    assert DeepSpeedConfig(encoded).train_batch_size == 4


@pytest.mark.parametrize(("given", "message"), [
    ("/no/such/file.json", "ds_config file not found: '/no/such/file.json'"),
    ("ds_config.json", "ds_config file not found: 'ds_config.json' (working directory"),
    ("", "the ds_config path is an empty string"),
    (None, "no ds_config was given (config=None)"),
    (3, "a ds_config cannot be a int"),
    ("not-base64!", "'not-base64!' is neither an existing file nor base64-encoded JSON"),
])
def test_bad_config_argument_says_what_it_received(given, message):
    with pytest.raises(ConfigError) as info:
        DeepSpeedConfig(given)
    assert message in str(info.value)


def test_config_path_that_is_a_directory(tmp_path):
    with pytest.raises(ConfigError, match="is a directory, not a file"):
        DeepSpeedConfig(str(tmp_path))


def test_dict_is_not_mutated():
    given = {"train_batch_size": 8, "zero_optimization": {"stage": 2, "cpu_offload": False}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        DeepSpeedConfig(given)
    assert given == {"train_batch_size": 8, "zero_optimization": {"stage": 2, "cpu_offload": False}}


def test_print(caplog):
    logger = logging.getLogger("zerospeed")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.propagate = True
    try:
        with caplog.at_level(logging.INFO, logger="zerospeed"):
            _config({"zero_optimization": {"reduce_bucket_size": 50_000_000}}).print("DeepSpeedEngine configuration")
    finally:
        logger.setLevel(level)
        logger.propagate = False
    text = caplog.text
    assert "DeepSpeedEngine configuration:" in text
    assert "  gradient_clipping ............ 1.0" in text
    assert "5.000000e+07" in text


def test_root_model_is_usable_alone():
    root = DeepSpeedRootConfig.model_validate({"train_batch_size": 2})
    assert root.gradient_clipping == 1.0 and root.steps_per_print is None


@pytest.mark.parametrize("stage", [0, 3])
def test_odd_allgather_bucket_size_is_accepted_where_no_stage_reads_it(stage):
    # DeepSpeed asserts evenness only in its stage-1/2 optimizer.
    config = _config({"zero_optimization": {"stage": stage, "allgather_bucket_size": 4321}})
    assert config.zero_config.allgather_bucket_size == 4321


def test_compile_section_is_typed_with_deepspeeds_defaults_and_compiles_nothing_at_load():
    config = _config({"compile": {"deepcompile": False, "passes": ["z1"], "double_buffer": False}})
    assert config.compile_config.passes == ["z1"] and config.compile_config.double_buffer is False
    assert _config({}).compile_config.deepcompile is False
    with pytest.raises(ConfigError, match="did you mean 'double_buffer'"):
        _config({"compile": {"double_bufer": True}})
    with pytest.raises(ConfigError, match="passes"):
        _config({"compile": {"passes": ["z2"]}})
