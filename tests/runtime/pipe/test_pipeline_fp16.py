"""fp16 pipelined training equals a single-process torch mixed-precision loop: fp16 weights, fp32
masters, dynamic loss scaling with overflow skips, clipping by the unscaled global norm."""

import math

import torch

import zerospeed
from distributed import run_on_ranks
from parity import assert_close_relative
from pipe_models import BASE_SEED, Reference, batches, micro_batches_of, mlp_specs, pipeline_named_params

STEPS, MICRO, GAS, BLOCKS, LR, CLIP = 5, 2, 3, 3, 1e-3, 0.5
# A loss scale at which the first step overflows only in the last layer (stage 1): every stage must
# skip it together; the run halves the scale, recovers and overflows once more.
SCALE_POWER, LABEL_GAIN = 17, 1.0
FP16 = {"enabled": True, "initial_scale_power": SCALE_POWER, "hysteresis": 1, "loss_scale_window": 2}
FP16_EPS = 2.0 ** -10


def _loss(outputs, labels):
    return torch.nn.functional.mse_loss(outputs.float(), labels)


def _data():
    return [(x.half(), y * LABEL_GAIN) for x, y in batches("mlp", STEPS, MICRO * GAS)]


def _pipelined():
    from zerospeed.pipe import PipelineModule

    module = PipelineModule(mlp_specs(BLOCKS), num_stages=2, loss_fn=_loss, seed_layers=True, base_seed=BASE_SEED)
    config = {"train_batch_size": MICRO * GAS, "train_micro_batch_size_per_gpu": MICRO, "fp16": FP16,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
              "gradient_clipping": CLIP}
    engine, _, _, _ = zerospeed.initialize(model=module, config=config)
    losses, scales, norms = [], [], []
    for batch in _data():
        losses.append(float(engine.train_batch(micro_batches_of(batch, 0, 1, MICRO, GAS))))
        scales.append(engine.optimizer.cur_scale)
        norms.append(engine.get_global_grad_norm())
    return {"losses": losses, "scales": scales, "norms": norms, "skipped": engine.skipped_steps,
            "params": pipeline_named_params(engine.module), "dtype": next(engine.module.parameters()).dtype}


def _reference():
    """fp16 model, fp32 masters, DeepSpeed's dynamic loss scaler (hysteresis 1) written out."""
    model = Reference(mlp_specs(BLOCKS))
    masters = [p.detach().clone() for p in model.parameters()]
    model.half()
    optimizer = torch.optim.AdamW(masters, lr=LR, weight_decay=0.01)
    scale, last_overflow, losses, scales, norms, skipped, norm = 2.0 ** SCALE_POWER, -1, [], [], [], 0, 0.0
    for step, batch in enumerate(_data()):
        step_loss = 0.0
        for x, y in micro_batches_of(batch, 0, 1, MICRO, GAS):
            loss = _loss(model(x), y)
            (loss / GAS * scale).backward()
            step_loss += loss.item() / GAS
        grads = [p.grad for p in model.parameters()]
        if not all(torch.isfinite(g).all() for g in grads):
            skipped, last_overflow, scale = skipped + 1, step, scale / 2
        else:
            norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads)) / scale
            factor = min(1.0, CLIP / (norm + 1e-6))
            for master, grad in zip(masters, grads):
                master.grad = grad.float() * factor / scale
            optimizer.step()
            with torch.no_grad():
                for master, param in zip(masters, model.parameters()):
                    param.copy_(master)
            stable = step - last_overflow - 1   # DeepSpeed's window counts clean steps since the overflow
            if stable > 0 and stable % 2 == 0:
                scale *= 2
        model.zero_grad(set_to_none=True)
        losses.append(step_loss)
        scales.append(scale)
        norms.append(norm)
    params = {name[len("layers."):]: p.detach().float() for name, p in model.named_parameters()}
    return {"losses": losses, "scales": scales, "norms": norms, "skipped": skipped, "params": params}


def test_fp16_pipeline_skips_overflows_and_equals_torch_mixed_precision():
    results = run_on_ranks(_pipelined, 2)
    reference = _reference()
    assert 0 < reference["skipped"] < STEPS - 1, reference["scales"]  # the case exercises both paths
    seen = set()
    for result in results:
        assert result["dtype"] == torch.float16
        assert result["skipped"] == reference["skipped"] and result["scales"] == reference["scales"]
        assert_close_relative(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), 4 * FP16_EPS,
                              "losses")
        assert_close_relative(torch.tensor(result["norms"]), torch.tensor(reference["norms"]), 4 * FP16_EPS,
                              "norms")
        for name, value in result["params"].items():
            assert_close_relative(value, reference["params"][name], 2 * FP16_EPS, name)
            seen.add(name)
    assert seen == set(reference["params"])
