"""Keep the host memory a CPU step frees for the next step (glibc ``malloc`` settings).

A CPU prefill step allocates its GEMM inputs and outputs afresh in every layer (torch
tensors of 1-25 MB: ``[rows, features]`` in bf16) and frees them again. glibc serves
blocks above its mmap threshold with ``mmap`` and gives them back with ``munmap``, and it
trims the heap's free top back to the kernel; either way the next layer's tensor touches
fresh pages, and each first touch is a page fault that zeroes a page. On a 2-core Xeon
with AMX, a 1,500-token prompt's prefill spent 18 % of its CPU samples in the kernel
(``exc_page_fault``, ``clear_page``, memory-cgroup accounting; ``perf``), and the dynamic
mmap threshold, which glibc raises only after a block it freed, did not prevent it.
:func:`keep_freed_memory` pins the threshold at its maximum and stops the trimming: the
step's blocks are then reused from the heap (the kernel's share 18 -> 3 %; the prefill
step 290-300 -> 273-283 ms median, a 32 x 128-token batch 778-784 -> 734-740 ms, the same
runs alternating). The cost is that memory a step used stays in the process for the next
one (its peak, which it reaches anyway, not more).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

# mallopt(3) parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

#: Largest mmap threshold glibc accepts on 64-bit hosts (HEAP_MAX_SIZE / 2): blocks below
#: it come from the heap.
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024

#: Free memory at the heap's top that glibc may keep instead of returning it (bytes; the
#: largest value mallopt's int takes, ~2 GiB).
TRIM_THRESHOLD_BYTES = 2**31 - 1

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Set glibc's mmap threshold to :data:`MMAP_THRESHOLD_BYTES` and its trim threshold
    to :data:`TRIM_THRESHOLD_BYTES` for this process (once; later calls return the first
    result). Returns whether both took effect: False on a C library without ``mallopt``
    (musl, macOS) or where glibc refused a value; nothing is raised.
    """
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        logger.debug("no mallopt in this C library: malloc settings left as they are")
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
          and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1)
    if not ok:
        logger.debug("mallopt refused the thresholds: malloc settings partly unchanged")
    _applied = ok
    return ok
