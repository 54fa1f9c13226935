"""Which CPU cores each worker process computes on, and with how many torch threads.

A worker's GEMMs and attention run on torch's intra-op thread pool (OpenMP). Two workers
whose pools both span every core oversubscribe the machine whenever both are busy (a long
prefill on the prefill worker while the decode worker steps): each OpenMP barrier then
waits for threads the kernel has descheduled. ``pdserve serve`` therefore gives every
worker a set of cores (``sched_setaffinity``) and as many torch threads as that set has
cores; :func:`plan_worker_cpus` decides the default split, ``--prefill-cpus`` /
``--decode-cpus`` (serve) and ``--cpus`` / ``--threads`` (a worker) override it.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

from pdserve.core_turns import share_all_cores

logger = logging.getLogger(__name__)


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """``"0-3,6"`` -> ``(0, 1, 2, 3, 6)`` (the kernel's cpulist syntax), sorted, unique.

    Raises:
        ValueError: an empty list, a malformed item, a negative core or a reversed range.
    """
    cpus: set[int] = set()
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        lo, sep, hi = item.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"bad CPU list {text!r}: {item!r} is not N or N-M") from None
        if first < 0 or last < first:
            raise ValueError(f"bad CPU list {text!r}: {item!r} is not a range of cores >= 0")
        cpus.update(range(first, last + 1))
    if not cpus:
        raise ValueError(f"bad CPU list {text!r}: no cores")
    return tuple(sorted(cpus))


def format_cpu_list(cpus: tuple[int, ...]) -> str:
    """Inverse of :func:`parse_cpu_list` (``(0, 1, 2, 6)`` -> ``"0-2,6"``)."""
    parts, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            parts.append(str(start) if start == c else f"{start}-{c}")
            start = None
    return ",".join(parts)


def available_cpus() -> tuple[int, ...]:
    """The cores this process may run on (its affinity mask; all cores where unknown)."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return tuple(range(os.cpu_count() or 1))


@dataclass(frozen=True)
class WorkerCpus:
    """The cores of one worker process and its torch thread count."""

    cpus: tuple[int, ...]
    num_threads: int

    def argv(self) -> list[str]:
        """The worker command-line flags that apply this plan."""
        return ["--cpus", format_cpu_list(self.cpus), "--threads", str(self.num_threads)]


def plan_worker_cpus(cpus: tuple[int, ...], num_prefill: int, num_decode: int,
                     prefill_cpus: tuple[int, ...] | None = None,
                     decode_cpus: tuple[int, ...] | None = None, core_turns: bool = False,
                     ) -> tuple[list[WorkerCpus], list[WorkerCpus]]:
    """Default cores per worker: ``(prefill plans, decode plans)``.

    Decode workers split ``cpus`` evenly among themselves (a decode step is bound by
    streaming the weights, and short prompts are prefilled there too, so the decode pool
    gets every core). Prefill workers share the same cores with one thread fewer than the
    decode worker they overlap (at least one): while a long prompt prefills, the decode
    worker keeps stepping instead of stalling at barriers behind a full second pool.
    With ``core_turns``, where every worker runs on the same cores (they take turns at
    their steps, :mod:`pdserve.core_turns`), prefill workers get a thread per core too.
    Explicit ``prefill_cpus`` / ``decode_cpus`` replace the default for that role (all
    workers of the role share them, threads = their count).
    """
    def split(pool: tuple[int, ...], n: int) -> list[tuple[int, ...]]:
        if n <= 0:
            return []
        if len(pool) < n:
            return [pool] * n
        size = len(pool) // n
        return [pool[i * size:(i + 1) * size if i + 1 < n else len(pool)] for i in range(n)]

    if decode_cpus is not None:
        decode = [WorkerCpus(decode_cpus, len(decode_cpus))] * num_decode
    else:
        decode = [WorkerCpus(c, len(c)) for c in split(cpus, num_decode)]
    if prefill_cpus is not None:
        prefill = [WorkerCpus(prefill_cpus, len(prefill_cpus))] * num_prefill
    else:
        prefill = [WorkerCpus(c, max(1, len(c) - 1) if num_decode else len(c))
                   for c in split(cpus, num_prefill)]
        if core_turns and share_all_cores(prefill + decode):
            prefill = [WorkerCpus(p.cpus, len(p.cpus)) for p in prefill]
    return prefill, decode


def apply_worker_cpus(cpus: tuple[int, ...] | None, num_threads: int | None) -> WorkerCpus:
    """Pin this process to ``cpus`` (None: leave as is) and set torch's intra-op threads
    (None: one per core of the resulting set). Returns what was applied.

    Raises:
        ValueError: ``cpus`` names a core this process may not use, or ``num_threads`` < 1.
    """
    import torch  # noqa: PLC0415 (callers import this module before torch is needed)

    allowed = available_cpus()
    if cpus is not None:
        missing = sorted(set(cpus) - set(allowed))
        if missing:
            raise ValueError(f"--cpus: cores {format_cpu_list(tuple(missing))} are not "
                             f"available to this process (it may use "
                             f"{format_cpu_list(allowed)})")
        try:
            os.sched_setaffinity(0, cpus)
        except (AttributeError, OSError) as exc:  # not Linux, or a restricted container
            logger.warning("cannot set CPU affinity to %s: %s", format_cpu_list(cpus), exc)
            cpus = allowed
    else:
        cpus = allowed
    if num_threads is not None and num_threads < 1:
        raise ValueError(f"--threads must be >= 1, got {num_threads}")
    threads = num_threads or len(cpus)
    torch.set_num_threads(threads)
    return WorkerCpus(cpus, threads)


#: Nice value of a worker's KV transfer threads (sending, receiving).
TRANSFER_THREAD_NICE = 10


def background_priority(nice: int = TRANSFER_THREAD_NICE) -> None:
    """Lower the calling thread's CPU priority to ``nice`` (Linux: the nice value of this
    thread alone, never raised; elsewhere nothing). The KV transfer
    threads call it: on shared cores a finished prompt's KV push (FP8 quantization,
    signing, copies) and its receipt ran beside the decode worker's next step, the one that
    carries a short prompt's prefill, at equal weight; W3 on a 2-core Xeon: a short prompt
    arriving 0.12 s into a 1,539-token prefill waited 0.27 s after that prefill ended."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), nice))
    except (AttributeError, OSError):  # no per-thread priorities here, or not permitted
        pass
