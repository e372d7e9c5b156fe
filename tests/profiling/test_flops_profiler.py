"""The flops profiler against hand-derived counts: exact for Linear / MLP / conv, 1% for a GPT-2 block."""

from __future__ import annotations

import pytest
import torch

from zerospeed.profiling.flops_profiler import FlopsProfiler, get_model_profile, training_step_flops


def test_linear_exact():
    batch, d_in, d_out = 4, 32, 16
    flops, macs, params = get_model_profile(torch.nn.Linear(d_in, d_out), input_shape=(batch, d_in),
                                            print_profile=False, as_string=False)
    assert macs == batch * d_in * d_out
    assert flops == 2 * macs  # the bias add inside addmm is not counted
    assert params == d_in * d_out + d_out


def test_mlp_exact_per_module():
    tokens, d, hidden = 8, 16, 64
    model = torch.nn.Sequential(torch.nn.Linear(d, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, d))
    profiler = FlopsProfiler(model)
    profiler.start_profile()
    model(torch.randn(tokens, d))
    profiler.stop_profile()
    by_name = profiler.module_profiles()
    assert by_name["0"].macs == by_name["2"].macs == tokens * d * hidden
    assert by_name["1"].flops == tokens * hidden and by_name["1"].macs == 0  # one FLOP per ReLU output
    assert profiler.get_total_macs() == 2 * tokens * d * hidden
    assert profiler.get_total_flops() == 4 * tokens * d * hidden + tokens * hidden
    assert profiler.get_total_params() == sum(p.numel() for p in model.parameters())
    assert profiler.get_total_duration() > 0.0
    profiler.end_profile()


def test_conv_exact():
    conv = torch.nn.Conv2d(3, 8, kernel_size=3, bias=False)
    _, macs, _ = get_model_profile(conv, input_shape=(2, 3, 16, 16), print_profile=False, as_string=False)
    assert macs == 2 * 8 * 14 * 14 * 3 * 3 * 3


def test_backward_and_outside_ops_are_not_counted():
    model = torch.nn.Linear(8, 8)
    profiler = FlopsProfiler(model)
    profiler.start_profile()
    x = torch.randn(4, 8)
    loss = (model(x) @ torch.randn(8, 8)).sum()  # outside the module: not counted
    loss.backward()
    profiler.stop_profile()
    assert profiler.get_total_macs() == 4 * 8 * 8


def test_ignore_modules():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    _, macs, _ = get_model_profile(model, input_shape=(2, 8), print_profile=False, as_string=False,
                                   ignore_modules=[torch.nn.ReLU])
    assert macs == 2 * 8 * 8 + 2 * 8 * 4


def _gpt2_block(d_model: int, num_heads: int, seq_len: int, attn_implementation: str) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    config = transformers.GPT2Config(n_embd=d_model, n_head=num_heads, n_layer=1, n_positions=seq_len,
                                     resid_pdrop=0.0, attn_pdrop=0.0, embd_pdrop=0.0)
    config._attn_implementation = attn_implementation
    return GPT2Block(config).eval()


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_gpt2_block_matches_analytic_count(attn_implementation):
    """[Derivation] one block, b sequences of t tokens, width d (bias-free weights 12 d^2):
    the four projections (qkv d->3d, out d->d, fc d->4d, proj 4d->d) are b t 12 d^2 MACs, i.e.
    2 x weight params x tokens FLOPs; attention scores Q K^T and the weighted sum P V are
    b t^2 d MACs each (summed over heads), so 4 b t^2 d FLOPs. Softmax, GELU, layer norms and
    residual adds are O(b t d) and stay under 0.5% at d=512."""
    d_model, num_heads, seq_len, batch = 512, 8, 64, 1
    block = _gpt2_block(d_model, num_heads, seq_len, attn_implementation)
    flops, macs, params = get_model_profile(block, args=[torch.randn(batch, seq_len, d_model)],
                                            print_profile=False, as_string=False)
    weight_params = 12 * d_model * d_model
    tokens = batch * seq_len
    analytic_flops = 2 * weight_params * tokens + 4 * batch * seq_len * seq_len * d_model
    assert macs == analytic_flops // 2  # every multiply-accumulate, exactly
    assert flops == pytest.approx(analytic_flops, rel=0.01)
    assert params == sum(p.numel() for p in block.parameters())


def test_printed_tree(tmp_path, capsys):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Sequential(torch.nn.GELU(), torch.nn.Linear(16, 2)))
    flops, macs, params = get_model_profile(model, input_shape=(4, 8), module_depth=-1, top_modules=2)
    text = capsys.readouterr().out
    assert (flops, macs, params) == ("1.34 KFLOPS", "640.00 MACs", "178.00")  # 2 x 640 + 64 GELU outputs
    assert "fwd flops per device:" in text and "fwd latency:" in text
    assert "Top 2 modules in terms of params, MACs or fwd latency" in text
    tree = text.split("detailed profile per device")[1]
    assert "\nSequential(178.00 = 100.00% Params, 640.00 MACs = 100.00% MACs" in tree
    assert "\n  (0): Linear(144.00 = 80.90% Params, 512.00 MACs = 80.00% MACs" in tree
    assert "\n    (1): Linear(34.00 = 19.10% Params, 128.00 MACs = 20.00% MACs" in tree
    shallow = tmp_path / "profile.txt"
    get_model_profile(model, input_shape=(4, 8), module_depth=1, output_file=str(shallow))
    assert "(1): Linear" not in shallow.read_text() and "(1): Sequential" in shallow.read_text()


def test_training_step_flops_and_achieved_rate():
    model = torch.nn.Linear(8, 8)
    profiler = FlopsProfiler(model, recompute_fwd_factor=1.0)
    profiler.start_profile()
    model(torch.randn(2, 8))
    profiler.stop_profile()
    assert training_step_flops(100.0) == 300.0
    text = profiler.format_model_profile(step_latency_s=1e-3)
    fwd = 2 * 2 * 8 * 8
    assert "achieved FLOPS per device = fwd+bwd flops / step latency:" in text
    assert f"{4 * fwd / 1e-3 / 1e6:.2f} MFLOPS" in text  # (3 + recompute) x fwd in 1 ms
