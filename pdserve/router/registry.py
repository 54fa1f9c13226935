"""Registry of workers: registration, heartbeats, liveness and load."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdserve.messages import Heartbeat, RegisterWorker


@dataclass
class WorkerInfo:
    """What the router knows about one worker.

    Attributes:
        info: its registration.
        last_seen_s: ``time.monotonic()`` of its last message.
        load: its last heartbeat (None before the first).
        inflight: request ids the router sent it that have not finished.
    """

    info: RegisterWorker
    last_seen_s: float
    load: Heartbeat | None = None
    inflight: set[str] = field(default_factory=set)

    @property
    def worker_id(self) -> str:
        """The id the worker registered under (its zmq identity)."""
        return self.info.worker_id

    @property
    def is_draining(self) -> bool:
        """The worker said it is shutting down: route nothing new to it."""
        return self.load is not None and self.load.draining

    @property
    def load_score(self) -> int:
        """Requests it holds: reported running + waiting, or the router's count if higher."""
        reported = 0 if self.load is None else self.load.num_running + self.load.num_waiting
        return max(reported, len(self.inflight))


class WorkerRegistry:
    """Workers by id; a worker is alive while its last message is recent enough.

    Args:
        heartbeat_interval_s: the period workers report at.
        max_missed_heartbeats: a worker silent for this many periods is dead.
    """

    def __init__(self, heartbeat_interval_s: float = 1.0, max_missed_heartbeats: int = 3) -> None:
        self.heartbeat_interval_s = heartbeat_interval_s
        self.max_missed_heartbeats = max_missed_heartbeats
        self.workers: dict[str, WorkerInfo] = {}

    def register(self, msg: RegisterWorker) -> WorkerInfo:
        """Add a worker, or refresh the registration of one already known (a restart or a
        re-registration keeps its in-flight set)."""
        worker = self.workers.get(msg.worker_id)
        if worker is None:
            worker = WorkerInfo(msg, time.monotonic())
            self.workers[msg.worker_id] = worker
        else:
            worker.info, worker.last_seen_s = msg, time.monotonic()
        return worker

    def heartbeat(self, msg: Heartbeat) -> WorkerInfo | None:
        """Record a worker's reported load and mark it seen; None for an unknown worker
        (the router then asks it to register again)."""
        worker = self.workers.get(msg.worker_id)
        if worker is not None:
            worker.load = msg
            worker.last_seen_s = time.monotonic()
        return worker

    def touch(self, worker_id: str) -> None:
        """Mark a worker seen now (any message from it is a sign of life)."""
        worker = self.workers.get(worker_id)
        if worker is not None:
            worker.last_seen_s = time.monotonic()

    def is_alive(self, worker: WorkerInfo, now_s: float | None = None) -> bool:
        """Whether ``worker`` was seen within ``max_missed_heartbeats`` periods of
        ``now_s`` (``time.monotonic()`` seconds; default now)."""
        now_s = time.monotonic() if now_s is None else now_s
        return now_s - worker.last_seen_s <= self.heartbeat_interval_s * self.max_missed_heartbeats

    def alive(self, role: str | None = None) -> list[WorkerInfo]:
        """Alive workers, of ``role`` ("prefill" / "decode") or all."""
        now = time.monotonic()
        return [w for w in self.workers.values()
                if self.is_alive(w, now) and (role is None or w.info.role == role)]

    def accepting(self, role: str | None = None) -> list[WorkerInfo]:
        """Alive workers that take new requests (not draining)."""
        return [w for w in self.alive(role) if not w.is_draining]

    def remove_dead(self) -> list[WorkerInfo]:
        """Drop and return the workers that missed too many heartbeats."""
        now = time.monotonic()
        dead = [w for w in self.workers.values() if not self.is_alive(w, now)]
        for w in dead:
            del self.workers[w.worker_id]
        return dead

    def least_loaded(self, role: str) -> WorkerInfo | None:
        """The accepting worker of ``role`` holding the fewest requests (None if none)."""
        candidates = self.accepting(role)
        return min(candidates, key=lambda w: w.load_score) if candidates else None
