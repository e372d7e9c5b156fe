"""A pipeline checkpoint resumes at another layout directly, optimizer state included (no
conversion step): another stage count, another partition of the layers, another data-parallel
size, the ZeRO stage ([Note: pipeline optimizer resharding]). A model trained with AdamW (ZeRO-1 or 2, a warmup
scheduler) at one layout is saved and continued; a fresh run at the other layout, initialized
differently, loads the checkpoint and takes the same steps. The global batch is the same on both
sides (gradient accumulation makes up the dp size), so everything must equal the saving run
continued: losses, every parameter, its fp32 master and both Adam moments at fp32 tolerance
(relative to each tensor's largest element), and the step count. A lost or misplaced moment shows
at once (a fresh optimizer's first step is lr * sign(grad)).
"""


import pytest
import torch

from adam_state import adam_state, compare_adam_states
from distributed import run_on_ranks
from pipe_models import BASE_SEED, batches, lm_loss, micro_batches_of, mlp_specs, mse, tied_specs

MICRO, GLOBAL_BATCH, SAVE_AT, STEPS = 2, 8, 2, 4
TOL = 1e-6   # fp32: the same sums in another order (micro-batches accumulated per dp rank)
MODELS = {"tied": (lambda: tied_specs(2), lm_loss, "lm"), "mlp": (lambda: mlp_specs(3), mse, "mlp")}


def _engine(model: str, num_stages: int, partition: str, zero_stage: int):
    import zerospeed
    from zerospeed.pipe import PipelineModule

    specs, loss_fn, _ = MODELS[model]
    module = PipelineModule(specs(), num_stages=num_stages, loss_fn=loss_fn, seed_layers=True, base_seed=BASE_SEED,
                            partition_method=partition)
    config = {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": MICRO,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_min_lr": 1e-3,
                                                            "warmup_max_lr": 1e-2}},
              "zero_optimization": {"stage": zero_stage}}
    engine, _, _, _ = zerospeed.initialize(model=module, config=config)
    return engine


def _steps(engine, model: str, steps) -> list[float]:
    data = batches(MODELS[model][2], STEPS, GLOBAL_BATCH)
    dp = engine.grid.get_data_parallel_world_size()
    gas, dp_rank = GLOBAL_BATCH // (MICRO * dp), engine.grid.get_data_parallel_rank()
    return [float(engine.train_batch(micro_batches_of(data[step], dp_rank, dp, MICRO, gas))) for step in steps]


def _whole_model(engine) -> dict:
    """Every stage's parameters and Adam state, on every rank (a tied weight's copies are equal)."""
    mine = {"weights": {name: p.detach().clone() for name, p in engine.module.named_parameters()},
            "adam": adam_state(engine)}
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, mine)
    params = {name: value for stage in gathered for name, value in stage["adam"]["params"].items()}
    steps = {stage["adam"]["step"] for stage in gathered}
    assert len(steps) == 1, steps
    return {"weights": {name: value for stage in gathered for name, value in stage["weights"].items()},
            "adam": {"params": params, "step": steps.pop()}}


def _save_and_continue(model, layout, root):
    """The saving run: trained to SAVE_AT, saved, continued to STEPS."""
    engine = _engine(model, *layout)
    _steps(engine, model, range(SAVE_AT))
    engine.save_checkpoint(root, tag="t")
    return {"losses": _steps(engine, model, range(SAVE_AT, STEPS)), **_whole_model(engine)}


def _load_and_continue(model, layout, root):
    torch.manual_seed(99)   # another init: everything must come from the checkpoint
    engine = _engine(model, *layout)
    try:
        engine.load_checkpoint(root, tag="t")
    except ValueError as error:
        return str(error)
    steps = engine.global_steps
    return {"losses": _steps(engine, model, range(SAVE_AT, STEPS)), "steps": steps, **_whole_model(engine)}


CASES = {   # name: model, (world size, (stages, partition method, ZeRO stage)) saved, then loaded
    "2stages_to_1stage_dp2": ("tied", (2, (2, "parameters", 1)), (2, (1, "parameters", 1))),
    "1stage_dp2_to_2stages": ("tied", (2, (1, "parameters", 1)), (2, (2, "parameters", 1))),
    "2stages_to_1stage_dp1": ("tied", (2, (2, "parameters", 1)), (1, (1, "parameters", 1))),
    "2stages_dp2_to_dp1": ("tied", (4, (2, "parameters", 1)), (2, (2, "parameters", 1))),
    "partition_uniform_to_parameters": ("mlp", (2, (2, "uniform", 1)), (2, (2, "parameters", 1))),
    "2stages_z2_to_1stage_dp2_z1": ("tied", (2, (2, "parameters", 2)), (2, (1, "parameters", 1))),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_pipeline_optimizer_state_reshards_at_load(case, tmp_path):
    model, (saved_world, saved), (loaded_world, loaded) = CASES[case]
    expected = run_on_ranks(_save_and_continue, saved_world, model, saved, str(tmp_path))[0]
    for rank, got in enumerate(run_on_ranks(_load_and_continue, loaded_world, model, loaded, str(tmp_path))):
        assert got["steps"] == SAVE_AT, (rank, got)
        loss = max(abs(a - b) / b for a, b in zip(got["losses"], expected["losses"]))
        assert got["weights"].keys() == expected["weights"].keys()
        param = max((got["weights"][k] - v).abs().max().item() for k, v in expected["weights"].items())
        adam = compare_adam_states(got["adam"], expected["adam"])
        assert adam["step"] == adam["expected_step"] == STEPS, (rank, adam)
        assert loss < TOL and param < TOL, (rank, loss, param)
        assert max(adam[key] for key in ("fp32", "exp_avg", "exp_avg_sq")) < TOL, (rank, adam)


def test_stage0_pipeline_optimizer_state_is_refused_at_another_layout_naming_both(tmp_path):
    run_on_ranks(_save_and_continue, 2, "tied", (2, "parameters", 0), str(tmp_path))
    for message in run_on_ranks(_load_and_continue, 2, "tied", (1, "parameters", 0), str(tmp_path)):
        assert isinstance(message, str), message
        assert "2 pipeline stage(s) x dp 1, ZeRO stage 0" in message, message
        assert "1 pipeline stage(s) x dp 2, ZeRO stage 0" in message, message
        assert "load_optimizer_states=False" in message, message


def test_a_module_the_checkpoint_no_longer_fits_is_refused_naming_both_layouts():
    from zerospeed.checkpoint.full_state import FullOptimizerState
    from zerospeed.runtime.pipe.optimizer_reshard import PipelineLayout, check_fits

    full = FullOptimizerState(fp32={"1.fc.weight": torch.zeros(4, 4)})
    saved, loading = PipelineLayout(2, 1, 1), PipelineLayout(1, 2, 1)
    check_fits(full, {"1.fc.weight": torch.Size([4, 4])}, "ckpt/t", saved, loading)
    for shapes, what in (({"1.fc.weight": torch.Size([4, 5])}, "has shape (4, 4) there"),
                         ({"2.fc.weight": torch.Size([4, 4])}, "is not in it")):
        with pytest.raises(ValueError) as error:
            check_fits(full, shapes, "ckpt/t", saved, loading)
        assert what in str(error.value) and str(saved) in str(error.value) and str(loading) in str(error.value)
