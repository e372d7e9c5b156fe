"""Put on the PYTHONPATH of the reference (real DeepSpeed) side of the client runs only.

[Note: gloo exit abort] (zerospeed/comm/exit_teardown.py): with torch 2.13 and gloo, a rank that
ends without destroying its process groups can abort at interpreter exit after all its work is
done (SIGABRT, exit -6), which fails a reference run whose numbers are all written. zerospeed
registers a teardown in `init_distributed`; DeepSpeed 0.19.8 registers none, so this file does the
same for the reference side's processes: at exit, when torch.distributed was imported and holds a
gloo group, and no uncaught exception is ending the process, destroy the groups before Python
finalizes. It changes no number the run reports. Imports nothing at start-up.
"""

import atexit
import gc
import sys


def _tear_down_gloo_groups_at_exit() -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    if getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None:
        return
    if "gloo" not in str(dist.get_backend()):
        return
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort at exit
        return
    gc.collect()


atexit.register(_tear_down_gloo_groups_at_exit)
