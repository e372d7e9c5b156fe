"""Tear the gloo process groups down at interpreter exit, while Python can still run threads.

[Note: gloo exit abort]
A gloo collective runs on one of the group's C++ worker threads. When it finishes, the waiting
Python call returns at once, and the worker drops its reference to the op's tensors a moment later.
Since torch 2.13 dropping a C++ reference to a tensor that Python also holds decrefs the Python
object, so the worker takes the GIL. If the script has just ended and the interpreter is already
finalizing, taking the GIL ends the thread with a forced unwind through C++ code that may not
throw: ``terminate called without an active exception``, SIGABRT, exit code -6 after all the
work was done (a core dump shows ``ProcessGroupGloo::runLoop`` -> ``~AsyncWork`` ->
``decref_pyobject`` -> ``take_gil`` -> ``PyThread_exit_thread``; pytorch/pytorch#190489).
Measured: 9 of 20 two-rank runs of a script ending right after five broadcasts and all-reduces
aborted; the tests that launch ranks with torchrun or mpirun failed one run in three.

`register()` (called by ``init_distributed``) adds an ``atexit`` handler, which Python runs before
it finalizes: it destroys every process group and collects garbage, so the workers finish their
last op (they get the GIL while the handler waits in C++) and are joined when nothing else holds
their group. Measured on the same script, with a subgroup still held by a global: 0 of 40 runs
aborted. Before a script's own ``destroy_process_group()`` nothing changes: the handler finds no
group and does nothing.

It does nothing while an uncaught exception ends the process: the job must fail fast, and nothing
here may wait for peers that are blocked. NCCL groups are left alone: this abort was seen with gloo
only, and torch's NCCL shutdown at exit cannot be tested on these machines.
"""

from __future__ import annotations

import atexit
import gc
import sys

import torch.distributed as dist

__all__ = ["register"]

_registered = False


def register() -> None:
    """Arrange the teardown at exit (once per process)."""
    global _registered
    if not _registered:
        atexit.register(_tear_down_at_exit)
        _registered = True


def _tear_down_at_exit() -> None:
    if not dist.is_available() or not dist.is_initialized() or _ending_on_an_exception():
        return
    if "gloo" not in str(dist.get_backend()):
        return
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort at exit: a failure here must not mask the script's result
        return
    gc.collect()


def _ending_on_an_exception() -> bool:
    # Python records the exception that ended the script before it runs the atexit handlers.
    return getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None
