"""ZeRO stages 0-3 on GPUs over NCCL (world size 1, and every GPU when there are more), fp32 and
bf16, with the offload modes: losses against single-process torch on the same device and data.

fp32 runs with TF32 off on both sides, so only the summation order differs (bucketing, reduce-
scatter): rtol 1e-4 over 6 steps. bf16 is compared with the fp32 reference at bf16's resolution
(2^-8 relative per rounding, a few roundings per step): rtol 3e-2.
"""

import pytest
import torch
from cuda_ranks import gpu_world_sizes, run_nccl

STEPS, MICRO, SEQ, LR = 6, 4, 64, 1e-3
ADAM = {"lr": LR, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}
CASES = [  # (stage, dtype, zero_optimization extras)
    (0, "fp32", {}), (1, "fp32", {}), (2, "fp32", {}), (3, "fp32", {"stage3_param_persistence_threshold": 0}),
    (1, "bf16", {}), (2, "bf16", {}), (3, "bf16", {}),
    (2, "fp32", {"offload_optimizer": {"device": "cpu"}}),                        # CPU Adam, GPU params
    (3, "fp32", {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}),
    (3, "fp32", {"offload_param": {"device": "cpu"}}),                            # parameter offload alone
]


def _gpt():
    from example_models import load_example

    gpt = load_example("gpt")
    GPT, GPTConfig = gpt.GPT, gpt.GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, block_size=SEQ, n_layer=2, n_head=4, n_embd=128))


def _global_batches(world_size):
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (MICRO * world_size, SEQ + 1), generator=generator) for _ in range(STEPS)]


def _reference(world_size):
    """Single-process torch on cuda:0: AdamW on the global batch (the mean over ranks' means)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _gpt().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    losses = []
    for tokens in _global_batches(world_size):
        tokens = tokens.cuda()
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _train(stage, dtype, zero_extra):
    import zerospeed

    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    offloaded = "offload_optimizer" in zero_extra
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "optimizer": {"type": "AdamW", "params": {**ADAM, "torch_adam": not offloaded}},
              "zero_optimization": {"stage": stage, **zero_extra}}
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    engine, *_ = zerospeed.initialize(model=_gpt(), config=config)
    assert engine.device.type == "cuda"
    losses = []
    for tokens in _global_batches(world_size):
        local = tokens[rank * MICRO:(rank + 1) * MICRO].to(engine.device)
        loss = engine(local[:, :-1], local[:, 1:])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().float().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / world_size)
    return losses, torch.cuda.max_memory_allocated()


@pytest.mark.parametrize("world_size", gpu_world_sizes())
@pytest.mark.parametrize(("stage", "dtype", "zero_extra"), CASES,
                         ids=[f"z{s}-{d}" + "".join(f"-{k}" for k in z if k.startswith("offload")) for s, d, z in CASES])
def test_zero_on_gpus_matches_single_process_torch(world_size, stage, dtype, zero_extra):
    reference = _reference(world_size)
    rtol = 1e-4 if dtype == "fp32" else 3e-2
    for losses, peak in run_nccl(_train, world_size, stage, dtype, zero_extra):
        assert peak > 0
        for step, (got, expected) in enumerate(zip(losses, reference)):
            assert abs(got - expected) <= rtol * abs(expected), (step, got, expected)
