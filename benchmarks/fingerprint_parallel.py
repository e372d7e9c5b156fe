"""The parallel cases of the loss fingerprint (loss_fingerprint.py): short fp32 runs of a pipeline
(2 stages, a tied embedding on both), an MoE layer (ep 2), Ulysses attention (sp 2) and AutoTP
(tp 2), at 2 gloo ranks, with clipping off and on (a clip below every norm, so it acts each step).

Each line: the case, this rank, then per step the loss and the global gradient norm as float.hex.
SGD with momentum, not Adam: a gradient scaled differently shows in the next loss.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from harness import finish_rank

__all__ = ["PARALLEL_RUNS"]

WORLD_SIZE, STEPS, GAS, MICRO = 2, 3, 2, 2
CLIPS = (0.0, 0.05)
_OPTIMIZER = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}


def _start(rank: int, init_file: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE), LOCAL_RANK=str(rank), ZS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    from zerospeed.utils.logging import logger

    logger.setLevel(logging.ERROR)   # warnings carry timestamps: keep stdout a pure fingerprint


def _config(stage: int, clip: float, **extra: Any) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "optimizer": _OPTIMIZER,
            "gradient_clipping": clip, "zero_optimization": {"stage": stage}, **extra}


def _line(case: str, rank: int, losses: list[float], norms: list[float]) -> str:
    steps = " ".join(f"{float(loss).hex()}/{float(norm).hex()}" for loss, norm in zip(losses, norms))
    return f"{case} rank={rank} loss/norm={steps}"


def _cases(stages: tuple[int, ...]) -> Iterator[tuple[int, float]]:
    return ((stage, clip) for stage in stages for clip in CLIPS)


# --- pipeline: Linear/Block layers between a tied embedding and its transposed use as the head ------
VOCAB, HIDDEN, SEQ = 11, 12, 5


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


def _lm_head(embedding: torch.nn.Embedding, x: torch.Tensor) -> torch.Tensor:
    return x @ embedding.weight.t()


def _lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def _pipeline_worker(rank: int, init_file: str, results: Any) -> None:
    _start(rank, init_file)
    import zerospeed
    from zerospeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    specs = ([TiedLayerSpec("embed", torch.nn.Embedding, VOCAB, HIDDEN)] + [LayerSpec(_Block) for _ in range(3)]
             + [TiedLayerSpec("embed", torch.nn.Embedding, VOCAB, HIDDEN, forward_fn=_lm_head)])
    lines = []
    for stage, clip in _cases((0, 1, 2)):
        module = PipelineModule(specs, num_stages=2, loss_fn=_lm_loss, seed_layers=True, base_seed=1234)
        engine, _, _, _ = zerospeed.initialize(model=module, config=_config(stage, clip))
        generator = torch.Generator().manual_seed(5)
        losses, norms = [], []
        for _ in range(STEPS):
            ids = torch.randint(0, VOCAB, (GAS * MICRO, SEQ), generator=generator)
            micro = iter([(ids[k * MICRO:(k + 1) * MICRO], ids[k * MICRO:(k + 1) * MICRO].roll(-1, 1))
                          for k in range(GAS)])
            losses.append(float(engine.train_batch(micro)))
            norms.append(float(engine.get_global_grad_norm()))
        lines.append(_line(f"pipe2 stage={stage} clip={clip}", rank, losses, norms))
    finish_rank(results, (rank, lines))


# --- the other three share one loop: micro-batch `index`'s loss is `loss_of(engine, index, *data)` ---
def _train(engine: Any, loss_of: Callable[..., torch.Tensor], *data: Any) -> tuple[list[float], list[float]]:
    losses, norms = [], []
    for step in range(STEPS):
        for micro_step in range(GAS):
            loss = loss_of(engine, step * GAS + micro_step, *data)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.item()))
        norms.append(float(engine.get_global_grad_norm()))
    return losses[GAS - 1::GAS], norms


class _MoEModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from zerospeed.moe.layer import MoE

        torch.manual_seed(0)
        self.inp = torch.nn.Linear(5, 8)
        expert = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.Tanh(), torch.nn.Linear(12, 8))
        self.moe = MoE(8, expert, 4, 2, 1, capacity_factor=1.0, min_capacity=1, drop_tokens=True, use_rts=False,
                       top2_2nd_expert_sampling=False, drop_policy="position")
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.inp(x))
        out, l_aux, _ = self.moe(hidden)
        return torch.nn.functional.mse_loss(self.head(out + hidden), y) + 0.1 * l_aux


def _moe_loss(engine: Any, index: int, data: list[tuple[torch.Tensor, torch.Tensor]], rows: slice) -> torch.Tensor:
    return engine(data[index][0][rows], data[index][1][rows])


def _moe_worker(rank: int, init_file: str, results: Any) -> None:
    _start(rank, init_file)
    import zerospeed

    lines = []
    for stage, clip in _cases((0, 1, 2, 3)):
        model = _MoEModel()
        torch.manual_seed(1 + rank)   # each rank's experts differ
        with torch.no_grad():
            for param in model.moe.deepspeed_moe.experts.parameters():
                param.copy_(torch.randn(param.shape) * 0.5)
        zero = {"stage3_param_persistence_threshold": 0} if stage == 3 else {}
        config = _config(stage, clip)
        config["zero_optimization"].update(zero)
        engine, _, _, _ = zerospeed.initialize(model=model, config=config)
        generator = torch.Generator().manual_seed(3)
        data = [(torch.randn(MICRO * WORLD_SIZE, 5, generator=generator),
                 torch.randn(MICRO * WORLD_SIZE, 3, generator=generator)) for _ in range(STEPS * GAS)]
        losses, norms = _train(engine, _moe_loss, data, slice(rank * MICRO, (rank + 1) * MICRO))
        lines.append(_line(f"moe_ep2 stage={stage} clip={clip}", rank, losses, norms))
    finish_rank(results, (rank, lines))


class _AttentionLM(torch.nn.Module):
    """Embedding -> causal Ulysses attention over the sequence group -> head."""

    def __init__(self, group: Any) -> None:
        super().__init__()
        from zerospeed.sequence.layer import DistributedAttention

        self.embed = torch.nn.Embedding(16, 8)
        self.qkv = torch.nn.Linear(8, 24)
        self.out = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 16)
        self.attention = DistributedAttention(self._sdpa, group)

    @staticmethod
    def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *unused: object) -> torch.Tensor:
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                               v.transpose(1, 2), is_causal=True)
        return out.transpose(1, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        q, k, v = self.qkv(x).view(*tokens.shape, 3, 2, 4).unbind(2)
        return self.head(x + self.out(self.attention(q, k, v, 0).reshape(*tokens.shape, 8)))


def _sp_loss(engine: Any, index: int, tokens: torch.Tensor, labels: torch.Tensor, cols: slice) -> torch.Tensor:
    from zerospeed.sequence.loss import sequence_parallel_cross_entropy

    return sequence_parallel_cross_entropy(engine(tokens[index][:, cols]), labels[index][:, cols],
                                           engine.seq_parallel_group)


def _sp_worker(rank: int, init_file: str, results: Any) -> None:
    _start(rank, init_file)
    import zerospeed
    from zerospeed.comm import groups
    from zerospeed.runtime.sequence_parallel.groups_setup import sequence_parallel_topology

    topology = sequence_parallel_topology(WORLD_SIZE, 2)
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 16, (STEPS * GAS, MICRO, 8), generator=generator)
    labels = torch.cat([tokens[..., 1:], torch.full((STEPS * GAS, MICRO, 1), -100)], dim=-1)
    lines = []
    for stage, clip in _cases((0, 1, 2, 3)):
        torch.manual_seed(0)
        model = _AttentionLM(groups.create_axis_group(topology, "sequence").group)
        engine, _, _, _ = zerospeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=_config(stage, clip, sequence_parallel_size=2))
        losses, norms = _train(engine, _sp_loss, tokens, labels, slice(rank * 4, (rank + 1) * 4))
        lines.append(_line(f"ulysses_sp2 stage={stage} clip={clip}", rank, losses, norms))
    finish_rank(results, (rank, lines))


def _lm_loss_hf(engine: Any, index: int, ids: torch.Tensor) -> torch.Tensor:
    return engine(input_ids=ids[index], labels=ids[index]).loss


def _autotp_worker(rank: int, init_file: str, results: Any) -> None:
    _start(rank, init_file)
    from transformers import LlamaConfig, LlamaForCausalLM

    import zerospeed

    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 64, (STEPS * GAS, MICRO, 8), generator=generator)
    lines = []
    for stage, clip in _cases((0, 1, 2)):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                             tie_word_embeddings=False))
        engine, _, _, _ = zerospeed.initialize(model=zerospeed.tp_model_init(model, 2, torch.float32),
                                               config=_config(stage, clip, tensor_parallel={"autotp_size": 2}))
        losses, norms = _train(engine, _lm_loss_hf, ids)
        lines.append(_line(f"autotp_tp2 stage={stage} clip={clip}", rank, losses, norms))
    finish_rank(results, (rank, lines))


PARALLEL_RUNS: list[tuple[str, Callable[..., None]]] = [
    ("pipeline 2 stages", _pipeline_worker), ("moe ep 2", _moe_worker),
    ("ulysses sp 2", _sp_worker), ("autotp tp 2", _autotp_worker)]
