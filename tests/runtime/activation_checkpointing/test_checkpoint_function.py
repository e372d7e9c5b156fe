"""`zerospeed.checkpointing.checkpoint` in one process: gradients and dropout equal a run without
checkpointing bit for bit, for every argument form torch.utils.checkpoint accepts."""

import pytest
import torch

import zerospeed.checkpointing as checkpointing
from zerospeed.runtime.activation_checkpointing.checkpointing import current_settings


@pytest.fixture(autouse=True)
def _default_settings():
    checkpointing.configure(None)
    checkpointing.get_cuda_rng_tracker().reset()
    yield
    checkpointing.configure(None)
    checkpointing.get_cuda_rng_tracker().reset()


class DropoutBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x, mask=None, scale=1.0, extra=None):
        h = torch.nn.functional.dropout(torch.tanh(self.fc1(x)), p=0.3, training=self.training)
        if mask is not None:
            h = h * mask
        out = self.fc2(h) * scale
        if extra is not None:
            out = out + extra["bias"]
        return out


def _grads(model, x, use_checkpoint, seed, **kwargs):
    model.zero_grad()
    x = x.detach().clone().requires_grad_(True)
    torch.manual_seed(seed)
    out = checkpointing.checkpoint(model, x, **kwargs) if use_checkpoint else model(x, **kwargs)
    # Draws after the checkpointed call must not be disturbed by the recompute in backward.
    noise = torch.rand(out.shape)
    (out * noise).sum().backward()
    after = torch.rand(3)
    return [x.grad] + [p.grad for p in model.parameters()] + [out.detach(), after]


@pytest.mark.parametrize("kwargs", [{}, {"mask": None, "scale": 0.5},
                                     {"mask": torch.ones(4, 16), "extra": {"bias": torch.randn(8)}}],
                         ids=["positional", "none-and-float", "tensor-kwargs-nested"])
def test_checkpoint_equals_no_checkpoint_with_dropout(kwargs):
    torch.manual_seed(0)
    model, x = DropoutBlock(), torch.randn(4, 8)
    expected = _grads(model, x, False, seed=7, **kwargs)
    actual = _grads(model, x, True, seed=7, **kwargs)
    for a, e in zip(actual, expected):
        assert torch.equal(a, e)


def test_dropout_really_draws_random_numbers():
    """The test above could not fail if dropout were a no-op: two seeds give different grads."""
    torch.manual_seed(0)
    model, x = DropoutBlock(), torch.randn(4, 8)
    assert not torch.equal(_grads(model, x, True, seed=1)[0], _grads(model, x, True, seed=2)[0])


def test_tensor_keyword_argument_gets_its_gradient():
    torch.manual_seed(0)
    model, x = DropoutBlock().eval(), torch.randn(4, 8)
    bias = torch.randn(8, requires_grad=True)
    checkpointing.checkpoint(model, x, extra={"bias": bias}).sum().backward()
    assert torch.equal(bias.grad, torch.full((8,), 4.0))


def test_non_tensor_and_nested_outputs_come_back():
    x = torch.randn(3, requires_grad=True)
    out = checkpointing.checkpoint(lambda t, n: {"y": t * n, "name": "blk", "pair": (t.sum(), None)}, x, 2)
    assert out["name"] == "blk" and out["pair"][1] is None
    (out["y"].sum() + out["pair"][0]).backward()
    assert torch.equal(x.grad, torch.full((3,), 3.0))


def test_integer_inputs_still_train_the_embedding():
    """DeepSpeed 0.19.8 (reentrant) returns an output without grad_fn here: the embedding gets no grad."""
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(10, 4)
    ids = torch.tensor([[1, 2, 2], [3, 0, 9]])
    checkpointing.checkpoint(embedding, ids).pow(2).sum().backward()
    expected = torch.zeros(10, 4).index_add_(0, ids.view(-1), 2 * embedding.weight.detach()[ids.view(-1)])
    assert torch.equal(embedding.weight.grad, expected)


