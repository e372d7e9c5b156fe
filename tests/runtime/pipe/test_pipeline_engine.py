"""Pipelined training through `zerospeed.initialize(model=PipelineModule)` equals single-process
torch on the same global batch (losses and final parameters, fp32, 1e-6 relative)."""


import pytest
import torch

import zerospeed
from distributed import run_on_ranks
from parity import assert_close_relative
from pipe_models import (BASE_SEED, Reference, batches, lm_loss, micro_batches_of, mlp_specs, mse,
                         pipeline_named_params, tied_specs)

STEPS, MICRO, LR, CLIP = 3, 2, 1e-3, 0.5


def _config(gas, dp, extra):
    config = {"train_batch_size": MICRO * gas * dp, "train_micro_batch_size_per_gpu": MICRO,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
              "gradient_clipping": CLIP, "steps_per_print": 1}
    for key, value in (extra or {}).items():
        config[key] = value
    return config


def _specs(kind, num_blocks):
    return tied_specs(num_blocks) if kind == "lm" else mlp_specs(num_blocks)


def _train_pipeline(kind, num_stages, gas, num_blocks, module_kwargs, extra, eval_too=False):
    from zerospeed.pipe import PipelineModule

    world = torch.distributed.get_world_size()
    dp = world // num_stages
    module = PipelineModule(_specs(kind, num_blocks), num_stages=num_stages, loss_fn=lm_loss if kind == "lm" else mse,
                            seed_layers=True, base_seed=BASE_SEED, **module_kwargs)
    engine, _, _, _ = zerospeed.initialize(model=module, config=_config(gas, dp, extra))
    dp_rank = engine.grid.get_data_parallel_rank()
    losses = []
    for batch in batches(kind, STEPS, MICRO * gas * dp):
        losses.append(float(engine.train_batch(micro_batches_of(batch, dp_rank, dp, MICRO, gas))))
    result = {"losses": losses, "params": pipeline_named_params(engine.module), "norm": engine.get_global_grad_norm(),
              "steps": engine.global_steps, "parts": module.parts}
    if eval_too:
        batch = batches(kind, 1, MICRO * gas * dp, seed=99)[0]
        result["eval"] = float(engine.eval_batch(iter(micro_batches_of(batch, dp_rank, dp, MICRO, gas))))
    return result


def _reference(kind, gas, dp, num_blocks, eval_too=False):
    model = Reference(_specs(kind, num_blocks))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    loss_fn = lm_loss if kind == "lm" else mse
    losses = []
    for x, y in batches(kind, STEPS, MICRO * gas * dp):
        loss = loss_fn(model(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    params = {}
    for name, param in model.named_parameters():
        params[name[len("layers."):]] = param.detach().clone()
    result = {"losses": losses, "params": params, "norm": float(norm)}
    if eval_too:
        x, y = batches(kind, 1, MICRO * gas * dp, seed=99)[0]
        with torch.no_grad():
            model.eval()
            result["eval"] = loss_fn(model(x), y).item()
    return result


def _check(results, reference, rtol=1e-6):
    seen = set()
    for result in results:
        assert_close_relative(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol, "losses")
        assert result["steps"] == STEPS
        assert result["norm"] == pytest.approx(reference["norm"], rel=1e-5)
        for name, value in result["params"].items():
            assert_close_relative(value, reference["params"][name], rtol, name)
            seen.add(name)
        if "eval" in result:
            assert result["eval"] == pytest.approx(reference["eval"], rel=1e-6)
    assert seen == set(reference["params"])  # every parameter lives on some stage
    assert reference["norm"] > CLIP  # clipping was active


CASES = {
    "2stages-dp1": (2, "mlp", 2, 4, 3, {}, {}),
    "2stages-dp2": (4, "mlp", 2, 2, 3, {}, {}),
    "4stages": (4, "mlp", 4, 4, 4, {"partition_method": "uniform"}, {}),
    "gpipe": (2, "mlp", 2, 3, 3, {}, {"pipeline": {"schedule": "gpipe"}}),
    "interleaved": (2, "mlp", 2, 4, 4, {"num_chunks": 2}, {"pipeline": {"schedule": "interleaved_1f1b"}}),
    "tied-lm": (2, "lm", 2, 3, 2, {"partition_method": "type:block|embed"}, {}),
    "tied-lm-dp2": (4, "lm", 2, 2, 2, {}, {}),
    "checkpoint-interval": (2, "mlp", 2, 2, 4, {"activation_checkpoint_interval": 2}, {}),
    "zero1-dp2": (4, "mlp", 2, 2, 3, {}, {"zero_optimization": {"stage": 1}}),
    "zero2-dp2": (4, "mlp", 2, 2, 3, {}, {"zero_optimization": {"stage": 2}}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pipelined_training_equals_single_process_torch(case):
    world, kind, stages, gas, blocks, module_kwargs, extra = CASES[case]
    results = run_on_ranks(_train_pipeline, world, kind, stages, gas, blocks, module_kwargs, extra,
                           eval_too=case in ("2stages-dp2", "tied-lm"))
    reference = _reference(kind, gas, world // stages, blocks, eval_too=case in ("2stages-dp2", "tied-lm"))
    _check(results, reference)


def _refusals():
    from zerospeed.pipe import PipelineModule
    from zerospeed.runtime.pipe.module import PipelineError

    module = PipelineModule(mlp_specs(2), num_stages=2, loss_fn=mse)
    engine, _, _, _ = zerospeed.initialize(model=module, config=_config(2, 1, {}))
    messages = []
    for call in (lambda: engine(torch.zeros(1)), lambda: engine.backward(torch.zeros(())), engine.step):
        with pytest.raises(PipelineError, match="Only train_batch"):
            call()
    with pytest.raises(ValueError, match="ZeRO stage 3.*zero_optimization.stage"):
        zerospeed.initialize(model=PipelineModule(mlp_specs(2), num_stages=2, loss_fn=mse),
                             config=_config(2, 1, {"zero_optimization": {"stage": 3}}))
    with torch.no_grad(), pytest.raises(RuntimeError, match="requires gradients"):
        engine.train_batch(iter([]))
    return messages


def test_pipeline_engine_refuses_what_deepspeed_refuses():
    run_on_ranks(_refusals, 2)


