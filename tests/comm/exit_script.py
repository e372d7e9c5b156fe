"""A rank that ends right after its collectives, without destroying its groups (what most training
scripts do). Usage: ``exit_script.py MODE`` where MODE is ``zerospeed`` (groups made by
``zerospeed.init_distributed``), ``torch`` (zerospeed imported, groups made by torch.distributed) or ``raise`` (zerospeed, then
an uncaught exception). Prints whether the default group is still initialized when the last
``atexit`` handler registered before zerospeed's runs (handlers run last-in first-out).
"""

from __future__ import annotations

import atexit
import sys

import torch
import torch.distributed as dist

MODE = sys.argv[1]
atexit.register(lambda: print(f"initialized after teardown: {dist.is_initialized()}", flush=True))
if MODE == "torch":
    import zerospeed  # noqa: F401 - imported, but the groups are torch's own

    dist.init_process_group("gloo")
else:
    from zerospeed import comm

    comm.init_distributed(dist_backend="gloo", verbose=False)
held = torch.ones(4096)  # a global, so the worker's reference is not the tensor's last
subgroup = dist.new_group([0, 1])
for _ in range(5):
    dist.broadcast(held, 0)
    dist.all_reduce(held, group=subgroup)
if MODE == "raise":
    raise RuntimeError("the script failed")
