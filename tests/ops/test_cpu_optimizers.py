"""Fused CPU optimizers against torch's optimizers and independently written update rules.

50 steps on parameters of odd sizes (not multiples of any SIMD width), with weight decay and
bias correction on and off. Tolerance: |ours - ref| <= 1e-6 * (|ref| + 1). The two differ by at
most an ulp or two, not bit for bit, because torch's vectorised fp32 sqrt is not correctly rounded
(about 1 in 5 results is 1 ulp off); the kernels use the hardware's exact sqrt.
"""

import math

import pytest
import torch

from zerospeed.ops import torch_fallback
from zerospeed.ops.adagrad import DeepSpeedCPUAdagrad
from zerospeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from zerospeed.ops.lion import DeepSpeedCPULion

SIZES = (1, 7, 1023, 4099)
NUM_STEPS = 50


def _params(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=generator) for n in SIZES]


def _grads(step):
    generator = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(n, generator=generator) for n in SIZES]


def _assert_close(ours, ref):
    for a, b in zip(ours, ref):
        assert torch.all((a - b).abs() <= 1e-6 * (b.abs() + 1)), (a - b).abs().max()


def _run(optimizer, params, step_kwargs=None):
    for step in range(1, NUM_STEPS + 1):
        for p, g in zip(params, _grads(step)):
            p.grad = g.clone()
        optimizer.step(**(step_kwargs(step) if step_kwargs else {}))
    return [p.detach() for p in params]


