"""`zerospeed estimate`: per-rank model-state memory for every stage and offload option.

    zerospeed estimate --params 7e9 --num_gpus 8 --num_nodes 2 --dtype bf16
    zerospeed estimate --hf-config path/to/config.json --num_gpus 4

The model is a parameter count, or a Hugging Face config built on the meta device (no weights
are read or downloaded). Rows come from `estimate_model_states_bytes`; `--deepspeed-tables` also
prints DeepSpeed's ZeRO-2 / ZeRO-3 estimator tables for comparison.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from zerospeed.runtime.zero.estimators import (GIB, estimate_model_states_bytes,
                                               estimate_zero2_model_states_mem_needs_all_cold,
                                               estimate_zero3_model_states_mem_needs_all_cold, model_to_params)

__all__ = ["main", "build_parser", "format_estimates"]

# (stage, offload_optimizer, offload_param) rows, in the order printed
_OPTIONS = [(0, None, None), (1, None, None), (1, "cpu", None), (2, None, None), (2, "cpu", None),
            (3, None, None), (3, "cpu", None), (3, "cpu", "cpu")]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zerospeed estimate", description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--params", type=float, help="total parameter count (e.g. 7e9)")
    source.add_argument("--hf-config", help="a Hugging Face config.json (or its directory)")
    parser.add_argument("--num_gpus", type=int, default=1, help="GPUs per node")
    parser.add_argument("--num_nodes", type=int, default=1)
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="bf16", help="training dtype")
    parser.add_argument("--optimizer_state_bytes", type=int, default=8,
                        help="fp32 optimizer-state bytes per parameter (Adam 8, Lion / SGD momentum 4)")
    parser.add_argument("--deepspeed-tables", action="store_true", help="also print DeepSpeed's estimator tables")
    return parser


def _params_from_hf_config(path: str) -> tuple[int, int, list[int]]:
    try:
        import torch
        import transformers
    except ImportError as error:
        raise SystemExit("--hf-config needs transformers: pip install transformers") from error
    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    total, largest = model_to_params(model)
    return total, largest, [p.numel() for p in model.parameters()]


def format_estimates(num_params: int, num_gpus_per_node: int, num_nodes: int, dtype: str,
                     optimizer_state_bytes: int = 8, param_numels: list[int] | None = None) -> str:
    world_size = num_gpus_per_node * num_nodes
    lines = [f"Model states per rank: {num_params / 1e6:.1f}M params, {dtype}, {world_size} rank(s) "
             f"({num_nodes} node(s) x {num_gpus_per_node} GPU(s)); activations and buffers not included.",
             f"{'stage':>5} | {'offload_optimizer':>17} | {'offload_param':>13} | {'device/rank':>11} | "
             f"{'host/rank':>9} | {'host/node':>9}"]
    for stage, offload_optimizer, offload_param in _OPTIONS:
        estimate = estimate_model_states_bytes(num_params, world_size, stage, dtype, offload_optimizer,
                                               offload_param, optimizer_state_bytes_per_param=optimizer_state_bytes,
                                               param_numels=param_numels)
        host = estimate.location_total("cpu")
        lines.append(f"{stage:>5} | {offload_optimizer or 'none':>17} | {offload_param or 'none':>13} | "
                     f"{estimate.location_total('device') / GIB:>9.2f}GB | {host / GIB:>7.2f}GB | "
                     f"{host * num_gpus_per_node / GIB:>7.2f}GB")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.num_gpus < 1 or args.num_nodes < 1:
        raise SystemExit("--num_gpus and --num_nodes must be >= 1")
    if args.hf_config:
        num_params, largest_layer, param_numels = _params_from_hf_config(args.hf_config)
    else:
        num_params, largest_layer, param_numels = int(args.params), 0, None
    print(format_estimates(num_params, args.num_gpus, args.num_nodes, args.dtype, args.optimizer_state_bytes,
                           param_numels))
    if args.deepspeed_tables:
        print()
        estimate_zero2_model_states_mem_needs_all_cold(num_params, args.num_gpus, args.num_nodes)
        print()
        estimate_zero3_model_states_mem_needs_all_cold(num_params, largest_layer, args.num_gpus, args.num_nodes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
