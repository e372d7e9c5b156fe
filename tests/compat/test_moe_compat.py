"""zerospeed.moe against the real DeepSpeed 0.19.8, in process: same logits / weights / seed, same bits.

DeepSpeed's gating functions and its MoE layer at ep_size=1 are plain torch, so both run here on
identical inputs. Where DeepSpeed draws noise (random token selection, second-expert sampling,
Jitter, RSample) both draw it from the same seeded torch generator in the same order, so even
those paths must agree exactly; the comparisons are `torch.equal`, not tolerances.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from deepspeed_extensions import import_deepspeed

os.environ.setdefault("DS_ACCELERATOR", "cpu")
ds_moe = import_deepspeed("deepspeed.moe.sharded_moe")
ds_layer = import_deepspeed("deepspeed.moe.layer")

from zerospeed.moe import sharded_moe as zs_moe  # noqa: E402
from zerospeed.moe.layer import MoE  # noqa: E402

pytestmark = pytest.mark.compat
SHAPES = [(16, 4), (13, 3), (40, 8)]  # (tokens, experts); 13 / 3 * factor exercises float32 rounding
FACTORS = [0.5, 1.0, 1.7]


def _assert_same(ours: tuple, theirs: tuple, what: str) -> None:
    assert len(ours) == len(theirs), what
    for index, (a, b) in enumerate(zip(ours, theirs)):
        a, b = torch.as_tensor(a), torch.as_tensor(b)
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what} output {index}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        assert torch.equal(a, b), f"{what} output {index} differs:\n{a}\n{b}"


def _both(fn_name: str, logits: torch.Tensor, *args: object) -> tuple[tuple, tuple]:
    torch.manual_seed(5)
    theirs = getattr(ds_moe, fn_name)(logits.clone(), *args)
    torch.manual_seed(5)
    ours = getattr(zs_moe, fn_name)(logits.clone(), *args)
    return ours, theirs


@pytest.mark.parametrize("tokens,experts", SHAPES)
def test_gating_functions_equal_deepspeed(tokens: int, experts: int) -> None:
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(tokens))
    for sparse, drop, factor in itertools.product((False, True), (True, False), FACTORS):
        for rts in (True, False):
            _assert_same(*_both("top1gating", logits, factor, 2, None, None, drop, rts, None, sparse),
                         f"top1 rts={rts} drop={drop} cf={factor} sparse={sparse}")
        _assert_same(*_both("top1gating", logits, factor, 2, None, "RSample", drop, True, None, sparse),
                     f"top1 RSample drop={drop} cf={factor} sparse={sparse}")
        for sampling in (True, False):
            _assert_same(*_both("top2gating", logits, factor, 2, drop, None, sampling, sparse),
                         f"top2 sampling={sampling} drop={drop} cf={factor} sparse={sparse}")
        for k, policy in itertools.product(range(1, experts + 1), ("probs", "position")):
            _assert_same(*_both("topkgating", logits, k, factor, 2, drop, None, policy, sparse),
                         f"top{k} policy={policy} drop={drop} cf={factor} sparse={sparse}")


def _gradients(module: torch.nn.Module, x: torch.Tensor, seed: int) -> tuple[tuple, torch.Tensor, dict]:
    x = x.clone().requires_grad_(True)
    torch.manual_seed(seed)
    output, l_aux, exp_counts = module(x)
    (output.square().sum() + l_aux).backward()
    return (output, l_aux, exp_counts), x.grad, {n: p.grad for n, p in module.named_parameters()}


@pytest.mark.parametrize("k,use_residual,noisy", [(1, False, None), (1, True, "Jitter"), (1, False, "RSample"),
                                                  (2, False, None), (2, True, None), (3, False, None)])
def test_moe_layer_equals_deepspeed(k: int, use_residual: bool, noisy: str | None) -> None:
    """Same state dict, input and seed: equal output, l_aux, exp_counts and every gradient."""
    torch.manual_seed(0)
    expert = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    kwargs = dict(num_experts=4, k=k, use_residual=use_residual, min_capacity=2, capacity_factor=0.8,
                  noisy_gate_policy=noisy)
    theirs = ds_layer.MoE(8, expert, **kwargs)
    ours = MoE(8, expert, **kwargs)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 12, 8, generator=torch.Generator().manual_seed(1))
    out_ours, grad_ours, params_ours = _gradients(ours, x, seed=3)
    out_theirs, grad_theirs, params_theirs = _gradients(theirs, x, seed=3)
    _assert_same(out_ours, out_theirs, "layer outputs")
    assert torch.equal(grad_ours, grad_theirs), "input gradient"
    for name, grad in params_theirs.items():
        assert torch.equal(params_ours[name], grad), f"gradient of {name}"


# --- training and checkpoints side by side (compat_harness: fresh processes per library) -------

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "moe_train.py")


def _same_params(ours: dict, theirs: dict, rtol: float, what: str) -> None:
    assert ours.keys() == theirs.keys(), what
    for name, value in theirs.items():
        torch.testing.assert_close(torch.tensor(ours[name]), torch.tensor(value), rtol=rtol, atol=rtol,
                                   msg=lambda m, name=name: f"{what} {name}: {m}")


STAGES = (0, 1, 2)


def test_moe_training_and_checkpoints_cross_with_deepspeed(tmp_path) -> None:
    """fp32, ep_size 2 on 2 ranks, ZeRO 0, 1 and 2 (one engine after the other in the same two launches
    per library): equal losses and parameters; then each library loads the other's checkpoint (experts
    per global id; at stage 0 the per-ep-rank optimizer files, at 1/2 the ZeRO partitions, whose expert
    groups are partitioned over the expert-data-parallel group) and both resume alike. zero_to_fp32 of
    each library's checkpoint is the whole trained model, experts included."""
    from compat_harness import run_both

    # SGD with momentum, not Adam: Adam's update hides a wrongly scaled gradient; the momentum is the
    # optimizer state that must cross.
    trained = run_both(SCRIPT, str(tmp_path / "train"), steps=3, optimizer="SGD", stages=STAGES)
    for stage in map(str, STAGES):
        for rank, (theirs, ours) in enumerate(zip(trained["deepspeed"], trained["zerospeed"])):
            torch.testing.assert_close(torch.tensor(ours[stage]["losses"]), torch.tensor(theirs[stage]["losses"]),
                                       rtol=1e-5, atol=0)
            _same_params(ours[stage]["params"], theirs[stage]["params"], 1e-5, f"stage {stage} rank {rank} trained")
    _check_zero_to_fp32(tmp_path / "train", trained)
    crossed = {"deepspeed": str(tmp_path / "train" / "zerospeed"), "zerospeed": str(tmp_path / "train" / "deepspeed")}
    resumed = run_both(SCRIPT, str(tmp_path / "resume"), steps=2, load_from=crossed, optimizer="SGD", stages=STAGES)
    for stage in map(str, STAGES):
        for rank in range(2):
            for impl, other in (("deepspeed", "zerospeed"), ("zerospeed", "deepspeed")):
                # Bit for bit: the loaded weights are exactly what the other library saved.
                assert resumed[impl][rank][stage]["loaded"] == trained[other][rank][stage]["params"], \
                    f"stage {stage}: {impl} loading {other}'s"
            theirs, ours = resumed["deepspeed"][rank][stage], resumed["zerospeed"][rank][stage]
            torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]), rtol=1e-5, atol=0)
            _same_params(ours["params"], theirs["params"], 1e-5, f"stage {stage} rank {rank} resumed")


def _check_zero_to_fp32(root, trained: dict) -> None:
    """Our zero_to_fp32 on either library's MoE checkpoint gives every trained parameter exactly
    (fp32 training: the masters are the weights), experts from their per-expert files."""
    from zerospeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    for impl in ("deepspeed", "zerospeed"):
        for stage in map(str, STAGES):
            expected = {f"net.{name}": values for rank in (0, 1) for name, values in
                        trained[impl][rank][stage]["params"].items()}
            state = get_fp32_state_dict_from_zero_checkpoint(str(root / impl / f"ckpt_s{stage}"))
            order = ["inp.", "moe.deepspeed_moe.gate.", *(f"deepspeed_experts.{e}." for e in range(4)), "head."]
            assert [next(i for i, part in enumerate(order) if part in name) for name in state] == sorted(
                next(i for i, part in enumerate(order) if part in name) for name in state), list(state)
            assert sorted(state) == sorted(expected), f"zero_to_fp32 of {impl}'s stage-{stage} checkpoint"
            for name, values in expected.items():
                assert state[name].dtype == torch.float32
                assert state[name].flatten().double().tolist() == values, f"{impl} stage {stage}: {name}"
