"""`python -m zerospeed.ops.op_builder prebuild [--ops NAME ...]`: compile ops into the cache.

Run it once after `pip install` (or in a Docker layer) so training never waits on a compiler.
Without `--ops`, an op is built when its `ZS_BUILD_<NAME>` variable (DeepSpeed's `DS_BUILD_<NAME>`
is read too) is 1, defaulting to `ZS_BUILD_OPS` / `DS_BUILD_OPS`, which default to 1 here.
An op that is requested but incompatible is skipped with its reason; the exit code is 1 when a
requested, compatible op failed to build.
"""

from __future__ import annotations

import argparse
import os
import sys

from zerospeed.ops.op_builder.all_ops import ALL_OPS, get_builder
from zerospeed.ops.op_builder.builder import OpBuilder, OpBuildError


def _env_flag(*names: str, default: bool) -> bool:
    for name in names:
        if os.environ.get(name) not in (None, ""):
            return os.environ[name] not in ("0", "false", "False")
    return default


def requested_ops() -> list[OpBuilder]:
    build_all = _env_flag("ZS_BUILD_OPS", "DS_BUILD_OPS", default=True)
    return [builder for builder in ALL_OPS.values()
            if _env_flag(builder.BUILD_VAR, builder.BUILD_VAR.replace("ZS_", "DS_", 1), default=build_all)]


def prebuild(builders: list[OpBuilder], verbose: bool = False) -> int:
    failures = 0
    for builder in builders:
        if not builder.is_compatible():
            print(f"skipping {builder.NAME}: {builder.error_log}")
            continue
        try:
            builder.load(verbose=verbose)
        except OpBuildError as error:
            print(f"FAILED {builder.NAME}: {error}", file=sys.stderr)
            failures += 1
            continue
        state = "cached" if builder.last_load_was_cache_hit else "built"
        print(f"{builder.NAME}: {state} in {builder.build_dir()}")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zerospeed.ops.op_builder")
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("prebuild", help="compile ops into the extension cache")
    build.add_argument("--ops", nargs="+", choices=sorted(ALL_OPS), help="ops to build (default: env vars)")
    build.add_argument("--verbose", action="store_true", help="show the compiler's output")
    args = parser.parse_args(argv)
    builders = [get_builder(name) for name in args.ops] if args.ops else requested_ops()
    return prebuild(builders, verbose=args.verbose)


if __name__ == "__main__":
    sys.exit(main())
