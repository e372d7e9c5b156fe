"""No compiler: a warning and the torch implementation. `zerospeed-report` lists every op."""

import subprocess
import sys

import pytest
import torch

import zerospeed.ops.cpu_optimizer as cpu_optimizer
from zerospeed import env_report
from zerospeed.ops.adam import DeepSpeedCPUAdam
from zerospeed.ops.op_builder import ALL_OPS


def test_without_a_compiler_the_optimizer_warns_and_falls_back(monkeypatch, tmp_path):
    monkeypatch.setenv("ZS_EXTENSIONS_DIR", str(tmp_path))  # empty: nothing prebuilt to find
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setattr(cpu_optimizer, "_warned_ops", set())
    param = torch.nn.Parameter(torch.randn(7))
    reference = torch.nn.Parameter(param.detach().clone())
    with pytest.warns(RuntimeWarning, match="cpu_adam op is unavailable.*no C\\+\\+ compiler"):
        optimizer = DeepSpeedCPUAdam([param], weight_decay=0.1)
    assert not optimizer.uses_native_kernels
    torch_optimizer = torch.optim.AdamW([reference], lr=1e-3, weight_decay=0.1)
    for _ in range(3):
        param.grad = torch.ones(7)
        reference.grad = torch.ones(7)
        optimizer.step()
        torch_optimizer.step()
    assert torch.equal(param.detach(), reference.detach())


def test_report_lists_every_op_with_its_status(built_ops, capsys):
    assert env_report.main([]) == 0
    output = capsys.readouterr().out
    assert "op name ................ installed .. compatible" in output
    for name in ALL_OPS:
        line = next(line for line in output.splitlines() if line.startswith(name + " "))
        assert "[YES]" in line and line.endswith("[OKAY]"), line
    for key in ("torch version", "torch install path", "C++ compiler", "ninja", "accelerator", "SIMD level"):
        assert key in output


def test_report_shows_incompatibility_reason(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("ZS_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    env_report.main(["--hide_errors_and_warnings"])
    hidden = capsys.readouterr().out
    assert "cpu_adam ............... [NO] ....... [NO]" in hidden and "[WARNING]" not in hidden
    env_report.main([])
    assert "[WARNING] cpu_adam: no C++ compiler" in capsys.readouterr().out


def test_report_runs_as_a_module():
    result = subprocess.run([sys.executable, "-m", "zerospeed.env_report", "--hide_operator_status"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "zerospeed general environment info:" in result.stdout
