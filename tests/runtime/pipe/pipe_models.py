"""Models for the pipeline tests: the same layer list run by a PipelineModule and by plain torch."""

import torch

from zerospeed.pipe import LayerSpec, TiedLayerSpec

IN, HIDDEN, OUT, VOCAB, SEQ = 6, 12, 3, 11, 5
BASE_SEED = 1234


class Block(torch.nn.Module):
    def __init__(self, width: int = HIDDEN, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(width, width)
        self.dropout = dropout

    def forward(self, x):
        return x + torch.nn.functional.dropout(torch.tanh(self.fc(x)), self.dropout, self.training)


class Embed(torch.nn.Embedding):
    pass


def lm_head(embedding, x):
    return x @ embedding.weight.t()


def mlp_specs(num_blocks: int, dropout: float = 0.0):
    return ([LayerSpec(torch.nn.Linear, IN, HIDDEN)] + [LayerSpec(Block, HIDDEN, dropout) for _ in range(num_blocks)]
            + [LayerSpec(torch.nn.Linear, HIDDEN, OUT)])


def tied_specs(num_blocks: int):
    return ([TiedLayerSpec("embed", Embed, VOCAB, HIDDEN)] + [LayerSpec(Block) for _ in range(num_blocks)]
            + [TiedLayerSpec("embed", Embed, VOCAB, HIDDEN, forward_fn=lm_head)])


def mse(outputs, labels):
    return torch.nn.functional.mse_loss(outputs, labels)


def lm_loss(logits, labels):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


class Reference(torch.nn.Module):
    """The layer list as one torch module, each layer built with seed_layers' seed."""

    def __init__(self, specs) -> None:
        super().__init__()
        self.layers, self.tied_at, self.forward_fns = torch.nn.ModuleDict(), {}, {}
        for idx, spec in enumerate(specs):
            key = getattr(spec, "key", None)
            if key is not None and key in self.tied_at.values():
                self.forward_fns[idx] = spec.forward_fn
                self.tied_at[idx] = key
                continue
            torch.manual_seed(BASE_SEED + idx)
            module = spec.build()
            if key is not None:
                self.tied_at[idx] = key
                self.layers[f"tied_{key}"] = module
            else:
                self.layers[str(idx)] = module
        self.num_layers = len(specs)

    def forward(self, x):
        for idx in range(self.num_layers):
            if idx in self.tied_at:
                module = self.layers[f"tied_{self.tied_at[idx]}"]
                fn = self.forward_fns.get(idx)
                x = fn(module, x) if fn is not None else module(x)
            else:
                x = self.layers[str(idx)](x)
        return x


def pipeline_named_params(module):
    """{reference name: tensor} for this rank's layers of a PipelineModule."""
    named = {}
    for name, param in module.named_parameters():
        if name.startswith("tied_modules."):
            key, rest = name[len("tied_modules."):].split(".", 1)
            named[f"tied_{key}.{rest}"] = param.detach().float().clone()
        else:
            named[name] = param.detach().float().clone()
    return named


def batches(kind: str, steps: int, global_batch: int, seed: int = 7):
    generator = torch.Generator().manual_seed(seed)
    if kind == "lm":
        return [(torch.randint(0, VOCAB, (global_batch, SEQ), generator=generator),
                 torch.randint(0, VOCAB, (global_batch, SEQ), generator=generator)) for _ in range(steps)]
    return [(torch.randn(global_batch, IN, generator=generator), torch.randn(global_batch, OUT, generator=generator))
            for _ in range(steps)]


def micro_batches_of(batch, dp_rank: int, dp_size: int, micro: int, gas: int):
    """What pipeline `dp_rank` reads: micro-batch k holds rows (k * dp_size + dp_rank) * micro onwards."""
    for k in range(gas):
        start = (k * dp_size + dp_rank) * micro
        yield batch[0][start:start + micro], batch[1][start:start + micro]