def test_integer_outputs_are_not_differentiable():
    x = torch.randn(5, requires_grad=True)
    values, indices = checkpointing.checkpoint(lambda t: torch.sort(t), x)
    assert not indices.requires_grad and values.requires_grad
    values.sum().backward()
    assert torch.equal(x.grad, torch.ones(5))


def test_under_no_grad_the_function_runs_plainly():
    with torch.no_grad():
        out = checkpointing.checkpoint(lambda t: t * 2, torch.ones(2, requires_grad=True))
    assert out.grad_fn is None and torch.equal(out, torch.full((2,), 2.0))


def test_model_parallel_tracker_state_is_replayed():
    checkpointing.model_parallel_cuda_manual_seed(123)
    tracker = checkpointing.get_cuda_rng_tracker()

    def tp_dropout(t):
        with tracker.fork():
            return torch.nn.functional.dropout(t, p=0.5)

    def run(use_checkpoint):
        tracker.reset()
        checkpointing.model_parallel_cuda_manual_seed(123)
        x = torch.ones(64, requires_grad=True)
        out = checkpointing.checkpoint(tp_dropout, x) if use_checkpoint else tp_dropout(x)
        out.sum().backward()
        return x.grad, out.detach()

    plain, checkpointed = run(False), run(True)
    assert torch.equal(plain[0], checkpointed[0]) and torch.equal(plain[1], checkpointed[1])
    assert 0 < int((plain[0] == 0).sum()) < 64


def test_tracker_errors_name_the_missing_state():
    with pytest.raises(KeyError, match="model_parallel_cuda_manual_seed"):
        with checkpointing.get_cuda_rng_tracker().fork():
            pass
    checkpointing.get_cuda_rng_tracker().add("a", 1)
    with pytest.raises(ValueError, match="seed 1 already exists"):
        checkpointing.get_cuda_rng_tracker().add("b", 1)


def test_cpu_checkpointing_without_partitioning_matches():
    torch.manual_seed(0)
    model, x = DropoutBlock(), torch.randn(4, 8)
    expected = _grads(model, x, False, seed=3)
    checkpointing.configure(None, checkpoint_in_cpu=True)
    for a, e in zip(_grads(model, x, True, seed=3), expected):
        assert torch.equal(a, e)


def test_non_reentrant_checkpoint_replays_dropout_and_takes_kwargs():
    torch.manual_seed(0)
    model, x = DropoutBlock(), torch.randn(4, 8)
    expected = _grads(model, x, False, seed=9, scale=2.0)
    model.zero_grad()
    xr = x.clone().requires_grad_(True)
    torch.manual_seed(9)
    out = checkpointing.non_reentrant_checkpoint(model, xr, scale=2.0)
    (out * torch.rand(out.shape)).sum().backward()
    assert torch.equal(xr.grad, expected[0])


def test_configure_precedence_and_validation(tmp_path):
    import json

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"activation_checkpointing": {"partition_activations": True, "profile": True}}))
    checkpointing.configure(None, deepspeed_config=str(path), profile=False, num_checkpoints=4)
    settings = current_settings()
    assert (settings.partition_activations, settings.profile, settings.number_checkpoints) == (True, False, 4)
    assert checkpointing.is_configured()
    checkpointing.configure(None)  # defaults first: nothing carries over
    assert current_settings().partition_activations is False
    with pytest.raises(ValueError, match="requires partition_activations"):
        checkpointing.configure(None, contiguous_checkpointing=True)
    with pytest.raises(ValueError, match="number_checkpoints"):
        checkpointing.configure(None, partition_activations=True, contiguous_checkpointing=True)
    with pytest.raises(ValueError, match="activation_checkpointing.partition_activation"):
        checkpointing.configure(None, deepspeed_config={"activation_checkpointing": {"partition_activation": True}})
