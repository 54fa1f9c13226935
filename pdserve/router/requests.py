"""What the router hands the API server per request: the handle it streams deltas from,
the errors it raises, and the routing settings.

:class:`RequestHandle` is one request's stream of :class:`RequestDelta` objects; the
exceptions map to HTTP statuses in the server (:class:`NoWorkerAvailable` and
:class:`WorkerFailed` 503, :class:`RequestRejected` 400).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

from pdserve.engine.outputs import RequestDelta
from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.policy import POLICIES
from pdserve.router.remote_prefill import RemotePrefill


#: How a request leaves the router (:meth:`pdserve.router.router.Router.end`).
FINISHED, FAILED, TIMED_OUT, WORKER_LOST, CLIENT_GONE, SHUTDOWN = (
    "finished", "failed", "timed_out", "worker_lost", "client_gone", "shutdown")


class NoWorkerAvailable(RuntimeError):
    """No alive worker can take the request now (HTTP 503)."""


class RequestRejected(ValueError):
    """A worker refused the request as invalid (HTTP 400); the message is user-facing."""


class WorkerFailed(RuntimeError):
    """The worker serving a request died or failed internally (HTTP 503)."""


@dataclass(frozen=True)
class RoutingConfig:
    """Routing policy.

    Attributes:
        prefill_threshold: prompts with at least this many tokens use a prefill worker.
        kv_failure_policy: "recompute" (decode worker prefills itself) or "fail".
        reserve_timeout_s: how long a request may wait for a decode worker to have blocks.
        first_token_timeout_s: how long a request may wait for its first token (queued,
            then prefilled) before it ends with an error, and, after a migration, for the
            first token from its new decode worker; 0 waits for ever.
        kv_timeout_s: how long the router waits, after a remote prefill's first token, for
            the prefill worker to report its KV sent before the decode worker recomputes
            (the decode worker's own KV deadline usually reports first); 0 waits for ever.
        max_waiting_per_worker: requests a decode worker may hold beyond those it runs
            (its queue); when the chosen worker's is full a new request gets 503 at once.
        policy: the routing policy (``--routing``): "threshold" (the length threshold) or
            "predicted" (:class:`~pdserve.router.policy.PredictedTTFTPolicy`).
        migration_timeout_s: how long a request whose decode worker died waits for another
            one (a restarted one) before it ends with an error; 0 ends it at once when no
            decode worker is left.
        max_migrations: how many times one request may migrate to another decode worker
            after its own died (``--max-migrations``); past it the request ends with an
            error. It guards the cluster against a poison request that crashes every
            worker it lands on; 0 never migrates.

    Raises:
        ValueError: naming the field.
    """

    prefill_threshold: int = 512
    kv_failure_policy: str = "recompute"
    reserve_timeout_s: float = 10.0
    first_token_timeout_s: float = 600.0
    kv_timeout_s: float = 120.0
    max_waiting_per_worker: int = 512
    policy: str = "threshold"
    migration_timeout_s: float = 120.0
    max_migrations: int = 10

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {self.policy!r}")
        if self.max_waiting_per_worker < 1:
            raise ValueError(f"max_waiting_per_worker must be >= 1, got "
                             f"{self.max_waiting_per_worker}")
        if self.first_token_timeout_s < 0:
            raise ValueError(f"first_token_timeout_s must be >= 0, got "
                             f"{self.first_token_timeout_s}")
        if not 0 <= self.migration_timeout_s < math.inf:  # NaN fails too
            raise ValueError(f"migration_timeout_s must be a finite number >= 0, got "
                             f"{self.migration_timeout_s}")
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {self.max_migrations}")
        if self.kv_timeout_s < 0:
            raise ValueError(f"kv_timeout_s must be >= 0, got {self.kv_timeout_s}")
        if self.prefill_threshold < 1:
            raise ValueError(f"prefill_threshold must be >= 1, got {self.prefill_threshold}")
        if self.kv_failure_policy not in ("recompute", "fail"):
            raise ValueError("kv_failure_policy must be 'recompute' or 'fail', got "
                             f"{self.kv_failure_policy!r}")


class RequestHandle:
    """One request's stream of :class:`RequestDelta`; iterate it with ``async for``.

    Iteration raises :class:`RequestRejected` or :class:`WorkerFailed` on failure.
    """

    def __init__(self, request_id: str, worker_id: str, route: str = "local",
                 prompt_token_ids: list[int] | None = None,
                 params: SamplingParams | None = None) -> None:
        self.request_id = request_id
        self.worker_id = worker_id  # the decode worker
        self.route = route
        self.prompt_token_ids = prompt_token_ids or []
        self.params = params
        self.num_deltas = 0  # deltas handed to the consumer
        self.created_s = time.monotonic()
        #: ``time.monotonic()`` of its latest placement on a decode worker (routed, or
        #: migrated) while no token has come since; None once one has
        self.placed_s: float | None = self.created_s
        self.output_token_ids: list[int] = []  # tokens handed to the consumer
        self.num_migrations = 0  # times it moved to another decode worker
        self.remote: RemotePrefill | None = None
        self.queue: asyncio.Queue[RequestDelta | Exception] = asyncio.Queue()
        self.finished = False

    def deliver(self, delta: RequestDelta) -> None:
        """Hand a worker's delta to the consumer and remember its tokens (for a retry)."""
        self.queue.put_nowait(delta)
        self.num_deltas += 1
        self.placed_s = None
        self.output_token_ids.extend(delta.new_token_ids)

    def __aiter__(self) -> "RequestHandle":
        return self

    async def __anext__(self) -> RequestDelta:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, Exception):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item
