"""What happens to requests when time runs out or a worker dies: every request's
first-token deadline, the deadline of a remote prefill's current state, and the requests of
a worker that died or stopped responding.

A request whose decode worker is lost migrates: it is resubmitted to another decode worker
with the tokens the client already has appended to its prompt, so its stream goes on with
nothing repeated or missing (a seeded, sampled request continues its random stream:
:meth:`~pdserve.engine.request.Request.skip_sampled_draws`). With no decode worker left it
waits up to ``migration_timeout_s`` for one to register (the one ``serve`` restarts), then
ends with an error. One request migrates at most ``max_migrations`` times: a poison request
that crashes every worker it lands on ends with an error instead of taking them all down.
Each migration is counted in ``pdserve:request_migrations_total`` (and, as before, in
``pdserve:request_retries_total``).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from pdserve.messages import AbortRequests, GenerateRequest
from pdserve.router.registry import WorkerInfo
from pdserve.router.requests import TIMED_OUT, WORKER_LOST, RequestHandle, WorkerFailed

if TYPE_CHECKING:
    from pdserve.router.router import Router

logger = logging.getLogger(__name__)


class RequestRecovery:
    """Deadlines and worker loss for one router's requests; every exit goes through the
    router's :meth:`~pdserve.router.router.Router.end`.

    Args:
        router: the router whose handles, registry and settings it uses.
    """

    def __init__(self, router: Router) -> None:
        self.router = router
        #: request id -> ``time.monotonic()`` deadline: lost their decode worker, wait for one
        self.orphans: dict[str, float] = {}

    def check_deadlines(self, now_s: float | None = None) -> None:
        """End or move on requests past a deadline: the first-token deadline of every
        request (``first_token_timeout_s``, from its latest placement: a migrated request
        waits that long for its new decode worker's first token), and the deadline of a
        remote prefill's current state (:data:`~pdserve.router.remote_prefill.STATE_DEADLINES`).
        A request held for a decode worker that is no longer registered (a bug: every way
        a worker leaves moves its requests) is treated as that worker's loss, not kept."""
        router = self.router
        now = time.monotonic() if now_s is None else now_s
        limit = router.routing.first_token_timeout_s
        for handle in list(router.handles.values()):
            if handle.worker_id and handle.worker_id not in router.registry.workers:
                logger.error("%s is held for %s, which is not registered; moving it on",
                             handle.request_id, handle.worker_id)
                self.on_handle_lost(handle, f"worker {handle.worker_id} is gone")
                continue
            if limit and handle.placed_s is not None and now - handle.placed_s > limit:
                router.count("request_timeouts", "first_token")
                what = "token from its new decode worker after a migration" \
                    if handle.num_migrations else "first token"
                router.end(handle, TIMED_OUT, WorkerFailed(
                    f"no {what} within {limit:g} s (the server is overloaded); retry later"))
                continue
            remote = handle.remote
            deadline = None if remote is None else remote.deadline_s(router.routing)
            if deadline is None or now <= deadline:
                continue
            router.handshake.on_deadline(handle)
        for rid, deadline in list(self.orphans.items()):
            handle = router.handles.get(rid)
            if handle is not None and now > deadline:
                router.end(handle, WORKER_LOST, WorkerFailed(
                    "its decode worker died and no decode worker came back within "
                    f"{router.routing.migration_timeout_s:g} s; retry later"))
            if handle is None or now > deadline:
                del self.orphans[rid]

    def on_worker_exit(self, worker_id: str, why: str = "exited") -> None:
        """A worker's process exited (its supervisor saw it) or its connection closed: drop
        it now rather than after its missed heartbeats (``why`` is for the log line)."""
        worker = self.router.registry.workers.pop(worker_id, None)
        if worker is not None:
            self.on_worker_lost(worker, why)

    def place_orphans(self) -> None:
        """Migrate the requests waiting for a decode worker, while one accepts them."""
        for rid in list(self.orphans):
            handle = self.router.handles.get(rid)
            decode = self.router.registry.least_loaded("decode")
            if handle is not None and decode is None:
                return
            del self.orphans[rid]
            if handle is not None:
                self._migrate(handle, decode)

    def on_worker_lost(self, worker: WorkerInfo, why: str = "missed its heartbeats") -> None:
        """A worker is gone: its decodes migrate (up to ``max_migrations`` times each) or
        fail; remote prefills it still owed anything go to their decode worker."""
        router = self.router
        router.prefix_indexes.pop(worker.worker_id, None)
        logger.warning("worker %s (%s) %s; dropping it", worker.worker_id, worker.info.role,
                       why)
        for handle in list(router.handles.values()):
            remote = handle.remote
            if handle.worker_id == worker.worker_id:
                self.on_handle_lost(handle, f"worker {worker.worker_id} stopped responding")
            elif remote is not None:
                router.handshake.on_prefill_worker_lost(handle, worker)

    def on_handle_lost(self, handle: RequestHandle, why: str) -> None:
        """``handle``'s decode worker is gone: it migrates, or ends with :class:`WorkerFailed`
        saying ``why`` (and its migration limit, when that is the reason)."""
        if not self.retry_elsewhere(handle):
            self.router.end(handle, WORKER_LOST, WorkerFailed(
                why + self._migrations_note(handle)))

    def retry_elsewhere(self, handle: RequestHandle) -> bool:
        """Migrate a request whose decode worker died (see the module docstring); False when
        it cannot (it migrated ``max_migrations`` times already, or no decode worker is left
        and there is no time to wait)."""
        router = self.router
        if handle.num_migrations >= router.routing.max_migrations or handle.params is None:
            return False
        decode = router.registry.least_loaded("decode")
        if decode is None and not router.routing.migration_timeout_s:
            return False
        remote = handle.remote
        if remote is not None and remote.prefill_worker_id is not None:
            pworker = router.registry.workers.get(remote.prefill_worker_id)
            if pworker is not None:
                pworker.inflight.discard(handle.request_id)
                router.send(pworker.worker_id, AbortRequests([handle.request_id]))
        handle.num_migrations += 1
        handle.remote = None
        if decode is None:
            old = router.registry.workers.get(handle.worker_id)
            if old is not None:
                old.inflight.discard(handle.request_id)
            handle.worker_id = ""  # no worker may report on it meanwhile
            self.orphans[handle.request_id] = \
                time.monotonic() + router.routing.migration_timeout_s
            logger.warning("%s waits for a decode worker", handle.request_id)
            return True
        self._migrate(handle, decode)
        return True

    def _migrate(self, handle: RequestHandle, decode: WorkerInfo) -> None:
        """Resubmit ``handle`` to ``decode`` after the tokens its client already has."""
        router = self.router
        router.move(handle, decode)
        handle.placed_s = time.monotonic()  # its first-token deadline starts again
        router.count("request_retries")
        router.count("request_migrations")
        logger.warning("migrating %s to %s (migration %d of at most %d)", handle.request_id,
                       decode.worker_id, handle.num_migrations, router.routing.max_migrations)
        router.send(decode.worker_id, GenerateRequest(
            handle.request_id, handle.prompt_token_ids, handle.params, time.time(),
            output_token_ids=list(handle.output_token_ids)))

    def _migrations_note(self, handle: RequestHandle) -> str:
        """Why a request that could have moved did not: its migration limit (or '')."""
        limit = self.router.routing.max_migrations
        if handle.params is None or handle.num_migrations < limit:
            return ""
        return f" (the request reached its limit of {limit} migrations)"
