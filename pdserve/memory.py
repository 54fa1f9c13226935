"""Giving freed heap back to the operating system after a burst.

After thousands of requests come and go, CPython and glibc keep the freed memory in their
arenas: measured on ``pdserve serve`` after a 2,000-request burst, the API server's RSS
stayed 29 % and the decode worker's 12 % above where they started, all of it free heap.
:func:`release_free_memory` runs a full garbage collection and glibc's ``malloc_trim(0)``,
which returns free pages at the top of each arena (and, since glibc 2.8, whole free pages
inside them) to the kernel. Processes call it once they go idle after being busy, never
on the hot path.
"""

from __future__ import annotations

import ctypes
import gc
import logging

logger = logging.getLogger(__name__)

try:
    _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
except (OSError, AttributeError):  # not glibc: collection only
    _malloc_trim = None


def release_free_memory() -> None:
    """Collect garbage and return free heap pages to the OS (glibc); never raises."""
    try:
        gc.collect()
        if _malloc_trim is not None:
            _malloc_trim(0)
    except Exception:  # best effort
        logger.debug("releasing free memory failed", exc_info=True)


class IdleTrimmer:
    """Calls :func:`release_free_memory` once per busy period, when it has been idle for
    ``idle_s`` seconds.

    Call :meth:`tick` regularly with whether the process is busy now.
    """

    def __init__(self, idle_s: float = 2.0) -> None:
        self.idle_s = idle_s
        self._was_busy = False
        self._idle_since: float | None = None

    def tick(self, busy: bool, now_s: float) -> bool:
        """Returns True when it released memory on this call."""
        if busy:
            self._was_busy, self._idle_since = True, None
            return False
        if not self._was_busy:
            return False
        if self._idle_since is None:
            self._idle_since = now_s
            return False
        if now_s - self._idle_since < self.idle_s:
            return False
        self._was_busy, self._idle_since = False, None
        release_free_memory()
        return True
