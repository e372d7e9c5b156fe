"""Fixtures of the op tests: one empty extension cache per session, each op built once into it."""

import os
import time

import pytest

from zerospeed.ops.op_builder import ALL_OPS


@pytest.fixture(scope="session")
def extensions_dir(tmp_path_factory):
    """Point ZS_EXTENSIONS_DIR at an empty directory for the whole session."""
    root = tmp_path_factory.mktemp("zs_extensions")
    saved = os.environ.get("ZS_EXTENSIONS_DIR")
    os.environ["ZS_EXTENSIONS_DIR"] = str(root)
    yield root
    if saved is None:
        os.environ.pop("ZS_EXTENSIONS_DIR", None)
    else:
        os.environ["ZS_EXTENSIONS_DIR"] = saved


@pytest.fixture(scope="session")
def built_ops(extensions_dir):
    """{op name: (builder, seconds the first load took)}; every op JIT-built from the empty cache."""
    built = {}
    for name, builder in ALL_OPS.items():
        if not builder.is_compatible():
            pytest.skip(f"{name} cannot be built here: {builder.error_log}")
        assert not builder.is_installed(), "the session cache should start empty"
        started = time.perf_counter()
        builder.load()
        built[name] = (builder, time.perf_counter() - started)
        assert builder.last_load_was_cache_hit is False
    return built
