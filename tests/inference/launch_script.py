"""One rank of `init_inference` started by a launcher (plain torchrun, or the zerospeed launcher):
the kinds named on the command line, tp = world size, each compared with the unsharded model the
rank builds itself. Writes ``<out_dir>/rank<R>.json``. Usage:
``launch_script.py OUT_DIR KIND [KIND ...] [--local_rank=N]`` (the launcher appends the last).
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from inference_models import logits_and_tokens, tiny_model  # noqa: E402


def main(out_dir: str, kinds: list[str]) -> None:
    import zerospeed

    results = {}
    for kind in kinds:
        ref_logits, ref_tokens = logits_and_tokens(tiny_model(kind))
        world_size = int(os.environ["WORLD_SIZE"])
        engine = zerospeed.init_inference(tiny_model(kind), dtype=torch.float32,
                                          tensor_parallel={"tp_size": world_size})
        logits, tokens = logits_and_tokens(engine)
        results[kind] = {"diff": (logits - ref_logits).abs().max().item(), "tokens": torch.equal(tokens, ref_tokens),
                         "mp_world_size": engine.mp_world_size}
    rank = torch.distributed.get_rank()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump({"results": results, "local_size": os.environ.get("LOCAL_SIZE")}, handle)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    main(args[0], args[1:])
