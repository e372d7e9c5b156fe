"""Arctic Long Sequence Training (ALST) for Hugging Face models, at DeepSpeed's import path.

* `UlyssesSPAttentionHF` wraps a transformers attention function (``sdpa``, flash attention) with
  the Ulysses exchange of ``zerospeed.sequence.all_to_all``; `register_with_transformers` puts it
  in place of the model's attention implementation and returns the ``mpu`` for
  ``deepspeed.initialize(mpu=...)``.
* `UlyssesSPDataLoaderAdapter` (sp_dataloader.py) hands each rank its slice of each sample.
* `TiledMLP`, `sequence_tiled_compute`, `TiledFusedLogitsLoss` (tiled_compute.py) bound the
  memory of position-wise layers and of the logits.

The loss over a sample's slices is `zerospeed.sequence.loss.sequence_parallel_cross_entropy`; the
engine averages gradients so that the result equals full-sequence training (groups_setup.py).
"""

from __future__ import annotations

from typing import Any

import torch

from zerospeed import comm
from zerospeed.runtime.sequence_parallel import parallel_state_sp
from zerospeed.runtime.sequence_parallel.sp_dataloader import UlyssesSPDataLoaderAdapter
from zerospeed.runtime.sequence_parallel.tiled_compute import (
    SequenceTiledCompute,
    TiledFusedLogitsLoss,
    TiledMLP,
    sequence_tiled_compute,
)
from zerospeed.sequence.all_to_all import SeqAllToAll, head_split, heads_to_sequence
from zerospeed.sequence.output_layout import SingleLayoutOutput

__all__ = ["SequenceTiledCompute", "TiledFusedLogitsLoss", "TiledMLP", "UlyssesSPAttentionHF",
           "UlyssesSPDataLoaderAdapter", "sequence_tiled_compute"]

_ORIGINAL = "_zerospeed_ulysses_original"  # the wrapped attention function, kept on the wrapper
_UNSUPPORTED = ("eager", "paged|eager")


