"""Restarting the workers ``pdserve serve`` runs as its child processes.

NOTE: a worker that exits while the server serves (not while it drains or stops) is started
again with the same command line under a new worker id (``decode-<pid>-0`` becomes
``decode-<pid>-0-r1``): the dead process's id stays in the router's registry, holding its
in-flight requests, until liveness drops it, and a fresh process must not be mistaken for it.

The delay before a restart doubles with each exit that comes soon after the last start
(``initial_backoff_s``, ``2 x``, ... up to ``max_backoff_s``) and starts over once a worker
has stayed up ``stable_uptime_s``; past ``max_restarts`` restarts within ``window_s`` the
worker stays down. Everything here runs on the server's event loop, in its main thread (the
children's parent-death signal is tied to the thread that forked them).
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

#: Most doublings of the restart delay (keeps ``2 ** n`` small; the cap is reached long before).
_MAX_DOUBLINGS = 16


@dataclass(frozen=True)
class RestartPolicy:
    """When a worker that exited is started again.

    Attributes:
        max_restarts: restarts of one worker allowed within ``window_s``; past them it
            stays down. 0: never restart.
        window_s: the sliding window ``max_restarts`` counts over, in seconds.
        initial_backoff_s: delay before a restart after a worker that had stayed up.
        max_backoff_s: the cap on the delay, which doubles with each quick exit in a row.
        stable_uptime_s: a worker up at least this long before it exits counts as having
            stayed up (its next delay is ``initial_backoff_s`` again).

    Raises:
        ValueError: naming the field that is out of range.
    """

    max_restarts: int = 5
    window_s: float = 600.0
    initial_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    stable_uptime_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        for name in ("window_s", "stable_uptime_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.initial_backoff_s >= 0:
            raise ValueError(f"initial_backoff_s must be >= 0, got {self.initial_backoff_s}")
        if not self.max_backoff_s >= self.initial_backoff_s:
            raise ValueError(f"max_backoff_s must be >= initial_backoff_s "
                             f"({self.initial_backoff_s}), got {self.max_backoff_s}")

    @property
    def use_restarts(self) -> bool:
        """Whether workers are restarted at all."""
        return self.max_restarts > 0

    def backoff_s(self, num_quick_exits: int) -> float:
        """Delay before the restart that follows ``num_quick_exits`` quick exits in a row
        (0 for the first exit after a worker stayed up)."""
        return min(self.max_backoff_s,
                   self.initial_backoff_s * 2 ** min(num_quick_exits, _MAX_DOUBLINGS))


def exit_description(returncode: int) -> str:
    """How a process ended, from its ``Popen.returncode``: "was killed by SIGKILL",
    "exited with code 1"."""
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


@dataclass
class SupervisedWorker:
    """One worker slot: its current process and its restart history.

    Attributes:
        role: "decode", "prefill", or "api" (an extra API server of ``--api-servers``).
        base_id: the first process's worker id; restarts append ``-r<n>``.
        start: starts a process for this slot under the given worker id.
        proc: the current (or last) process.
        started_s: ``time.monotonic()`` when ``proc`` was started.
        worker_id: ``proc``'s worker id.
        num_restarts: restarts so far (numbers the ids).
        num_quick_exits: exits in a row before ``stable_uptime_s``: the backoff exponent.
        restart_times_s: when the restarts within the current window were decided.
        restart_at_s: when the pending restart is due; None when none is pending.
        has_given_up: the slot hit ``max_restarts`` (or restarts are off): it stays down.
    """

    role: str
    base_id: str
    start: Callable[[str], subprocess.Popen]
    proc: subprocess.Popen
    started_s: float = field(default_factory=time.monotonic)
    worker_id: str = ""
    num_restarts: int = 0
    num_quick_exits: int = 0
    restart_times_s: deque[float] = field(default_factory=deque)
    restart_at_s: float | None = None
    has_given_up: bool = False

    def __post_init__(self) -> None:
        self.worker_id = self.worker_id or self.base_id

    @property
    def kind(self) -> str:
        """What the slot runs, for log lines: "decode worker", "API server", ..."""
        return "API server" if self.role == "api" else f"{self.role} worker"

    @property
    def is_running(self) -> bool:
        """Whether the current process has not exited."""
        return self.proc.poll() is None


class WorkerSupervisor:
    """Notices workers that exit and starts them again under ``policy``.

    Args:
        workers: the slots, each with its first process already started.
        policy: backoff and limit.
        is_stopping: True while the server drains or stops: exits are expected then, and
            nothing is restarted.
        on_restart: called with a worker's role on each restart (the metric).
        on_exit: called with a worker's id as soon as its process is seen to have exited
            (the router drops it at once instead of waiting for missed heartbeats).
    """

    def __init__(self, workers: list[SupervisedWorker], policy: RestartPolicy,
                 is_stopping: Callable[[], bool] = lambda: False,
                 on_restart: Callable[[str], None] = lambda role: None,
                 on_exit: Callable[[str], None] = lambda worker_id: None) -> None:
        self.workers = workers
        self.policy = policy
        self.is_stopping = is_stopping
        self.on_restart = on_restart
        self.on_exit = on_exit

    @property
    def processes(self) -> list[subprocess.Popen]:
        """Every slot's current process (for stopping them all)."""
        return [w.proc for w in self.workers]

    @property
    def num_running(self) -> int:
        """Slots whose process has not exited."""
        return sum(w.is_running for w in self.workers)

    async def run(self, period_s: float = 0.5) -> None:
        """Check the workers every ``period_s`` until cancelled."""
        while True:
            await asyncio.sleep(period_s)
            self.check()

    def check(self, now_s: float | None = None) -> None:
        """Notice exits and start the restarts that are due; never waits for a process."""
        if self.is_stopping():
            return
        now_s = time.monotonic() if now_s is None else now_s
        for w in self.workers:
            if w.restart_at_s is not None:
                if now_s >= w.restart_at_s:
                    self._restart(w, now_s)
            elif not w.has_given_up and not w.is_running:
                self._on_exit(w, f"{w.kind} {w.worker_id} (pid {w.proc.pid}) "
                                 f"{exit_description(w.proc.returncode)}", now_s)

    def _on_exit(self, w: SupervisedWorker, what: str, now_s: float) -> None:
        """Schedule ``w``'s restart after its backoff, or give up on it; ``what`` says
        what happened, for the log line."""
        self.on_exit(w.worker_id)
        p = self.policy
        serving_on = f"serving on with {self.num_running} of {len(self.workers)} workers"
        if not p.use_restarts:
            w.has_given_up = True
            _say(f"{what}; {serving_on} (restarts are off: --max-worker-restarts 0)")
            return
        while w.restart_times_s and now_s - w.restart_times_s[0] > p.window_s:
            w.restart_times_s.popleft()
        if len(w.restart_times_s) >= p.max_restarts:
            w.has_given_up = True
            _say(f"error: {what}; it was restarted {len(w.restart_times_s)} times within "
                 f"{p.window_s:.0f} s (--max-worker-restarts): not restarting it again; "
                 f"{serving_on}")
            return
        if now_s - w.started_s >= p.stable_uptime_s:
            w.num_quick_exits = 0
        delay_s = p.backoff_s(w.num_quick_exits)
        w.num_quick_exits += 1
        w.restart_times_s.append(now_s)
        w.restart_at_s = now_s + delay_s
        _say(f"{what}; restarting it in {delay_s:.1f} s (restart {len(w.restart_times_s)} of "
             f"at most {p.max_restarts} within {p.window_s:.0f} s)")

    def _restart(self, w: SupervisedWorker, now_s: float) -> None:
        """Start ``w`` again under a new worker id, now."""
        w.restart_at_s = None
        worker_id = f"{w.base_id}-r{w.num_restarts + 1}"
        try:
            proc = w.start(worker_id)
        except OSError as exc:
            w.started_s = now_s
            self._on_exit(w, f"{w.kind} {w.worker_id} could not be restarted as "
                             f"{worker_id} ({exc})", now_s)
            return
        old_id = w.worker_id
        w.proc, w.worker_id, w.started_s = proc, worker_id, now_s
        w.num_restarts += 1
        self.on_restart(w.role)
        _say(f"restarted {w.kind} {old_id} as {worker_id} (pid {proc.pid})")


def _say(message: str) -> None:
    """One line for the operator on stderr, like the rest of ``pdserve serve``'s."""
    print(f"pdserve: {message}", file=sys.stderr, flush=True)
