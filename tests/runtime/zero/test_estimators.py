"""Estimators against their formulas: DeepSpeed's tables (`deepspeed/runtime/zero/
stage_1_and_2.py::estimate_zero2_model_states_mem_needs`, `stage3.py::estimate_zero3_model_states_mem_needs`) and our per-rank model."""

from __future__ import annotations

import pytest
import torch

from zerospeed.runtime.zero import estimators as est
from zerospeed.runtime.zero.estimate_cli import main as estimate_main

GIB = 2**30


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(100, 16)       # 1600, the largest layer
        self.hidden = torch.nn.Linear(16, 16)          # 272
        self.head = torch.nn.Linear(16, 100, bias=False)
        self.head.weight = self.embed.weight           # shared: counted once


def test_model_to_params_counts_shared_once():
    assert est.model_to_params(_Tied()) == (1600 + 272, 1600)


@pytest.mark.parametrize("P,g,n", [(10**9, 8, 2), (12345, 1, 1), (7 * 10**6, 4, 1)])
def test_deepspeed_zero2_formulas(P, g, n):
    G = g * n
    assert est.estimate_zero2_model_states_mem_needs(P, g, n, cpu_offload=True) == (int(P * max(4 * G, 16) * 1.5), 2 * P)
    assert est.estimate_zero2_model_states_mem_needs(P, g, n, cpu_offload=False) == \
        (int(4 * P * g * 1.5), 2 * P + int(18 * P / G))


@pytest.mark.parametrize("P,L,g,n", [(10**9, 5 * 10**7, 8, 2), (54321, 999, 2, 1)])
def test_deepspeed_zero3_formulas(P, L, g, n):
    G, f = g * n, 1.5
    expected = {  # (offload_optimizer, offload_param, zero_init): (cpu, gpu)
        (True, True, True): (P * 18 / n * f, 4 * L),
        (True, True, False): (P * max(4 * g, 18 / n) * f, 4 * L),
        (True, False, True): (P * 16 / n * f, 4 * L + int(2 * P / G)),
        (True, False, False): (P * max(4 * g, 16 / n) * f, 4 * L + int(2 * P / G)),
        (False, False, True): (4 * L * g * f, 4 * L + int(18 * P / G)),
        (False, False, False): (4 * P * g * f, 4 * L + int(18 * P / G)),
    }
    for (opt, param, zero_init), (cpu, gpu) in expected.items():
        assert est.estimate_zero3_model_states_mem_needs(P, L, g, n, opt, param, zero_init) == (int(cpu), gpu, 4 * L)


def test_zero2_table(capsys):
    est.estimate_zero2_model_states_mem_needs_all_cold(10**9, num_gpus_per_node=8, num_nodes=2)
    lines = capsys.readouterr().out.splitlines()
    assert lines[:4] == ["Estimated memory needed for params, optim states and gradients for a:",
                         "HW: Setup with 2 nodes, 8 GPUs per node.", "SW: Model with 1000M total params.",
                         "  per CPU  |  per GPU |   Options"]
    cpu, gpu = est.estimate_zero2_model_states_mem_needs(10**9, 8, 2, cpu_offload=True)
    assert lines[4] == f" {cpu / GIB:7.2f}GB | {gpu / GIB:6.2f}GB | offload_optimizer=cpu "
    assert lines[5].endswith("| offload_optimizer=none") and len(lines) == 6


def test_zero3_table_from_live_model(capsys):
    est.estimate_zero3_model_states_mem_needs_all_live(_Tied())
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "HW: Setup with 1 node, 1 GPU per node."
    assert lines[2] == "SW: Model with 0M total params, 0M largest layer params."
    options = [line.split(" | ")[2] for line in lines[4:]]
    assert options == [
        "offload_param=cpu , offload_optimizer=cpu , zero_init=1",
        "offload_param=cpu , offload_optimizer=cpu , zero_init=0",
        "offload_param=none, offload_optimizer=cpu , zero_init=1",
        "offload_param=none, offload_optimizer=cpu , zero_init=0",
        "offload_param=none, offload_optimizer=none, zero_init=1",
        "offload_param=none, offload_optimizer=none, zero_init=0",
    ]


