"""zero.Init, GatheredParameters, external parameters, save_16bit_model and the partitioned-use error."""

import json
import os
import sys

import pytest
import torch
from distributed import run_on_ranks

import zerospeed

sys.path.insert(0, os.path.dirname(__file__))
from test_stage3 import build_model


def _built_under_init(kind):
    with zerospeed.zero.Init() as init:
        model = build_model(kind)
    world_size, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    params = list({id(p): p for p in model.parameters()}.values())
    total = sum(p.ds_numel for p in params)
    largest_module = max(sum(p.ds_numel for p in m.parameters(recurse=False)) for m in model.modules())
    for p in params:
        assert p.ds_status is zerospeed.zero.ZeroParamStatus.NOT_AVAILABLE and p.numel() == 0
        assert p.ds_tensor.numel() == p.partition_numel() == -(-p.ds_numel // world_size)
    with zerospeed.zero.GatheredParameters(params):
        full = {n: p.detach().clone() for n, p in model.named_parameters()}
    return init.peak_full_numel, total, largest_module, full, rank


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_zero_init_never_holds_the_full_model(kind):
    if kind == "llama":
        pytest.importorskip("transformers")
    results = run_on_ranks(_built_under_init, 2, kind)
    for peak, total, largest_module, full, _ in results:
        assert peak <= largest_module < total / 4
        for name, value in full.items():  # every rank rebuilds the same (rank 0's) weights
            assert torch.equal(value, results[0][3][name]), name


def _gathered_modifier(modifier_rank):
    with zerospeed.zero.Init():
        model = torch.nn.Linear(5, 3)
    rank = torch.distributed.get_rank()
    with zerospeed.zero.GatheredParameters(model.weight, modifier_rank=modifier_rank):
        assert model.weight.shape == (3, 5)
        before = model.weight.detach().clone()
        with torch.no_grad():
            model.weight.fill_(float(rank + 7))
    assert model.weight.numel() == 0  # partitioned again
    with zerospeed.zero.GatheredParameters(model.weight):
        after = model.weight.detach().clone()
    return before, after, model.weight.ds_tensor.clone()


def test_gathered_parameters_modifier_rank_edit_is_visible_partitioned_everywhere():
    for rank, (_before, after, part) in enumerate(run_on_ranks(_gathered_modifier, 2, 0)):
        assert torch.equal(after, torch.full((3, 5), 7.0))  # rank 0's edit, on every rank
        real = 8 if rank == 0 else 7  # 15 elements: ranks hold 8 + 7 (+1 padding)
        assert torch.equal(part[:real], torch.full((real,), 7.0))


def test_gathered_parameters_without_modifier_discards_edits():
    for before, after, _ in run_on_ranks(_gathered_modifier, 2, None):
        assert torch.equal(after, before)


class Borrower(torch.nn.Module):
    """`head` multiplies by `body.weight`, a parameter it does not own."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 4)

    def forward(self, x, y):
        hidden = self.head(self.body(x))
        return torch.nn.functional.mse_loss(hidden @ self.body.weight, y)


def _borrower(register):
    torch.manual_seed(0)
    reference = Borrower()
    torch.manual_seed(0)
    model = Borrower()
    config = {"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 3, "param_persistence_threshold": 0}}
    engine, *_ = zerospeed.initialize(model=model, config=config)
    if register:
        zerospeed.zero.register_external_parameter(model, model.body.weight)
    x, y = torch.randn(2, 4, generator=torch.Generator().manual_seed(1)), torch.zeros(2, 4)
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    return loss.item(), reference(x, y).item()


@pytest.mark.parametrize("register", [True, False])
def test_parameter_used_by_a_module_that_does_not_own_it(register):
    for loss, expected in run_on_ranks(_borrower, 2, register):
        assert abs(loss - expected) < 1e-6


def _use_outside_forward():
    model = torch.nn.Linear(4, 4)
    config = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 3, "param_persistence_threshold": 0}}
    engine, *_ = zerospeed.initialize(model=model, config=config)
    output = engine(torch.randn(1, 4)).sum()
    try:
        output = output + model.weight.sum()  # weight is partitioned here: no silent [0]-shaped sum
    except RuntimeError as error:
        return str(error)
    return ""


def test_partitioned_parameter_used_outside_forward_is_a_clear_error():
    for message in run_on_ranks(_use_outside_forward, 2):
        assert "'weight'" in message and "partitioned" in message and "GatheredParameters" in message


def _save_16bit(tmp_dir, gather):
    torch.manual_seed(0)
    model = build_model("gpt")
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    config = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": gather}}
    engine, *_ = zerospeed.initialize(model=model, config=config)
    saved = engine.save_16bit_model(tmp_dir)
    return saved, expected


@pytest.mark.parametrize("gather", [True, False])
def test_save_16bit_model(tmp_path, gather):
    results = run_on_ranks(_save_16bit, 2, str(tmp_path), gather)
    assert all(saved is gather for saved, _ in results)
    path = tmp_path / "pytorch_model.bin"
    assert path.exists() is gather
    if gather:
        state = torch.load(path, weights_only=True)
        expected = results[0][1]
        assert state.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(state[key], value), key
        assert state["lm_head.weight"].data_ptr() == state["wte.weight"].data_ptr()  # tied stays tied


# --- zero.Init with a config (issue 14 item 2) --------------------------------------------------------

_HF_AUTO_CONFIG = {  # what transformers hands zero.Init before it fills the hidden-size values
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto"}}


def _config_arg(form, tmp_dir):
    config = {"train_batch_size": 4, "zero_optimization": {"stage": 3}}
    if form == "dict":
        return config
    if form == "auto":
        return _HF_AUTO_CONFIG
    path = os.path.join(tmp_dir, f"ds_config.{form}")
    with open(path, "w") as handle:
        if form == "json":
            json.dump(config, handle)
        else:  # hjson: comments and unquoted keys, as DeepSpeed reads it
            handle.write("{\n  // a comment\n  train_batch_size: 4\n  zero_optimization: {stage: 3}\n}\n")
    return path


def _built_with_config(form, tmp_dir):
    with zerospeed.zero.Init(config_dict_or_path=_config_arg(form, tmp_dir)):
        model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.LayerNorm(3))
    return [(p.numel(), p.ds_numel, tuple(p.ds_shape), p.ds_tensor.numel(), p.ds_persist, p.dtype)
            for p in model.parameters()]


@pytest.mark.parametrize("form", ["dict", "json", "hjson", "auto"])
def test_zero_init_with_a_config_partitions_every_parameter(form, tmp_path):
    for rank_result in run_on_ranks(_built_with_config, 2, form, str(tmp_path)):
        shapes = [(3, 5), (3,), (3,), (3,)]
        for (local, ds_numel, ds_shape, part, persist, dtype), shape in zip(rank_result, shapes):
            numel = int(torch.Size(shape).numel())
            assert (local, ds_numel, ds_shape, part) == (0, numel, shape, -(-numel // 2))
            assert not persist and dtype == torch.float32  # the threshold applies at initialize


def _gathered_write_after_initialize(modifier_rank):
    torch.manual_seed(0)
    reference = torch.nn.Linear(4, 2)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)  # 10 elements: persistent under the default threshold
    config = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
              "zero_optimization": {"stage": 3}}
    engine, *_ = zerospeed.initialize(model=model, config=config)
    assert model.weight.ds_persist and model.weight.numel() == 8
    with zerospeed.zero.GatheredParameters([model.weight, model.bias], modifier_rank=modifier_rank):
        with torch.no_grad():
            model.weight.fill_(float(torch.distributed.get_rank() + 3))
    status = model.weight.ds_status.name
    x = torch.ones(1, 4)
    with torch.no_grad():
        if modifier_rank == 0:
            reference.weight.fill_(3.0)
        expected = reference(x)
    return engine(x).detach(), expected, status


@pytest.mark.parametrize("modifier_rank", [None, 0])
def test_gathered_parameters_writes_on_persistent_params_follow_modifier_rank(modifier_rank):
    """Discarded without modifier_rank (DeepSpeed partitions persistent params on exit too), kept with it."""
    for output, expected, status in run_on_ranks(_gathered_write_after_initialize, 2, modifier_rank):
        assert status == "NOT_AVAILABLE"
        assert torch.equal(output, expected)


def _ignored_option_warnings():
    import warnings

    from zerospeed.runtime.zero import zero_init

    zero_init._warned.clear()   # once per process: this pooled worker may have warned in an earlier test
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with zerospeed.zero.Init(pin_memory=True, mem_efficient_linear=False, zero_quantized_weights=True,
                                     remote_device="nvme"):
                torch.nn.Linear(2, 2)
        # honoured options and defaults: nothing to say
        with zerospeed.zero.Init(remote_device="cpu", dtype=torch.bfloat16, pin_memory=False):
            torch.nn.Linear(2, 2)
        with zerospeed.zero.Init(config_dict_or_path={"train_micro_batch_size_per_gpu": 1,
                                                      "zero_optimization": {"stage": 3}}):
            torch.nn.Linear(2, 2)
    return [str(w.message) for w in caught if "zero.Init" in str(w.message)]


def test_zero_init_warns_once_for_each_ignored_option():
    messages = run_on_ranks(_ignored_option_warnings, 1)[0]
    assert len(messages) == 4, messages
    for name in ("pin_memory", "mem_efficient_linear", "zero_quantized_weights", "remote_device"):
        assert sum(name in m and "ignored" in m for m in messages) == 1, (name, messages)
    assert "remote_device='nvme'" in next(m for m in messages if "remote_device" in m)
