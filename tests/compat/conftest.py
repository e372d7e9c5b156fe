"""tests/compat: real DeepSpeed 0.19.8 and zerospeed run the same scripts (marker `compat`).

The suite's main run is shared by several test files because every run starts DeepSpeed afresh:
`saved_runs` (phase 1) trains every case on both libraries, saves, converts the checkpoint with
zero_to_fp32 and continues; `cross_loaded` (phase 2) loads each library's checkpoints into the
other and continues from there.
"""

import os

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
COMPAT_TIMEOUT_S = 1800


def pytest_collection_modifyitems(config, items):
    for item in items:
        if str(item.fspath).startswith(_HERE):
            item.add_marker(pytest.mark.compat)
            # the first test pays for the shared runs (two DeepSpeed + two zerospeed launches)
            item.add_marker(pytest.mark.timeout(COMPAT_TIMEOUT_S))


@pytest.fixture(autouse=True)
def _deepspeed_installed():
    from compat_harness import require_deepspeed

    require_deepspeed()


@pytest.fixture(scope="session")
def compat_root():
    """Our own directory, not pytest's basetemp: concurrent pytest sessions of the same user
    prune old basetemps, and this suite's runs take minutes."""
    import pathlib
    import shutil
    import tempfile

    root = tempfile.mkdtemp(prefix="zs-compat-suite-")
    yield pathlib.Path(root)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def saved_runs(compat_root):
    """Phase 1, {impl: per-rank results}: every case trained, saved, converted and continued."""
    from compat_cases import ALL_CASES, RESUME_STEPS, STEPS, TRAIN_SCRIPT
    from compat_harness import require_deepspeed, run_both

    require_deepspeed()
    return run_both(TRAIN_SCRIPT, str(compat_root / "saved"), cases=ALL_CASES, steps=STEPS,
                    resume_steps=RESUME_STEPS)


@pytest.fixture(scope="session")
def cross_loaded(compat_root, saved_runs):
    """Phase 2, {impl: per-rank results of loading OTHER[impl]'s checkpoints and continuing}."""
    from concurrent.futures import ThreadPoolExecutor

    from compat_cases import ALL_CASES, OTHER, RESUME_STEPS, STEPS, TRAIN_SCRIPT
    from compat_harness import run_script

    with ThreadPoolExecutor(2) as pool:   # concurrently: each library loads the other's files
        futures = {impl: pool.submit(run_script, TRAIN_SCRIPT, impl, str(compat_root / f"{impl}-loads-{other}"),
                                     cases=ALL_CASES, steps=STEPS, load_from=str(compat_root / "saved" / other),
                                     resume_steps=RESUME_STEPS)
                   for impl, other in OTHER.items()}
        return {impl: future.result() for impl, future in futures.items()}