def _reference_adam_no_bias_correction(params, lr, betas, eps, weight_decay, adamw_mode):
    """Adam without bias correction (torch has no switch for it), in fp32 with torch's op order."""
    params = [p.clone() for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for step in range(1, NUM_STEPS + 1):
        for i, g in enumerate(_grads(step)):
            if weight_decay and not adamw_mode:
                g = g.add(params[i], alpha=weight_decay)
            if weight_decay and adamw_mode:
                params[i] = params[i] * (1 - lr * weight_decay)
            m[i] = m[i].lerp(g, 1 - betas[0])
            v[i] = (v[i] * betas[1]).addcmul(g, g, value=1 - betas[1])
            params[i] = params[i].addcdiv(m[i], v[i].sqrt() + eps, value=-lr)
    return params


def _reference_lion(params, lr, betas, weight_decay):
    """Lion (Chen et al. 2023), from the paper's update rule."""
    params = [p.clone() for p in params]
    m = [torch.zeros_like(p) for p in params]
    for step in range(1, NUM_STEPS + 1):
        for i, g in enumerate(_grads(step)):
            update = (m[i] * betas[0]).add(g, alpha=1 - betas[0]).sign()
            params[i] = (params[i] * (1 - lr * weight_decay)).add(update, alpha=-lr)
            m[i] = (m[i] * betas[1]).add(g, alpha=1 - betas[1])
    return params


@pytest.fixture(params=["native", "fallback"])
def kernels(request, monkeypatch):
    """Run each parity test on the C++ kernels and on the torch fallback. Only the native variant
    needs the built ops (and skips without a compiler); the fallback runs everywhere."""
    if request.param == "native":
        request.getfixturevalue("built_ops")
    else:
        import zerospeed.ops.cpu_optimizer as cpu_optimizer

        monkeypatch.setattr(cpu_optimizer, "load_kernels", lambda builder: (torch_fallback, False))
    return request.param


@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_cpu_adam_matches_reference(kernels, adamw_mode, weight_decay, bias_correction):
    lr, betas, eps = 1e-2, (0.9, 0.999), 1e-8
    ours = [p.requires_grad_() for p in _params()]
    optimizer = DeepSpeedCPUAdam(ours, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                 bias_correction=bias_correction, adamw_mode=adamw_mode)
    assert optimizer.uses_native_kernels == (kernels == "native")
    result = _run(optimizer, ours)
    if bias_correction:
        ref_params = [p.requires_grad_() for p in _params()]
        torch_class = torch.optim.AdamW if adamw_mode else torch.optim.Adam
        expected = _run(torch_class(ref_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay),
                        ref_params)
    else:
        expected = _reference_adam_no_bias_correction(_params(), lr, betas, eps, weight_decay, adamw_mode)
    _assert_close(result, expected)
    state = optimizer.state[ours[0]]
    assert state["step"] == NUM_STEPS and set(state) == {"step", "exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_cpu_adagrad_matches_torch(kernels, weight_decay):
    ours = [p.requires_grad_() for p in _params()]
    result = _run(DeepSpeedCPUAdagrad(ours, lr=1e-2, eps=1e-10, weight_decay=weight_decay), ours)
    ref_params = [p.requires_grad_() for p in _params()]
    expected = _run(torch.optim.Adagrad(ref_params, lr=1e-2, eps=1e-10, weight_decay=weight_decay), ref_params)
    _assert_close(result, expected)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_cpu_lion_matches_update_rule(kernels, weight_decay):
    ours = [p.requires_grad_() for p in _params()]
    result = _run(DeepSpeedCPULion(ours, lr=1e-3, betas=(0.9, 0.99), weight_decay=weight_decay), ours)
    _assert_close(result, _reference_lion(_params(), 1e-3, (0.9, 0.99), weight_decay))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("optimizer_class", [DeepSpeedCPUAdam, DeepSpeedCPUAdagrad, DeepSpeedCPULion])
def test_copy_out_equals_casting_the_fp32_result(kernels, optimizer_class, dtype):
    params = [p.requires_grad_() for p in _params()]
    copies = [torch.empty(p.shape, dtype=dtype) for p in params]
    optimizer = optimizer_class(params, weight_decay=0.01)
    _run(optimizer, params, step_kwargs=lambda step: {"fp16_param_groups": [copies]})
    for p, copy in zip(params, copies):
        assert torch.equal(copy, p.detach().to(dtype))


def test_threads_do_not_change_results(built_ops):
    numel = 300_001  # several 64K-element chunks per thread
    results = []
    for num_threads in (1, 2):
        saved = torch.get_num_threads()
        torch.set_num_threads(num_threads)
        try:
            param = torch.nn.Parameter(torch.linspace(-1, 1, numel))
            optimizer = DeepSpeedCPUAdam([param], weight_decay=0.1)
            for step in range(3):
                param.grad = torch.sin(torch.arange(numel, dtype=torch.float32) * (step + 1))
                optimizer.step()
            results.append(param.detach().clone())
        finally:
            torch.set_num_threads(saved)
    assert torch.equal(results[0], results[1])


def test_low_precision_params_take_the_fp32_math(built_ops):
    param = torch.nn.Parameter(torch.randn(1023).bfloat16())
    reference = torch.nn.Parameter(param.detach().float().clone())
    optimizer = DeepSpeedCPUAdam([param], fp32_optimizer_states=False)
    fp32_optimizer = DeepSpeedCPUAdam([reference])
    grad = torch.randn(1023)
    param.grad, reference.grad = grad.bfloat16(), grad.bfloat16().float()
    optimizer.step()
    fp32_optimizer.step()
    assert optimizer.state[param]["exp_avg"].dtype == torch.bfloat16
    assert torch.equal(param.detach(), reference.detach().bfloat16())


def test_user_errors():
    with pytest.raises(ValueError, match="amsgrad"):
        DeepSpeedCPUAdam([torch.nn.Parameter(torch.ones(2))], amsgrad=True)
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    optimizer = DeepSpeedCPULion([param])
    with pytest.raises(ValueError, match="fp16_param_groups"):
        optimizer.step(fp16_param_groups=[[]])


def test_closure_and_missing_grads(built_ops):
    used, unused = torch.nn.Parameter(torch.ones(5)), torch.nn.Parameter(torch.ones(5))
    optimizer = DeepSpeedCPUAdam([used, unused], lr=0.1)

    def closure():
        loss = (used * 2).sum()
        loss.backward()
        return loss

    assert optimizer.step(closure).item() == 10.0
    assert torch.all(used < 1) and torch.equal(unused.detach(), torch.ones(5))
    assert not optimizer.state[unused]


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fused_adam_is_torch_fused_adam(adam_w_mode):
    ours = [p.requires_grad_() for p in _params()]
    ref_params = [p.requires_grad_() for p in _params()]
    result = _run(FusedAdam(ours, lr=1e-2, weight_decay=0.1, adam_w_mode=adam_w_mode), ours)
    torch_class = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    expected = _run(torch_class(ref_params, lr=1e-2, weight_decay=0.1, fused=True), ref_params)
    for a, b in zip(result, expected):
        assert torch.equal(a, b)
    assert math.isclose(FusedAdam(ours).defaults["lr"], 1e-3)