@pytest.mark.parametrize("stage,theory", [(0, 16.0), (1, 8 + 8 / 4), (2, 4 + 12 / 4), (3, 16 / 4)])
def test_fp32_adam_matches_textbook(stage, theory):
    psi, world_size = 8 * 1000, 4  # a multiple of alignment x N: no padding
    estimate = est.estimate_model_states_bytes(psi, world_size, stage, "fp32")
    assert estimate.total == theory * psi
    assert estimate.master_params == 0  # the fp32 partition is the master copy


def test_bf16_stage2_matches_deepspeed_gpu_formula():
    psi, world_size = 2 * 10**6, 4
    estimate = est.estimate_model_states_bytes(psi, world_size, 2, "bf16")
    assert estimate.as_dict() == {"lp_params": 2 * psi, "grads": (2 + 4) * psi // 4, "master_params": 4 * psi // 4,
                                  "optimizer_states": 8 * psi // 4, "total": 2 * psi + 18 * psi // 4}
    assert estimate.total == est.estimate_zero2_model_states_mem_needs(psi, world_size, cpu_offload=False)[1]


def test_padding():
    # stage 1/2: the flat buffer rounds up to alignment x N = 8 elements -> 13 becomes 16, 4 per rank
    stage2 = est.estimate_model_states_bytes(13, 4, 2, "fp32")
    assert (stage2.lp_params, stage2.grads, stage2.optimizer_states) == (16 * 4, 4 * 4, 8 * 4)
    # stage 3: each parameter is padded on its own: ceil(5/4) + ceil(3/4) = 3 elements per rank
    stage3 = est.estimate_model_states_bytes(8, 4, 3, "fp32", param_numels=[5, 3])
    assert stage3.lp_params == 3 * 4


def test_offload_moves_states_to_host():
    psi, world_size = 4000, 2
    estimate = est.estimate_model_states_bytes(psi, world_size, 3, "bf16", offload_optimizer="cpu",
                                               offload_param="cpu")
    device, host = estimate.by_location["device"], estimate.by_location["cpu"]
    assert device == {"lp_params": 0, "grads": 2 * psi // 2, "master_params": 0, "optimizer_states": 0}
    assert host == {"lp_params": 2 * psi // 2, "grads": 4 * psi // 2, "master_params": 4 * psi // 2,
                    "optimizer_states": 8 * psi // 2}
    with pytest.raises(ValueError, match="offload_param needs stage 3"):
        est.estimate_model_states_bytes(psi, world_size, 2, offload_param="cpu")
    with pytest.raises(ValueError, match="dtype must be one of"):
        est.estimate_model_states_bytes(psi, world_size, 2, dtype="int8")


def test_cli_params(capsys):
    assert estimate_main(["--params", "1e6", "--num_gpus", "2", "--dtype", "fp32", "--deepspeed-tables"]) == 0
    out = capsys.readouterr().out
    rows = {tuple(cell.strip() for cell in line.split("|")[:3]): line for line in out.splitlines()
            if line.strip()[:1].isdigit() and line.count("|") == 5}
    stage1 = est.estimate_model_states_bytes(10**6, 2, 1, "fp32").total
    assert f"{stage1 / GIB:>9.2f}GB" in rows[("1", "none", "none")]
    assert len(rows) == 8 and "SW: Model with 1M total params, 0M largest layer params." in out


def test_cli_hf_config(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=32, n_head=2, n_layer=2, n_positions=16, vocab_size=100)
    config.save_pretrained(tmp_path)
    expected = sum(p.numel() for p in transformers.GPT2LMHeadModel(config).parameters())  # tied head once
    estimate_main(["--hf-config", str(tmp_path), "--dtype", "bf16"])
    assert f"{expected / 1e6:.1f}M params" in capsys.readouterr().out