class UlyssesSPAttentionHF(torch.nn.Module):
    """Ulysses around an HF attention function: ``[b, h, s/P, d]`` in, ``[b, s/P, h, d]`` out.

    Head counts are per instance. When the group is larger than the KV head count, each KV head
    is replicated ``sp / kv_heads`` times before the exchange (so every rank gets one).
    """

    def __init__(self, attn: Any, batch_size: int, attn_head_count: int, attn_head_size: int, kv_head_count: int,
                 num_hidden_layers: int, process_group: Any, seq_length_is_variable: bool = False,
                 local_seq_length: int | None = None, global_seq_length: int | None = None,
                 disable_in_eval: bool = False) -> None:
        super().__init__()
        self.attn = attn
        self.process_group = process_group
        self.world_size = comm.get_world_size(process_group)
        self.sp_rank = comm.get_rank(process_group)
        self.batch_size, self.num_hidden_layers = batch_size, num_hidden_layers
        self.seq_length_is_variable = seq_length_is_variable
        self.local_seq_length, self.global_seq_length = local_seq_length, global_seq_length
        self.disable_in_eval = disable_in_eval
        self.attn_head_count, self.attn_head_size, self.global_kv_head_count = \
            attn_head_count, attn_head_size, kv_head_count
        self.core_attn_implementation: str | None = None
        if attn_head_count % self.world_size != 0:
            raise ValueError(f"Attention head count {attn_head_count} is not divisible by SP size {self.world_size}")
        if kv_head_count % self.world_size != 0 and self.world_size % kv_head_count != 0:
            raise ValueError(f"KV attention head count {kv_head_count} is not divisible by SP size "
                             f"{self.world_size} or vice versa")
        self.kv_replication_factor = max(1, self.world_size // kv_head_count)
        kv_after = kv_head_count * self.kv_replication_factor
        self.q_split = head_split(attn_head_count, kv_after, self.world_size)
        self.kv_split = head_split(kv_after, kv_after, self.world_size)

    def _gather_position_ids(self, position_ids: torch.Tensor) -> torch.Tensor:
        out = position_ids.new_empty((self.world_size, *position_ids.shape))
        comm.all_gather_into_tensor(out.view(-1), position_ids.contiguous().view(-1), group=self.process_group)
        return torch.cat(out.unbind(0), dim=1)

    def forward(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        if self.disable_in_eval and not module.training:
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        if "position_ids" not in kwargs or kwargs["position_ids"] is None:
            raise ValueError("Ulysses SP needs position_ids in every forward() (torch.arange(seq_len) per sample, "
                             "or resetting at document boundaries); UlyssesSPDataLoaderAdapter requires them too")
        kwargs["position_ids"] = self._gather_position_ids(kwargs["position_ids"])
        if self.kv_replication_factor > 1:
            key = key.repeat_interleave(self.kv_replication_factor, dim=1)
            value = value.repeat_interleave(self.kv_replication_factor, dim=1)
        # HF's [b, h, s, d] -> [b, s, h, d]: the exchange keeps heads at dim 2, sequence at dim 1.
        q, k, v = (SeqAllToAll.apply(t.transpose(1, 2), self.process_group, 1, split, True).transpose(1, 2)
                   for t, split in ((query, self.q_split), (key, self.kv_split), (value, self.kv_split)))
        if self.kv_replication_factor > 1:  # the local query/KV ratio changed with the replication
            module.num_key_value_groups = q.shape[1] // k.shape[1]
        # HF built the mask for the local slice; causal attention over the full rows needs none.
        with SingleLayoutOutput() as saved:   # [Note: attention output in one layout]
            context, weights = self.attn(module, q, k, v, None, *args, **kwargs)  # [b, s, h_local, d]
        context = context.contiguous()
        out = SeqAllToAll.apply(context, self.process_group, 1, self.q_split, False)
        saved.keep_exchanged_only(context, out, self._output_to_heads)
        return out, weights

    def _output_to_heads(self, out: torch.Tensor) -> torch.Tensor:
        return heads_to_sequence(out, 1, self.q_split, self.process_group)

    @classmethod
    def register_with_transformers(cls, model_name_or_path: Any, core_attn_implementation: str,
                                   sequence_parallel_size: int, micro_batch_size: int, seq_length: int | None = None,
                                   seq_length_is_variable: bool = True, disable_in_eval: bool = False,
                                   max_length: int | None = None) -> Any:
        """Swap ``core_attn_implementation`` in transformers for Ulysses; return the ALST ``mpu``.

        Returns None when ``sequence_parallel_size`` is 1. Registering again (another model)
        wraps the original implementation, not the previous wrapper.
        """
        if sequence_parallel_size == 1:
            return None
        seq_length = seq_length if seq_length is not None else max_length
        if not seq_length_is_variable and seq_length is None:
            raise ValueError("Either seq_length_is_variable must be True or seq_length must be set to the fixed "
                             "sequence length")
        if core_attn_implementation in _UNSUPPORTED:
            raise ValueError(f"core_attn_implementation={core_attn_implementation!r} is not supported by Ulysses "
                             "sequence parallelism (it needs a 4D attention mask); use 'sdpa' or flash attention")
        from transformers import AutoConfig
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        config = getattr(model_name_or_path, "config", None) or AutoConfig.from_pretrained(model_name_or_path)
        loaded = getattr(config, "_attn_implementation", None) if hasattr(model_name_or_path, "config") else None
        if loaded is not None and loaded != core_attn_implementation:
            raise ValueError(f"core_attn_implementation={core_attn_implementation!r} does not match the model's "
                             f"attn_implementation={loaded!r}; set both to the same value")
        if core_attn_implementation not in ALL_ATTENTION_FUNCTIONS:
            raise ValueError(f"{core_attn_implementation!r} is not a valid attn_implementation; choices: "
                             f"{ALL_ATTENTION_FUNCTIONS.valid_keys()}")
        parallel_state_sp.initialize_sequence_parallel(sequence_parallel_size)
        current = ALL_ATTENTION_FUNCTIONS[core_attn_implementation]
        original = getattr(current, _ORIGINAL, current)
        text = config.get_text_config()
        fixed = None if seq_length_is_variable else seq_length
        local = None if fixed is None else fixed // sequence_parallel_size
        uattn = cls(original, micro_batch_size, text.num_attention_heads,
                    getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
                    text.num_key_value_heads, text.num_hidden_layers, parallel_state_sp.get_sequence_parallel_group(),
                    seq_length_is_variable, local, fixed, disable_in_eval)
        uattn.core_attn_implementation = core_attn_implementation

        def ulysses_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
            return uattn(module, query, key, value, attention_mask, *args, **kwargs)

        setattr(ulysses_attention, _ORIGINAL, original)
        ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = ulysses_attention
        return parallel_state_sp
