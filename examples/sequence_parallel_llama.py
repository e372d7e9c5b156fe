"""Train a tiny Hugging Face Llama with Ulysses sequence parallelism (ALST), and check it against
the same model trained on the full sequences in one process.

    OMP_NUM_THREADS=1 zerospeed --num_gpus 2 examples/sequence_parallel_llama.py
    (or: python -m torch.distributed.run --nproc_per_node 2 examples/sequence_parallel_llama.py)

Every rank loads its own samples; `UlyssesSPDataLoaderAdapter` gives each rank its slice of every
sample of its sequence-parallel group, and attention sees the whole sequence through the all-to-all.
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import zerospeed as deepspeed
from zerospeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
from zerospeed.sequence.loss import sequence_parallel_cross_entropy

SEQ, STEPS, LR = 16, 4, 0.5


def tiny_llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def samples(count):
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        ids = torch.randint(0, 64, (1, SEQ), generator=gen)
        out.append({"input_ids": ids, "position_ids": torch.arange(SEQ).unsqueeze(0), "labels": ids.clone()})
    return out


deepspeed.init_distributed()
rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
model = tiny_llama()
mpu = UlyssesSPAttentionHF.register_with_transformers(model, core_attn_implementation="sdpa",
                                                      sequence_parallel_size=world, micro_batch_size=1)
config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0,
          "zero_optimization": {"stage": 2}, "optimizer": {"type": "SGD", "params": {"lr": LR}}}
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config, mpu=mpu)
group = mpu.get_sequence_parallel_group()
loader = UlyssesSPDataLoaderAdapter(samples(STEPS * world)[rank::world], sp_rank=mpu.get_sequence_parallel_rank(),
                                    sp_group=group, sp_world_size=world, device=engine.device)
losses = []
for batch in loader:
    logits = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    loss = sequence_parallel_cross_entropy(logits, batch["shift_labels"], group)  # the whole sample's loss
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())

if rank == 0:  # the same training on full sequences, one process, no sequence parallelism
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS["sdpa"] = ALL_ATTENTION_FUNCTIONS["sdpa"]._zerospeed_ulysses_original
    reference = tiny_llama()
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    expected = []
    for sample in samples(STEPS * world):
        loss = reference(**sample).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    print("sequence parallel losses:", [round(x, 6) for x in losses])
    print("full sequence losses:    ", [round(x, 6) for x in expected])
    assert torch.allclose(torch.tensor(losses), torch.tensor(expected), rtol=1e-5)
