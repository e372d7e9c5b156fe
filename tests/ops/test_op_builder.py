"""OpBuilder: registry, SIMD flags, cache key, JIT build from empty cache, cache reuse, prebuild."""

import inspect
import os
import subprocess
import sys
import time

import pytest

from zerospeed.ops import op_builder
from zerospeed.ops.op_builder import ALL_OPS, CPUAdamBuilder, OpBuilder, OpBuildError
from zerospeed.ops.op_builder import __main__ as prebuild_cli
from zerospeed.ops.op_builder import cpu_features


def test_registry_lists_every_builder_class():
    classes = {obj.NAME for _, obj in inspect.getmembers(op_builder, inspect.isclass)
               if issubclass(obj, OpBuilder) and obj is not OpBuilder}
    assert classes == set(ALL_OPS) == {"cpu_adam", "cpu_adagrad", "cpu_lion"}
    assert {b.BUILD_VAR for b in ALL_OPS.values()} == {"ZS_BUILD_CPU_ADAM", "ZS_BUILD_CPU_ADAGRAD",
                                                       "ZS_BUILD_CPU_LION"}


def test_simd_detection_from_cpu_flags_and_compiler_macros():
    assert cpu_features._from_cpu_flags({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"}) == "avx512"
    assert cpu_features._from_cpu_flags({"avx2", "fma", "f16c", "avx512f"}) == "avx2"
    assert cpu_features._from_cpu_flags({"asimd", "fp"}) == "neon"
    assert cpu_features._from_cpu_flags({"sse2"}) == "scalar"
    assert cpu_features._from_compiler_macros({"__AVX2__", "__FMA__", "__F16C__"}) == "avx2"
    assert cpu_features._from_compiler_macros({"__ARM_NEON"}) == "neon"
    assert "-D__AVX512__" in cpu_features.simd_flags("avx512")
    assert cpu_features.simd_width("avx2") == 8


def test_zs_simd_overrides_detection_and_changes_the_cache_key(monkeypatch):
    builder = CPUAdamBuilder()
    monkeypatch.setenv("ZS_SIMD", "scalar")
    scalar_key = builder.cache_key()
    assert "-D__SCALAR__" in builder.cxx_args()
    monkeypatch.setenv("ZS_SIMD", "avx2")
    assert builder.cache_key() != scalar_key
    monkeypatch.setenv("ZS_SIMD", "sse9")
    with pytest.raises(ValueError, match="ZS_SIMD"):
        builder.cxx_args()


def test_cache_root_honours_zs_then_torch_extensions_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("ZS_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch"))
    assert op_builder.extensions_root() == tmp_path / "torch" / "zerospeed"
    monkeypatch.setenv("ZS_EXTENSIONS_DIR", str(tmp_path / "zs"))
    assert CPUAdamBuilder().build_dir().parent == tmp_path / "zs" / "zerospeed"


def test_missing_compiler_is_incompatible_with_a_reason(monkeypatch, tmp_path):
    monkeypatch.setenv("ZS_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    builder = CPUAdamBuilder()
    assert not builder.is_compatible()
    assert "no C++ compiler" in builder.error_log and "/nonexistent/c++" in builder.error_log
    with pytest.raises(OpBuildError, match="no C\\+\\+ compiler"):
        builder.load()


def test_jit_build_from_empty_cache_then_reuse(built_ops):
    for name, (builder, _) in built_ops.items():
        assert builder.is_installed()
        fresh = type(builder)()
        fresh.load()
        assert fresh.last_load_was_cache_hit, name


def test_a_new_process_imports_the_cached_build_without_compiling(built_ops, extensions_dir):
    # CXX points nowhere: a rebuild would fail, so success proves the .so on disk was reused.
    code = ("import time; t = time.perf_counter()\n"
            "from zerospeed.ops.op_builder import ALL_OPS\n"
            "for b in ALL_OPS.values(): b.load(); assert b.last_load_was_cache_hit, b.NAME\n"
            "print(time.perf_counter() - t)")
    env = {**os.environ, "ZS_EXTENSIONS_DIR": str(extensions_dir), "CXX": "/nonexistent/c++"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    seconds_to_load_all = float(result.stdout.strip().splitlines()[-1])
    slowest_build = max(seconds for _, seconds in built_ops.values())
    assert seconds_to_load_all < slowest_build


def test_prebuild_cli_reports_cached_ops(built_ops, capsys):
    assert prebuild_cli.main(["prebuild", "--ops", "cpu_adam", "cpu_lion"]) == 0
    output = capsys.readouterr().out
    assert "cpu_adam: cached" in output and "cpu_lion: cached" in output


def test_prebuild_env_vars_select_ops(monkeypatch):
    monkeypatch.setenv("ZS_BUILD_OPS", "0")
    monkeypatch.setenv("DS_BUILD_CPU_LION", "1")
    assert [b.NAME for b in prebuild_cli.requested_ops()] == ["cpu_lion"]
    monkeypatch.setenv("ZS_BUILD_OPS", "1")
    monkeypatch.setenv("ZS_BUILD_CPU_ADAM", "0")
    assert sorted(b.NAME for b in prebuild_cli.requested_ops()) == ["cpu_adagrad", "cpu_lion"]


def test_load_is_cached_per_process(built_ops):
    builder, _ = built_ops["cpu_adam"]
    started = time.perf_counter()
    assert builder.load() is builder.load()
    assert time.perf_counter() - started < 0.5


def test_extension_module_names_cannot_collide_with_deepspeeds():
    """DeepSpeed registers its JIT ops as `cpu_adam`, `cpu_adagrad`, ...; ours must not take those
    names in sys.modules, or a process that loads both gets the wrong module."""
    from zerospeed.ops.op_builder.all_ops import ALL_OPS

    for builder in ALL_OPS.values():
        assert builder.extension_name.startswith("zerospeed_") and builder.extension_name != builder.NAME
