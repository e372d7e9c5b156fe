"""Activation checkpointing under real ranks: ZeRO stages 0-3 train exactly as without it (dropout
on, a frozen weight and a weight used twice inside the checkpointed block), activations
partitioned across a model-parallel group, and the ds_config block applied by `initialize`."""

import pytest
import torch

import zerospeed
from distributed import run_on_ranks

STEPS, GLOBAL_BATCH = 3, 8


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = torch.nn.Linear(16, 16)  # used twice per forward
        self.frozen = torch.nn.Linear(16, 16)  # a LoRA-style frozen base weight
        self.frozen.requires_grad_(False)

    def forward(self, x, scale=None):
        h = torch.nn.functional.dropout(torch.tanh(self.shared(x)), p=0.2, training=self.training)
        h = self.shared(h) + self.frozen(x)
        return h if scale is None else h * scale


class Net(torch.nn.Module):
    def __init__(self, use_checkpoint: bool) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
        self.head = torch.nn.Linear(16, 4)
        self.use_checkpoint = use_checkpoint

    def forward(self, ids, y):
        h = self.embed(ids).mean(dim=1)
        for block in self.blocks:
            h = zerospeed.checkpointing.checkpoint(block, h, scale=None) if self.use_checkpoint else block(h)
        return torch.nn.functional.mse_loss(self.head(h), y)


def _train(stage, use_checkpoint):
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = Net(use_checkpoint)
    config = {"train_batch_size": GLOBAL_BATCH, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage}}
    engine, _, _, _ = zerospeed.initialize(model=model, config=config)
    data = torch.Generator().manual_seed(1)
    torch.manual_seed(100 + rank)  # dropout masks differ per rank but repeat between the two runs
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, 32, (GLOBAL_BATCH, 3), generator=data)
        y = torch.randn(GLOBAL_BATCH, 4, generator=data)
        rows = slice(rank * GLOBAL_BATCH // 2, (rank + 1) * GLOBAL_BATCH // 2)
        loss = engine(ids[rows], y[rows])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    if stage == 3:
        from zerospeed.runtime.zero.partition_parameters import GatheredParameters

        with GatheredParameters(list(engine.module.parameters())):
            params = [p.detach().clone() for p in engine.module.parameters()]
    else:
        params = [p.detach().clone() for p in engine.module.parameters()]
    return losses, params


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_checkpointing_equals_no_checkpointing_at_every_zero_stage(stage):
    plain = run_on_ranks(_train, 2, stage, False)
    checkpointed = run_on_ranks(_train, 2, stage, True)
    for (losses_p, params_p), (losses_c, params_c) in zip(plain, checkpointed):
        assert losses_p == losses_c
        assert len(params_p) == len(params_c)
        for a, b in zip(params_p, params_c):
            assert torch.equal(a, b)
    assert plain[0][0] != plain[1][0]  # the ranks saw different data and dropout masks


class _WorldMpu:
    """Both ranks form one model-parallel group (as tensor-parallel ranks would)."""

    def get_model_parallel_rank(self):
        return torch.distributed.get_rank()

    def get_model_parallel_world_size(self):
        return torch.distributed.get_world_size()

    def get_model_parallel_group(self):
        return torch.distributed.group.WORLD

    def get_data_parallel_rank(self):
        return 0

    def get_data_parallel_world_size(self):
        return 1

    def get_data_parallel_group(self):
        return torch.distributed.new_group([torch.distributed.get_rank()])


def _partitioned(cpu):
    from zerospeed.runtime.activation_checkpointing.saved_inputs import StoredInput

    checkpointing = zerospeed.checkpointing
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(3, 5, 16)  # 240 elements: split 120 / 120; 7 extra rows below test padding
    results = []
    for use_checkpoint, flags in ((False, {}), (True, {"partition_activations": True, "checkpoint_in_cpu": cpu})):
        checkpointing.configure(_WorldMpu(), **flags)
        block.zero_grad()
        xr = torch.cat([x.view(-1, 16), torch.randn(7, 16, generator=torch.Generator().manual_seed(2))])
        xr = xr.detach().requires_grad_(True)
        torch.manual_seed(4)
        out = checkpointing.checkpoint(block, xr, scale=2.0) if use_checkpoint else block(xr, scale=2.0)
        out.pow(2).sum().backward()
        results.append([xr.grad, block.shared.weight.grad, block.shared.bias.grad])
    checkpointing.configure(None)
    stored = StoredInput.keep(torch.randn(247), [], _partition_of_world(), to_cpu=False)
    return results, stored.copy.numel()


def _partition_of_world():
    from zerospeed.runtime.activation_checkpointing.saved_inputs import PartitionGroup

    return PartitionGroup(torch.distributed.get_rank(), torch.distributed.get_world_size(),
                          torch.distributed.group.WORLD)


@pytest.mark.parametrize("cpu", [False, True])
def test_partitioned_activations_equal_unpartitioned(cpu):
    for (plain, checkpointed), slice_numel in run_on_ranks(_partitioned, 2, cpu):
        for a, b in zip(plain, checkpointed):
            assert torch.equal(a, b)
        assert slice_numel == 124  # this rank keeps half of 247 (padded), not all of it


def _initialize_applies_block():
    from zerospeed.runtime.activation_checkpointing.checkpointing import current_settings

    zerospeed.checkpointing.configure(None)
    config = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "activation_checkpointing": {"cpu_checkpointing": True, "profile": True}}
    zerospeed.initialize(model=torch.nn.Linear(2, 2), config=config)
    settings = current_settings()
    zerospeed.checkpointing.configure(None)
    return settings.cpu_checkpointing, settings.profile


def test_initialize_applies_the_activation_checkpointing_block():
    assert run_on_ranks(_initialize_applies_block, 2) == [(True, True), (True, True)]
