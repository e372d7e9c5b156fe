"""`settle_mmap_threshold` ([Note: glibc mmap threshold]), observed through the kernel's fault count.

Each case runs in a fresh interpreter (the threshold is process state): ten rounds of malloc,
touch every page, free, of an 8 MiB block. From glibc's starting threshold the first round is
mapped and faulted, its free raises the threshold, and the second round grows the heap and faults
again: about two blocks of faults. Settled first, the block comes from the heap from the start:
one block of faults, then reuse.
"""

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc's malloc only")

BLOCK_BYTES = 8 << 20
PAGES = BLOCK_BYTES // os.sysconf("SC_PAGE_SIZE")

CHILD = f"""
import ctypes, resource
from zerospeed.utils.host_allocator import settle_mmap_threshold
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
settled = settle_mmap_threshold()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    block = libc.malloc({BLOCK_BYTES})
    ctypes.memset(block, 1, {BLOCK_BYTES})
    libc.free(block)
print(settled, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _run(**env: str) -> tuple[bool, int]:
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "ZS_SETTLE"))}
    child_env.update(env)
    out = subprocess.run([sys.executable, "-c", CHILD], env=child_env, capture_output=True, text=True, check=True)
    settled, faults = out.stdout.split()
    return settled == "True", int(faults)


def test_settled_threshold_serves_repeated_blocks_from_the_heap():
    settled, faults = _run(ZS_SETTLE_MMAP_THRESHOLD="1")
    assert settled
    assert faults <= 1.25 * PAGES, faults


def test_by_default_glibc_starting_threshold_maps_the_first_block_afresh():
    settled, faults = _run()
    assert not settled
    assert faults >= 1.75 * PAGES, faults


def test_a_threshold_fixed_by_the_user_is_left_alone():
    settled, _ = _run(ZS_SETTLE_MMAP_THRESHOLD="1", MALLOC_MMAP_THRESHOLD_=str(1 << 20))
    assert not settled
