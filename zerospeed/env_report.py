"""`zerospeed-report` (DeepSpeed's `ds_report`): native op status and the build environment.

Section 1 lists every op in `ALL_OPS` as `name ..... [YES]|[NO] ..... [OKAY]|[NO]`: installed
means a build for the current sources, flags and torch is in the extension cache (so it loads
without a compiler); compatible means it can be JIT-built here. Section 2 prints the
environment: torch, compiler, ninja, SIMD level, accelerator.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

import torch

from zerospeed.ops.op_builder import ALL_OPS, extensions_root
from zerospeed.ops.op_builder.cpu_features import detect_simd

__all__ = ["main", "op_report", "env_info"]

_GREEN, _YELLOW, _RED, _END = "\033[92m", "\033[93m", "\033[91m", "\033[0m"
_COLUMN = 23


def _tag(text: str, ok: bool, color: bool) -> str:
    tag = f"[{text}]"
    return f"{_GREEN if ok else _YELLOW}{tag}{_END}" if color else tag


def _dots(label: str, width: int) -> str:
    return label + " " + "." * max(width - len(label), 2)


def op_report(color: bool = False, show_errors: bool = True) -> str:
    from torch.utils.cpp_extension import is_ninja_available

    ninja_ok = is_ninja_available()
    lines = ["-" * 50, "zerospeed C++ extension op report", "-" * 50,
             "NOTE: Ops not installed will be just-in-time (JIT) compiled at\n"
             "      runtime if needed. Op compatibility means that your system\n"
             "      meet the required dependencies to JIT install the op.",
             "-" * 50, "JIT compiled ops requires ninja",
             f"{_dots('ninja', 18)} {_tag('OKAY' if ninja_ok else 'FAIL', ninja_ok, color)}",
             "-" * 50, f"{_dots('op name', _COLUMN)} installed .. compatible", "-" * 50]
    errors = []
    for name, builder in sorted(ALL_OPS.items()):
        installed, compatible = builder.is_installed(), builder.is_compatible()
        installed_text = "YES" if installed else "NO"
        dots = "." * (9 - len(installed_text))  # keeps the compatible column aligned
        lines.append(f"{_dots(name, _COLUMN)} {_tag(installed_text, installed, color)} {dots} "
                     f"{_tag('OKAY' if compatible else 'NO', compatible, color)}")
        if not compatible:
            errors.append(f"{name}: {builder.error_log}")
    lines.append("-" * 50)
    if show_errors and errors:
        lines += [f"{_RED if color else ''}[WARNING]{_END if color else ''} {error}" for error in errors]
    return "\n".join(lines)


def _command_version(command: list[str]) -> str:
    if shutil.which(command[0]) is None:
        return f"not found ({command[0]})"
    try:
        output = subprocess.run(command, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError) as error:
        return f"error: {error}"
    return output.splitlines()[0].strip() if output else "unknown"


def _accelerator_line() -> str:
    try:
        from zerospeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        return f"{accelerator.device_name()} (devices: {accelerator.device_count()})"
    except Exception as error:  # the report must print even when the accelerator cannot start
        return f"unavailable: {error}"


def _shm_size() -> str:
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return "unknown"
    size_bytes = stat.f_frsize * stat.f_blocks
    warning = "  [WARNING] /dev/shm below 512MB may limit multi-process data loading" if size_bytes < 512 << 20 else ""
    return f"{size_bytes / (1 << 30):.2f} GB{warning}"


def env_info() -> list[tuple[str, str]]:
    import zerospeed

    cxx = os.environ.get("CXX", "c++")
    return [
        ("torch install path", str(os.path.dirname(torch.__file__))),
        ("torch version", torch.__version__),
        ("zerospeed install path", str(os.path.dirname(zerospeed.__file__))),
        ("zerospeed info", zerospeed.__version__),
        ("torch cuda version", str(torch.version.cuda)),
        ("torch hip version", str(getattr(torch.version, "hip", None))),
        ("python version", sys.version.split()[0]),
        ("C++ compiler", f"{cxx}: {_command_version([cxx.split()[0], '--version'])}"),
        ("ninja", _command_version(["ninja", "--version"])),
        ("SIMD level", detect_simd(cxx)),
        ("OpenMP threads (torch)", str(torch.get_num_threads())),
        ("extension cache", str(extensions_root())),
        ("accelerator", _accelerator_line()),
        ("shared memory (/dev/shm) size", _shm_size()),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zerospeed-report", description=__doc__.splitlines()[0])
    parser.add_argument("--hide_operator_status", action="store_true", help="skip the op table")
    parser.add_argument("--hide_errors_and_warnings", action="store_true", help="skip why ops are incompatible")
    args = parser.parse_args(argv)
    color = sys.stdout.isatty()
    if not args.hide_operator_status:
        print(op_report(color=color, show_errors=not args.hide_errors_and_warnings))
    print("zerospeed general environment info:")
    for name, value in env_info():
        print(f"{_dots(name, 33)} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
