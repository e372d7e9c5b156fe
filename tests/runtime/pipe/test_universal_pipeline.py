"""Pipeline checkpoints through DeepSpeed's universal format: a tied-embedding pipeline model
trained with AdamW (ZeRO-1) on 2 gloo ranks at one stage count, saved, converted by
`ds_to_universal` (every stage's parameters, by global layer index, into one folder) and resumed
with `"load_universal": true` at another stage count and data-parallel size. The global batch is
the same on both sides (gradient accumulation makes up the dp size), so the next steps must
equal the saving run continued: losses and every parameter at fp32 tolerance, the step count.
(The same checkpoint also loads directly at another stage count: test_pipeline_optimizer_reshard.py.)
"""

import os

import pytest
import torch

from distributed import run_on_ranks
from pipe_models import BASE_SEED, batches, lm_loss, micro_batches_of, pipeline_named_params, tied_specs

MICRO, GLOBAL_BATCH, SAVE_AT, STEPS = 2, 8, 2, 4
TOL = 1e-6   # fp32: the same sums in another order (micro-batches accumulated per dp rank)


def _engine(num_stages, universal):
    import zerospeed
    from zerospeed.pipe import PipelineModule

    dp = torch.distributed.get_world_size() // num_stages
    module = PipelineModule(tied_specs(2), num_stages=num_stages, loss_fn=lm_loss, seed_layers=True,
                            base_seed=BASE_SEED)
    config = {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": MICRO,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_min_lr": 1e-3,
                                                            "warmup_max_lr": 1e-2}},
              "zero_optimization": {"stage": 1}, **({"checkpoint": {"load_universal": True}} if universal else {})}
    engine, _, _, _ = zerospeed.initialize(model=module, config=config)
    return engine, dp


def _steps(engine, dp, steps):
    data = batches("lm", STEPS, GLOBAL_BATCH)
    gas, dp_rank = GLOBAL_BATCH // (MICRO * dp), engine.grid.get_data_parallel_rank()
    return [float(engine.train_batch(micro_batches_of(data[step], dp_rank, dp, MICRO, gas))) for step in steps]


def _all_params(engine):
    """Every stage's parameters by reference name, on every rank."""
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, pipeline_named_params(engine.module))
    return {name: value for params in gathered for name, value in params.items()}


def _through_universal(saved_stages, loaded_stages, root):
    from zerospeed.checkpoint.universal.convert import convert_to_universal

    engine, dp = _engine(saved_stages, universal=False)
    _steps(engine, dp, range(SAVE_AT))
    engine.save_checkpoint(root, tag="t")
    continued, expected = _steps(engine, dp, range(SAVE_AT, STEPS)), _all_params(engine)
    if torch.distributed.get_rank() == 0:
        convert_to_universal(os.path.join(root, "t"), os.path.join(root, "t_universal"), inject_missing_state=True)
    torch.distributed.barrier()
    torch.manual_seed(99)   # another init: everything must come from the folder
    resumed, dp = _engine(loaded_stages, universal=True)
    resumed.load_checkpoint(root)
    steps = resumed.global_steps
    losses, got = _steps(resumed, dp, range(SAVE_AT, STEPS)), _all_params(resumed)
    return {"loss": max(abs(a - b) / b for a, b in zip(losses, continued)), "steps": steps,
            "param": max((got[k] - expected[k]).abs().max().item() for k in expected), "names": sorted(got)}


@pytest.mark.parametrize("saved_stages,loaded_stages", [(2, 1), (1, 2)])
def test_pipeline_checkpoint_resumes_at_another_stage_count_through_universal(saved_stages, loaded_stages, tmp_path):
    for rank, result in enumerate(run_on_ranks(_through_universal, 2, saved_stages, loaded_stages, str(tmp_path))):
        assert result["steps"] == SAVE_AT, (rank, result)
        assert result["loss"] < TOL and result["param"] < TOL, (rank, result)
        assert len(result["names"]) == 5, result["names"]   # the tied embedding and two blocks' weights, biases

