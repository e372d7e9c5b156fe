import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("ZS_ACCELERATOR", "cpu")


@pytest.fixture(scope="session", autouse=True)
def _close_rank_pools():
    yield
    from distributed import shutdown_all_pools

    shutdown_all_pools()
