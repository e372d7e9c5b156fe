"""Imported once by the warm fork server of the crash trials ([Note: warm ranks] in crash_trials.py).

Imports crash_save.py and then every module named in the file `ZS_CRASH_PRELOAD` (what a finished
rank had imported, written by crash_save.py with ZS_CRASH_MODULES_OUT), so that a forked rank
imports nothing. Only imports: no process group, no tensor work, no thread is started here.
A name that fails to import is skipped: the rank then imports it itself, as a new one would.
"""

import importlib
import os

import crash_save  # noqa: F401 - torch, zerospeed and the test model
import crash_trials  # noqa: F401 - the fork target lives there

_preload = os.environ.get("ZS_CRASH_PRELOAD")
if _preload and os.path.exists(_preload):
    with open(_preload) as _handle:
        for _name in _handle.read().split():
            if _name.startswith(("__main__", "__mp_main__")):
                continue
            try:
                importlib.import_module(_name)
            except Exception:  # noqa: BLE001, S112 - a module that cannot load here loads in the rank
                continue
