"""ALST on a tiny Hugging Face Llama: `register_with_transformers` + `UlyssesSPDataLoaderAdapter` +
`sequence_parallel_cross_entropy` with sp 2 on 2 ranks and sp 2 x dp 2 on 4 ranks train exactly like the same model on the full
sequences in one process (losses and parameters, fp32, SGD), with GQA and uneven valid tokens; so
does the loss recipe transformers' Trainer uses under sp (`deepspeed_sp_compute_loss`: the model's
own loss on `shift_labels`, aggregated with a differentiable all-gather weighted by valid tokens)."""

import pytest
import torch

from distributed import run_on_ranks
from zerospeed import comm

SEQ, STEPS, LR = 8, 2, 0.5


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config).float()


def _samples(count):
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(count):
        ids = torch.randint(0, 32, (1, SEQ), generator=gen)
        labels = ids.clone()
        labels[:, :3] = -100  # a prompt: the first slice holds fewer scored tokens than the second
        out.append({"input_ids": ids, "position_ids": torch.arange(SEQ).unsqueeze(0), "labels": labels})
    return out


def _reference(world, sp=2):
    """Rank r loads samples r, r + world, ...; at each step every sp group trains the sample one of its
    ranks loaded (rank 0's, then rank 1's, ...), and data-parallel groups average."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    samples, losses = _samples(STEPS * world), []
    for step in range(STEPS * sp):
        refill, k = divmod(step, sp)
        batch = [samples[refill * world + group * sp + k] for group in range(world // sp)]
        loss = torch.stack([model(**sample).loss for sample in batch]).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _trainer_recipe_loss(engine, batch, group):
    """What transformers.integrations.deepspeed.deepspeed_sp_compute_loss computes."""
    import torch.distributed.nn.functional as dist_fn

    loss = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["shift_labels"],
                  shift_labels=batch["shift_labels"]).loss
    losses = torch.stack(dist_fn.all_gather(loss, group=group))
    tokens = torch.stack(dist_fn.all_gather((batch["shift_labels"] != -100).view(-1).sum(), group=group))
    return (losses * tokens).sum() / tokens.sum().clamp(min=1)


def _train_alst(stage, recipe):
    import zerospeed
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from zerospeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from zerospeed.sequence.loss import sequence_parallel_cross_entropy

    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    try:
        model = _model()
        mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sequence_parallel_size=2,
                                                              micro_batch_size=1)
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0,
                  "zero_optimization": {"stage": stage}, "optimizer": {"type": "SGD", "params": {"lr": LR}}}
        engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=config, mpu=mpu)
        rank, world = comm.get_rank(), comm.get_world_size()
        mine = _samples(STEPS * world)[rank::world]  # each rank's own DataLoader
        loader = UlyssesSPDataLoaderAdapter(mine, sp_rank=mpu.get_sequence_parallel_rank(),
                                            sp_group=mpu.get_sequence_parallel_group(),
                                            sp_world_size=mpu.get_sequence_parallel_world_size(), device="cpu")
        losses = []
        for batch in loader:
            group = mpu.get_sequence_parallel_group()
            if recipe == "trainer":
                loss = _trainer_recipe_loss(engine, batch, group)
            else:
                logits = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
                loss = sequence_parallel_cross_entropy(logits, batch["shift_labels"], group)
            engine.backward(loss)
            engine.step()
            mean = loss.detach().clone()
            torch.distributed.all_reduce(mean)  # every rank holds its group's sample loss
            losses.append(mean.item() / world)
        return losses, torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = original


def _recipes(stage, recipes):
    return [_train_alst(stage, recipe) for recipe in recipes]


@pytest.mark.parametrize("world, recipes", [(2, ("zerospeed", "trainer")), (4, ("zerospeed",))])
def test_llama_with_ulysses_equals_full_sequence(world, recipes):
    """sp 2 on 2 ranks (both loss recipes), and sp 2 x dp 2 on 4 ranks."""
    ref_losses, ref_params = _reference(world)
    for losses, params in [run for rank in run_on_ranks(_recipes, world, 1, recipes) for run in rank]:
        assert torch.allclose(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0), (losses, ref_losses)
        assert ((params - ref_params).abs().max() / ref_params.abs().max()).item() < 1e-5
