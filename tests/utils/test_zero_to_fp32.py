"""zero_to_fp32 output equals the gathered full fp32 parameters, for every output flag."""

import json
import os
import subprocess
import sys

import pytest
import torch

import zerospeed
from distributed import run_on_ranks
from zerospeed.utils import zero_to_fp32 as z

PRECISION = {"fp32": {}, "bf16": {"bf16": {"enabled": True}}}


class TiedModel(torch.nn.Module):
    """Tied embedding / head, a frozen layer, persistent and non-persistent buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 8)
        self.frozen = torch.nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.mix = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 11, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor([0.5, 2.0]))
        self.register_buffer("calls", torch.tensor(3, dtype=torch.int64))
        self.register_buffer("scratch", torch.zeros(4), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.mix(self.frozen(self.embed(tokens)))) * self.scale[0].to(self.mix.weight.dtype)
        logits = self.head(hidden).float()
        return torch.nn.functional.cross_entropy(logits.view(-1, 11), tokens.view(-1))


def gathered_fp32(engine):
    """The full fp32 masters, gathered from the wrapper independently of the checkpoint code."""
    wrapper, names = engine.optimizer, engine.param_names
    if hasattr(wrapper, "bit16_groups"):
        full = {}
        world_size = torch.distributed.get_world_size()
        for params, master, _padding in zip(wrapper.bit16_groups, wrapper.single_partition_of_fp32_groups,
                                           wrapper.groups_padding):
            flat = torch.empty(master.numel() * world_size)
            torch.distributed.all_gather_into_tensor(flat, master.detach().contiguous())
            offset = 0
            for p in params:
                full[names[p]] = flat[offset:offset + p.numel()].view(p.shape).clone()
                offset += p.numel()
        return full
    if any(hasattr(p, "ds_id") for p in engine.module.parameters()):  # stage 3: partitioned masters
        return {n: zerospeed.utils.safe_get_full_fp32_param(p).clone()
                for n, p in engine.module.named_parameters() if p.requires_grad}
    if hasattr(wrapper, "params_and_masters") and wrapper.precision.low_precision:
        return {names[p]: m.detach().clone() for p, m in wrapper.params_and_masters()}
    return {n: p.detach().float().clone() for n, p in engine.module.named_parameters() if p.requires_grad}


def _train_and_save(stage, dtype, save_dir, threshold=None):
    torch.manual_seed(0)
    zero = {"stage": stage, **({} if threshold is None else {"stage3_param_persistence_threshold": threshold})}
    config = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": zero, **PRECISION[dtype]}
    engine, _, _, _ = zerospeed.initialize(model=TiedModel(), config=config)
    for step in range(2):
        tokens = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(step + torch.distributed.get_rank()))
        engine.backward(engine(tokens))
        engine.step()
    engine.save_checkpoint(save_dir)
    full = gathered_fp32(engine)
    frozen_params = {n: p for n, p in engine.module.named_parameters() if not p.requires_grad}
    with zerospeed.zero.GatheredParameters(list(frozen_params.values()), enabled=stage == 3):
        frozen = {n: p.detach().float().clone() for n, p in frozen_params.items()}
    partitioned = sum(1 for p in engine.module.parameters() if hasattr(p, "ds_id") and p.numel() == 0)
    return full, frozen, partitioned


def _check(state, full, frozen, exclude_frozen=False, tied=True):
    for name, tensor in full.items():
        assert state[name].dtype == torch.float32 and torch.equal(state[name], tensor), name
    for name, tensor in frozen.items():
        assert (name in state) == (not exclude_frozen), name
        if not exclude_frozen:
            assert torch.equal(state[name], tensor), name
    if tied:
        assert torch.equal(state["head.weight"], state["embed.weight"])
    assert torch.equal(state["scale"], torch.tensor([0.5, 2.0]))
    assert state["calls"].dtype == torch.int64 and int(state["calls"]) == 3
    assert "scratch" not in state


# Stage 3 twice: with DeepSpeed's default persistence threshold every parameter of this small model
# stays whole; with threshold 0 every one is partitioned, so the converter must join partitions.
@pytest.fixture(scope="module", params=[(0, "fp32"), (0, "bf16"), (1, "fp32"), (2, "bf16"), (3, "fp32"),
                                        (3, "fp32", 0), (3, "bf16", 0)],
                ids=lambda p: f"stage{p[0]}-{p[1]}" + (f"-threshold{p[2]}" if len(p) > 2 else ""))
def saved(request, tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("ckpt")
    stage, dtype, *threshold = request.param
    full, frozen, partitioned = run_on_ranks(_train_and_save, 2, stage, dtype, str(save_dir), *threshold)[0]
    if threshold:
        assert partitioned == len(list(TiedModel().parameters()))  # every one (the tied head is the embedding)
    return save_dir, full, frozen


def test_state_dict_equals_gathered_masters(saved):
    save_dir, full, frozen = saved
    _check(z.get_fp32_state_dict_from_zero_checkpoint(str(save_dir)), full, frozen)
    excluded = z.get_fp32_state_dict_from_zero_checkpoint(str(save_dir), exclude_frozen_parameters=True)
    _check(excluded, full, frozen, exclude_frozen=True)


@pytest.mark.parametrize("safe", [False, True])
@pytest.mark.parametrize("shard", [None, "600B"])
def test_files_and_shards(saved, tmp_path, safe, shard):
    save_dir, full, frozen = saved
    z.convert_zero_checkpoint_to_fp32_state_dict(str(save_dir), str(tmp_path), max_shard_size=shard or "5GB",
                                                 safe_serialization=safe)
    stem, ext = ("model", "safetensors") if safe else ("pytorch_model", "bin")
    state = {}
    files = sorted(f for f in os.listdir(tmp_path) if f.endswith(ext))
    if shard is None:
        assert files == [f"{stem}.{ext}"]
    else:
        assert len(files) > 1 and files[0] == f"{stem}-00001-of-{len(files):05d}.{ext}"
        index = json.loads((tmp_path / f"{stem}.{ext}.index.json").read_text())
        assert set(index["weight_map"].values()) == set(files)
    for name in files:
        if safe:
            from safetensors.torch import load_file

            state.update(load_file(str(tmp_path / name)))
        else:
            state.update(torch.load(tmp_path / name, weights_only=True))
    if shard is not None:
        assert set(index["weight_map"]) == set(state)
    if safe:  # safetensors cannot alias; the tied copy is left for from_pretrained to re-tie
        assert "head.weight" not in state
        state["head.weight"] = state["embed.weight"]
    _check(state, full, frozen)


def test_cli(saved, tmp_path):
    save_dir, full, frozen = saved
    script = os.path.join(str(save_dir), "zero_to_fp32.py")  # the copy in the save dir runs on its own
    subprocess.run([sys.executable, script, str(save_dir), str(tmp_path), "--safe_serialization", "-d"],
                   check=True, capture_output=True, cwd=str(tmp_path))
    from safetensors.torch import load_file

    state = load_file(str(tmp_path / "model.safetensors"))
    assert torch.equal(state["mix.weight"], full["mix.weight"])


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_zero_to_torch_cli_writes_the_dtype(saved, tmp_path, dtype):
    """The copied zero_to_torch.py (beside zero_to_fp32.py) with --dtype: floating tensors cast from
    the fp32 result, the int64 buffer kept; the API's `dtype=` takes torch dtypes as well."""
    save_dir, full, frozen = saved
    script = os.path.join(str(save_dir), "zero_to_torch.py")
    subprocess.run([sys.executable, script, str(save_dir), str(tmp_path / "cli"), "--dtype", dtype],
                   check=True, capture_output=True, cwd=str(tmp_path))
    state = torch.load(tmp_path / "cli" / "pytorch_model.bin", weights_only=True)
    reference = z.get_fp32_state_dict_from_zero_checkpoint(str(save_dir))
    target = z.OUTPUT_DTYPE_NAMES[dtype]
    assert sorted(state) == sorted(reference)
    for name, tensor in reference.items():
        expected = tensor.to(target) if tensor.is_floating_point() else tensor
        assert state[name].dtype == expected.dtype and torch.equal(state[name], expected), name
    z.convert_zero_checkpoint_to_state_dict(str(save_dir), str(tmp_path / "api"), dtype=target)
    assert torch.equal(torch.load(tmp_path / "api" / "pytorch_model.bin", weights_only=True)["mix.weight"],
                       state["mix.weight"])
    with pytest.raises(ValueError, match="Unsupported output dtype 'int8'"):
        z.convert_zero_checkpoint_to_state_dict(str(save_dir), str(tmp_path / "bad"), dtype="int8")


