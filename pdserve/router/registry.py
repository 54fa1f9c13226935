"""Registry of workers: registration, heartbeats, liveness and load."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from pdserve.messages import Heartbeat, RegisterWorker

#: Weight of the newest sample in the router's moving averages of a worker's transfers.
EMA_WEIGHT = 0.2
#: Seconds of prefill arrivals a worker's arrival rate is measured over, and the shortest
#: span it divides by (so two requests a moment apart do not read as a flood).
ARRIVAL_WINDOW_S, MIN_ARRIVAL_SPAN_S = 60.0, 10.0


def moving_average(old: float, sample: float) -> float:
    """Exponential moving average with :data:`EMA_WEIGHT`; ``old`` 0 means no history."""
    return sample if old <= 0 else old + EMA_WEIGHT * (sample - old)


@dataclass
class WorkerInfo:
    """What the router knows about one worker.

    Attributes:
        info: its registration.
        last_seen_s: ``time.monotonic()`` of its last message.
        load: its last heartbeat (None before the first).
        inflight: request ids the router sent it that have not finished.
        prefill_backlog: request id -> prompt tokens the router sent it to prefill that
            have not produced a first token yet (counted before its heartbeat can).
        kv_bytes_per_token: moving average of KV bytes it pushed per prompt token (a
            prefill worker; 0 before its first transfer).
        kv_bytes_per_s: moving average of its KV push rate, bytes over the seconds its
            sender spent pushing (0 before its first transfer).
        remote_overhead_s: moving average of what a remote prefill on it took beyond its
            own prefill time: the reservation on the decode worker and the messages.
        prefill_arrivals_s: ``time.monotonic()`` of each prompt the router sent it to
            prefill within the last :data:`ARRIVAL_WINDOW_S` (see :meth:`arrival_rate`).
        registered_s: ``time.monotonic()`` of its first registration.
    """

    info: RegisterWorker
    last_seen_s: float
    load: Heartbeat | None = None
    inflight: set[str] = field(default_factory=set)
    prefill_backlog: dict[str, int] = field(default_factory=dict)
    kv_bytes_per_token: float = 0.0
    kv_bytes_per_s: float = 0.0
    remote_overhead_s: float = 0.0
    prefill_arrivals_s: deque = field(default_factory=deque)
    registered_s: float = field(default_factory=time.monotonic)

    @property
    def worker_id(self) -> str:
        """The id the worker registered under (its zmq identity)."""
        return self.info.worker_id

    def observe_transfer(self, num_bytes: int, num_tokens: int, push_s: float) -> None:
        """Fold one finished KV push (``num_bytes`` for ``num_tokens`` prompt tokens, in
        ``push_s`` seconds of pushing) into its transfer averages."""
        if num_bytes > 0 and num_tokens > 0 and push_s > 0:
            self.kv_bytes_per_token = moving_average(self.kv_bytes_per_token,
                                                     num_bytes / num_tokens)
            self.kv_bytes_per_s = moving_average(self.kv_bytes_per_s, num_bytes / push_s)

    def observe_first_token(self, since_routed_s: float, prefill_time_s: float) -> None:
        """Fold one remote first token into :attr:`remote_overhead_s`: it arrived
        ``since_routed_s`` after the request was routed, of which the worker spent
        ``prefill_time_s`` (queue and prefill)."""
        self.remote_overhead_s = moving_average(self.remote_overhead_s,
                                                max(since_routed_s - prefill_time_s, 1e-6))

    def queue_prefill(self, request_id: str, num_tokens: int) -> None:
        """Count a prompt of ``num_tokens`` the router sent it to prefill: in its backlog
        until the first token, and (once per request) as an arrival."""
        if request_id not in self.prefill_backlog:
            self.prefill_arrivals_s.append(time.monotonic())
        self.prefill_backlog[request_id] = num_tokens

    def arrival_rate(self, now_s: float | None = None) -> float:
        """Prompts sent to it to prefill per second, over the last
        :data:`ARRIVAL_WINDOW_S` (or since it registered, but at least
        :data:`MIN_ARRIVAL_SPAN_S`)."""
        now_s = time.monotonic() if now_s is None else now_s
        arrivals = self.prefill_arrivals_s
        while arrivals and arrivals[0] < now_s - ARRIVAL_WINDOW_S:
            arrivals.popleft()
        span_s = min(ARRIVAL_WINDOW_S, max(MIN_ARRIVAL_SPAN_S, now_s - self.registered_s))
        return len(arrivals) / span_s

    @property
    def num_prefill_tokens_queued(self) -> int:
        """Prompt tokens waiting to be prefilled on it: what it reported, or what the
        router sent it since, if more."""
        reported = 0 if self.load is None else self.load.num_prefill_tokens_queued
        return max(reported, sum(self.prefill_backlog.values()))

    @property
    def prefill_tokens_per_s(self) -> float:
        """Its measured prefill throughput (tokens/s; 0 while unknown)."""
        return 0.0 if self.load is None else self.load.prefill_tokens_per_s

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
    """Workers by id; a worker stays until the liveness loop finds it silent for too long
    (net of the router's own lag) or its connection closes.

    Args:
        heartbeat_interval_s: the period workers report at.
        max_missed_heartbeats: a worker silent for this many periods is dead.
    """

    def __init__(self, heartbeat_interval_s: float = 1.0, max_missed_heartbeats: int = 3) -> None:
        self.heartbeat_interval_s = heartbeat_interval_s
        self.max_missed_heartbeats = max_missed_heartbeats
        self.workers: dict[str, WorkerInfo] = {}
        #: ids of every worker that ever registered (dropped ones too): start-up waits on it
        self.ever_registered: set[str] = set()

    def register(self, msg: RegisterWorker) -> WorkerInfo:
        """Add a worker, or refresh the registration of one already known (a restart or a
        re-registration keeps its in-flight set)."""
        self.ever_registered.add(msg.worker_id)
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
        """Alive workers, of ``role`` ("prefill" / "decode") or all: those registered.

        Silence alone does not exclude a worker here: only :meth:`remove_dead`, which the
        liveness loop calls net of its own lag, judges a worker dead. A router kept busy by a
        burst of requests has not read the heartbeats queued meanwhile, so a staleness check
        at routing time would shed requests with "no decode worker" while the worker runs.
        """
        return [w for w in self.workers.values() if role is None or w.info.role == role]

    def accepting(self, role: str | None = None) -> list[WorkerInfo]:
        """Alive workers that take new requests (not draining)."""
        return [w for w in self.alive(role) if not w.is_draining]

    def remove_dead(self, grace_s: float = 0.0) -> list[WorkerInfo]:
        """Drop and return the workers silent for longer than ``max_missed_heartbeats``
        periods plus ``grace_s`` seconds (the time the router itself could not listen)."""
        now = time.monotonic() - max(0.0, grace_s)
        dead = [w for w in self.workers.values() if not self.is_alive(w, now)]
        for w in dead:
            del self.workers[w.worker_id]
        return dead

    def least_loaded(self, role: str) -> WorkerInfo | None:
        """The accepting worker of ``role`` holding the fewest requests (None if none)."""
        candidates = self.accepting(role)
        return min(candidates, key=lambda w: w.load_score) if candidates else None
