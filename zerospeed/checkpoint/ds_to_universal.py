"""`python -m zerospeed.checkpoint.ds_to_universal`: DeepSpeed's converter to the universal format.

    python -m zerospeed.checkpoint.ds_to_universal --input_folder <save_dir>/<tag> --output_folder <dir>
        [--num_extract_workers 4] [--num_merge_workers 2] [--keep_temp_folder] [--strict | --no_strict]
        [--inject_missing_state]

DeepSpeed's flags and output layout (checkpoint/universal/layout.py). The conversion is one
streaming pass ([Note: streaming conversion] in checkpoint/universal/convert.py): it writes no
temporary fragment files, so `--keep_temp_folder` has nothing to keep, and the worker counts,
which size DeepSpeed's process pools, are accepted for scripts that pass them and change nothing
in the output.
"""

from __future__ import annotations

import argparse

from zerospeed.checkpoint.universal.convert import convert_to_universal

__all__ = ["main", "parse_arguments"]


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Convert a ZeRO checkpoint tag folder to a universal checkpoint.")
    parser.add_argument("--input_folder", type=str, required=True, help="the checkpoint tag folder to convert")
    parser.add_argument("--output_folder", type=str, required=True,
                        help="the universal folder to write; `latest_universal` goes beside it")
    parser.add_argument("--num_extract_workers", type=int, default=4, help="accepted (one streaming pass)")
    parser.add_argument("--num_merge_workers", type=int, default=2, help="accepted (one streaming pass)")
    parser.add_argument("--keep_temp_folder", action="store_true", help="accepted (no temporary fragments)")
    parser.add_argument("--strict", dest="strict", action="store_true", default=True,
                        help="check every parameter's merged shape (default)")
    parser.add_argument("--no_strict", dest="strict", action="store_false", help="skip the shape checks")
    parser.add_argument("--inject_missing_state", action="store_true",
                        help="convert a stage 1/2 checkpoint without universal_checkpoint_info")
    return parser.parse_args(argv)


def main(args: argparse.Namespace) -> None:
    print(f"Converting checkpoint in {args.input_folder} to universal checkpoint in {args.output_folder}")
    convert_to_universal(args.input_folder, args.output_folder, strict=args.strict,
                         inject_missing_state=args.inject_missing_state)
    print("*** Done!")


if __name__ == "__main__":
    main(parse_arguments())
