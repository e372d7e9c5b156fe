"""Which SIMD instruction set the host CPU offers, and the compiler flags that target it.

Detection reads the CPU flags from /proc/cpuinfo (Linux) and falls back to asking the compiler
what `-march=native` enables (macOS, containers that hide /proc). `ZS_SIMD` (avx512 | avx2 | neon
| scalar) overrides both, e.g. to build the scalar path on an AVX-512 machine.
"""

from __future__ import annotations

import functools
import os
import platform
import subprocess

__all__ = ["SIMD_LEVELS", "detect_simd", "simd_flags", "simd_width"]

SIMD_LEVELS = ("avx512", "avx2", "neon", "scalar")

# The flags per level. The `-D__AVX512__`-style macros are DeepSpeed's names for the same thing;
# kernels may test them. -mf16c gives the vectorised float -> fp16 conversion of the copy-out.
_FLAGS: dict[str, list[str]] = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-mf16c",
               "-mprefer-vector-width=512", "-D__AVX512__"],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-D__AVX256__"],
    "neon": ["-D__NEON__"],  # NEON is baseline on aarch64: no -m flag needed
    "scalar": ["-D__SCALAR__"],
}
_WIDTH_FP32 = {"avx512": 16, "avx2": 8, "neon": 4, "scalar": 1}


def _from_cpu_flags(flags: set[str]) -> str:
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        return "avx512"
    if {"avx2", "fma", "f16c"} <= flags:
        return "avx2"
    if "asimd" in flags or "neon" in flags:
        return "neon"
    return "scalar"


def _cpuinfo_flags() -> set[str] | None:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):  # x86 names it flags, arm Features
                    return set(value.split())
    except OSError:
        pass
    return None


def _compiler_macros(cxx: str) -> set[str] | None:
    try:
        result = subprocess.run([cxx, "-march=native", "-dM", "-E", "-x", "c++", os.devnull],
                                capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if result.returncode != 0:
        return None
    return {line.split()[1] for line in result.stdout.splitlines() if line.startswith("#define ")}


def _from_compiler_macros(macros: set[str]) -> str:
    if {"__AVX512F__", "__AVX512BW__", "__AVX512VL__"} <= macros:
        return "avx512"
    if {"__AVX2__", "__FMA__", "__F16C__"} <= macros:
        return "avx2"
    if "__ARM_NEON" in macros:
        return "neon"
    return "scalar"


@functools.cache
def _detected(cxx: str) -> str:
    flags = _cpuinfo_flags()
    if flags is not None:
        return _from_cpu_flags(flags)
    macros = _compiler_macros(cxx)
    if macros is not None:
        return _from_compiler_macros(macros)
    return "neon" if platform.machine() in ("aarch64", "arm64") else "scalar"


def detect_simd(cxx: str = "c++") -> str:
    """The SIMD level to build for: `ZS_SIMD` if set, else what the host CPU supports."""
    forced = os.environ.get("ZS_SIMD")
    if forced:
        if forced not in SIMD_LEVELS:
            raise ValueError(f"ZS_SIMD={forced!r} is not one of {', '.join(SIMD_LEVELS)}")
        return forced
    return _detected(cxx)


def simd_flags(level: str) -> list[str]:
    return list(_FLAGS[level])


def simd_width(level: str) -> int:
    """fp32 lanes per vector register at `level`."""
    return _WIDTH_FP32[level]