def test_empty_tensors_are_an_error(tmp_path):
    tag = tmp_path / "global_step1"
    tag.mkdir()
    (tmp_path / "latest").write_text("global_step1")
    torch.save({"module": {"w": torch.empty(0)}, "buffer_names": [], "param_shapes": [{"w": torch.Size([3, 4])}]},
               tag / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    with pytest.raises(ValueError, match="empty"):
        z.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))


def test_missing_latest_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="Unable to find 'latest'"):
        z.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))


def test_parse_size():
    assert z.parse_size("5GB") == 5 * 10**9 and z.parse_size("2MiB") == 2 * 2**20 and z.parse_size(7) == 7


def _train_gpt2(stage, save_dir):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2))
    config = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage}}
    engine, _, _, _ = zerospeed.initialize(model=model, config=config)
    generator = torch.Generator().manual_seed(torch.distributed.get_rank())
    for _ in range(2):
        ids = torch.randint(0, 64, (2, 16), generator=generator)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(save_dir)
    model.config.save_pretrained(save_dir + "/hf")
    probe = torch.arange(16).view(1, 16) % 64
    engine.eval()
    with torch.no_grad():
        return engine(input_ids=probe).logits


def test_hf_gpt2_round_trip(tmp_path):
    from transformers import AutoModelForCausalLM

    logits = run_on_ranks(_train_gpt2, 2, 3, str(tmp_path))[0]
    z.convert_zero_checkpoint_to_fp32_state_dict(str(tmp_path), str(tmp_path / "hf"), safe_serialization=True)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=torch.arange(16).view(1, 16) % 64).logits, logits,
                                   rtol=0, atol=1e-6)


def test_cli_tag_and_load_into_a_model(saved, tmp_path):
    """`-t TAG` picks the tag without `latest`; a missing tag is an error naming it; and
    load_state_dict_from_zero_checkpoint fills a fresh model with the same fp32 values."""
    save_dir, full, frozen = saved
    tag = (save_dir / "latest").read_text().strip()
    script = os.path.join(str(save_dir), "zero_to_fp32.py")
    subprocess.run([sys.executable, script, str(save_dir), str(tmp_path / "out"), "-t", tag], check=True,
                   capture_output=True, cwd=str(tmp_path))
    state = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    _check(state, full, frozen)
    missing = subprocess.run([sys.executable, script, str(save_dir), str(tmp_path / "none"), "-t", "no_such_tag"],
                             capture_output=True, text=True, cwd=str(tmp_path))
    assert missing.returncode != 0 and "no_such_tag" in missing.stderr
    model = z.load_state_dict_from_zero_checkpoint(TiedModel(), str(save_dir), tag=tag)
    for name, value in full.items():
        assert torch.equal(dict(model.named_parameters())[name].detach(), value), name
