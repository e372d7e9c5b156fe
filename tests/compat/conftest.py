"""tests/compat: real DeepSpeed 0.19.8 and zerospeed run the same scripts (marker `compat`)."""

import os

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if str(item.fspath).startswith(_HERE):
            item.add_marker(pytest.mark.compat)


@pytest.fixture(autouse=True)
def _deepspeed_installed():
    from compat_harness import require_deepspeed

    require_deepspeed()
