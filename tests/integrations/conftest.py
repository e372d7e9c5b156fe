"""tests/integrations: client libraries (transformers, accelerate, peft, trl, lightning) on zerospeed
through the `deepspeed` alias, side by side with real DeepSpeed 0.19.8 (marker `compat`)."""

import os
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if str(item.fspath).startswith(_HERE):
            item.add_marker(pytest.mark.compat)


@pytest.fixture(scope="session")
def alias_dir(tmp_path_factory):
    """The `deepspeed` alias built from integrations/deepspeed-alias into a throwaway directory
    (never into the environment: the venv's real DeepSpeed stays the reference)."""
    from client_runs import build_alias

    return build_alias(str(tmp_path_factory.mktemp("alias")))
