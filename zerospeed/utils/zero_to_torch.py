#!/usr/bin/env python
"""Merge a ZeRO checkpoint's shards into full weights in fp32, fp16 or bf16 (DeepSpeed 0.19.8's `zero_to_torch.py`).

    python zero_to_torch.py <checkpoint_dir> <output_dir> --dtype {bf16,bfloat16,float16,float32,fp16,fp32}
                            [--max_shard_size 5GB] [--safe_serialization] [-t TAG]
                            [--exclude_frozen_parameters] [-d]

Standalone like its sibling: a copy of both files sits in every checkpoint directory, so run from
there (`python zero_to_torch.py . out --dtype bf16`) it imports `zero_to_fp32` beside it; imported
as `zerospeed.utils.zero_to_torch` it takes the package's. Integer and bool buffers keep their dtype.
"""

from __future__ import annotations

import argparse

if __package__:
    from . import zero_to_fp32
else:  # run as a script from a checkpoint directory: the sibling copy
    import zero_to_fp32  # type: ignore[no-redef]

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Convert a ZeRO checkpoint to float32, float16 or bfloat16 "
                                                 "PyTorch weights.")
    parser.add_argument("checkpoint_dir", help="the folder holding 'latest' and the tag folders")
    parser.add_argument("output_dir", help="where pytorch_model.bin / model.safetensors (or shards) go")
    parser.add_argument("--dtype", required=True, choices=sorted(zero_to_fp32.OUTPUT_DTYPE_NAMES),
                        help="dtype of the floating-point tensors written")
    parser.add_argument("--max_shard_size", default="5GB", help="largest output shard, e.g. 5GB, 500MiB")
    parser.add_argument("--safe_serialization", action="store_true", help="write safetensors")
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: the 'latest' file)")
    parser.add_argument("--exclude_frozen_parameters", action="store_true")
    parser.add_argument("-d", "--debug", action="store_true")
    args = parser.parse_args(argv)
    zero_to_fp32.debug = args.debug
    zero_to_fp32.convert_zero_checkpoint_to_state_dict(
        args.checkpoint_dir, args.output_dir, dtype=args.dtype, max_shard_size=args.max_shard_size,
        safe_serialization=args.safe_serialization, tag=args.tag,
        exclude_frozen_parameters=args.exclude_frozen_parameters)


if __name__ == "__main__":
    main()
