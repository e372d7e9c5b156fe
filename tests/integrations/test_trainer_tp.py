"""transformers `Trainer` with AutoTP (`"tensor_parallel": {"autotp_size": 2}` in the ds_config)
through the `deepspeed` alias: transformers calls `deepspeed.tp_model_init`, accelerate builds its
tp device mesh (both ranks get the same batches) and zerospeed's `initialize` shards the model.

The unmodified run_clm-style script (scripts/run_clm.py), ZeRO-2, gradient accumulation, clipping,
a WarmupDecayLR schedule, on 2 gloo ranks at tp 2 (dp 1). Losses, gradient norms and learning
rates equal the same model trained without TP (zerospeed on one rank: the same global batch) to
fp32 rounding, and real DeepSpeed 0.19.8's AutoTP run of the same script; the saved
`model.safetensors` holds the full (unsharded) weights, equal to the untouched run's.
"""

import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from client_runs import make_assets, run
from test_trainer import REFERENCE, ds_config, history, script_args, torchrun, zerospeed_launcher

pytestmark = pytest.mark.timeout(1200)
TP = 2


def _config(root: str, tp: int) -> str:
    config = ds_config(2)
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True   # accelerate's TP save
    if tp > 1:
        config["tensor_parallel"] = {"autotp_size": tp}
    path = os.path.join(root, f"ds_tp{tp}.json")
    with open(path, "w") as handle:
        json.dump(config, handle)
    return path


def _even_vocab_model(source: str, target: str) -> str:
    """The assets' Llama with its vocabulary padded from 93 to 96 rows: the output head is split by
    vocabulary, and zerospeed's AutoTP needs even splits (docs/compatibility.md)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(source)
    model.resize_token_embeddings(96, mean_resizing=False)
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(source).save_pretrained(target)
    return target


@pytest.fixture(scope="module")
def runs(alias_dir, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("trainer_tp"))
    assets = make_assets(root)
    model = ["--model_name_or_path", _even_vocab_model(assets["model"], os.path.join(root, "tiny-llama-96"))]
    out = {side: os.path.join(root, side) for side in ("zs_tp", "zs_plain", "ds_tp")}
    tp_args = script_args(assets, _config(root, TP), out["zs_tp"], model)
    plain = zerospeed_launcher(alias_dir, script_args(assets, _config(root, 1), out["zs_plain"], model))
    plain[plain.index("--num_gpus") + 1] = "1"
    jobs = [(zerospeed_launcher(alias_dir, tp_args), alias_dir), (plain, alias_dir),
            (torchrun(script_args(assets, _config(root, TP), out["ds_tp"], model)), None)]
    with ThreadPoolExecutor(2) as pool:
        for future in [pool.submit(run, cmd, alias, root) for cmd, alias in jobs]:
            future.result()
    assert REFERENCE in jobs[2][0]
    return out


def _assert_history(theirs: list[dict], ours: list[dict], rel: float, what: str) -> None:
    assert [e["step"] for e in theirs] == [e["step"] for e in ours] and len(ours) == 4, what
    for a, b in zip(theirs, ours):
        for key in ("loss", "grad_norm", "learning_rate"):
            assert b[key] == pytest.approx(a[key], rel=rel, abs=1e-7), f"{what} step {a['step']} {key}"


def test_trainer_autotp_equals_training_without_tp(runs):
    ours = history(runs["zs_tp"])
    _assert_history(history(runs["zs_plain"]), ours, 1e-5, "tp 2 vs no TP")
    _assert_history(history(runs["ds_tp"]), ours, 1e-5, "tp 2 vs DeepSpeed's tp 2")
    assert ours[-1]["loss"] != ours[0]["loss"]


def test_trainer_autotp_saves_the_full_model(runs):
    from safetensors.torch import load_file

    plain = load_file(os.path.join(runs["zs_plain"], "model.safetensors"))
    for side in ("zs_tp", "ds_tp"):
        saved = load_file(os.path.join(runs[side], "model.safetensors"))
        assert sorted(saved) == sorted(plain), side
        for name, tensor in plain.items():
            torch.testing.assert_close(saved[name], tensor, rtol=1e-5, atol=1e-6, msg=f"{side} {name}")
