"""The `deepspeed` alias (integrations/deepspeed-alias), built with pip into a throwaway directory:
what `import deepspeed` gives, the metadata clients check, the console command, opting out."""

import json
import os
import subprocess
import sys

from client_runs import SCRIPTS, client_env

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version


@pytest.fixture(scope="module")
def probe(alias_dir):
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, "alias_probe.py")], env=client_env(alias_dir),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_deepspeed_is_zerospeed_module_for_module(probe):
    assert probe["spec_before"] and probe["is_zerospeed"]
    assert probe["same_engine_module"] and probe["same_class"] and probe["no_double_import"]
    assert probe["patch_lands"]


def test_metadata_tells_the_api_level_and_that_it_is_zerospeed(probe):
    version = probe["dist_version"]
    assert version == probe["__version__"] == "0.19.8+zerospeed.0.1.0" and probe["metadata_name"] == "deepspeed"
    # The comparisons clients make (transformers >=0.9.3, Lightning >=0.16.0, accelerate's gates).
    for spec in (">=0.9.3", ">=0.16.0", ">=0.14.4", ">=0.16.4", ">=0.18.2", "==0.19.8"):
        assert SpecifierSet(spec).contains(version), spec
    assert Version(version).local == "zerospeed.0.1.0"


def test_client_symbols_resolve(probe):
    assert probe["missing"] == []
    assert probe["valid_lr_schedules"] == ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]


def test_missing_features_are_named(probe):
    assert "tp_model_init: model must be a torch.nn.Module" in probe["errors"]["tp_model_init"]
    assert "deepspeed.no_such_module" in probe["errors"]["unknown"]


def test_shadowing_a_real_deepspeed_is_said(probe):
    # The venv holds the real DeepSpeed 0.19.8; the alias first on the path hides it, and says so.
    assert len(probe["shadow_warning"]) == 1 and "0.19.8" in probe["shadow_warning"][0]


def test_without_the_alias_deepspeed_is_deepspeed():
    code = "import deepspeed, importlib.metadata as m; print(deepspeed.__file__, m.version('deepspeed'))"
    proc = subprocess.run([sys.executable, "-c", code], env=client_env(None), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "zerospeed" not in proc.stdout and proc.stdout.split()[-1] == "0.19.8"


def test_console_command_is_our_launcher(alias_dir):
    for argv in ([os.path.join(alias_dir, "bin", "deepspeed"), "--help"],
                 [sys.executable, "-m", "deepspeed.launcher.runner", "--help"]):
        proc = subprocess.run(argv, env=client_env(alias_dir), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "zerospeed launcher" in proc.stdout


def test_lightning_deepspeed_strategy_constructs_with_zerospeed(alias_dir):
    """Construction only: training with Lightning's DeepSpeed strategy needs CUDA devices
    (lightning/pytorch/strategies/deepspeed.py checks for them). It used to end in a skip that
    said so, which reported a passing check as skipped."""
    pytest.importorskip("lightning", reason="lightning is not installed (optional: pip install lightning)")
    code = ("from lightning.pytorch.strategies import DeepSpeedStrategy\n"
            "import deepspeed\n"
            "s = DeepSpeedStrategy(stage=3, offload_optimizer=False)\n"
            "assert deepspeed.__name__ == 'zerospeed'\n"
            "print(s.config['zero_optimization']['stage'])\n")
    proc = subprocess.run([sys.executable, "-c", code], env=client_env(alias_dir), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == "3"
