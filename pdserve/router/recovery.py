"""What happens to requests when time runs out or a worker dies: every request's
first-token deadline, the deadline of a remote prefill's current state, and the requests of
a worker that stopped responding (re-placed once on another decode worker, or ended).
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

    def check_deadlines(self, now_s: float | None = None) -> None:
        """End or move on requests past a deadline: the first-token deadline of every
        request (``first_token_timeout_s``), and the deadline of a remote prefill's
        current state (:data:`~pdserve.router.remote_prefill.STATE_DEADLINES`)."""
        router = self.router
        now = time.monotonic() if now_s is None else now_s
        limit = router.routing.first_token_timeout_s
        for handle in list(router.handles.values()):
            if limit and handle.num_deltas == 0 and now - handle.created_s > limit:
                router.count("request_timeouts", "first_token")
                router.end(handle, TIMED_OUT, WorkerFailed(
                    f"no first token within {limit:g} s (the server is overloaded); "
                    "retry later"))
                continue
            remote = handle.remote
            deadline = None if remote is None else remote.deadline_s(router.routing)
            if deadline is None or now <= deadline:
                continue
            router.handshake.on_deadline(handle)

    def on_worker_lost(self, worker: WorkerInfo) -> None:
        """A worker missed its heartbeats: its decodes move to another decode worker (once)
        or fail; remote prefills it still owed anything go to their decode worker."""
        router = self.router
        router.prefix_indexes.pop(worker.worker_id, None)
        logger.warning("worker %s (%s) missed its heartbeats; dropping it",
                       worker.worker_id, worker.info.role)
        for handle in list(router.handles.values()):
            remote = handle.remote
            if handle.worker_id == worker.worker_id:
                if not self.retry_elsewhere(handle):
                    router.end(handle, WORKER_LOST, WorkerFailed(
                        f"worker {worker.worker_id} stopped responding"))
            elif remote is not None:
                router.handshake.on_prefill_worker_lost(handle, worker)

    def retry_elsewhere(self, handle: RequestHandle) -> bool:
        """Re-place a request whose decode worker died, once; it then runs as a local
        request on another decode worker, continuing after the tokens the client already
        has (they are prefilled with the prompt, so nothing is duplicated or lost)."""
        router = self.router
        if handle.is_retried or handle.params is None:
            return False
        decode = router.registry.least_loaded("decode")
        if decode is None:
            return False
        remote = handle.remote
        if remote is not None and remote.prefill_worker_id is not None:
            pworker = router.registry.workers.get(remote.prefill_worker_id)
            if pworker is not None:
                pworker.inflight.discard(handle.request_id)
                router.send(pworker.worker_id, AbortRequests([handle.request_id]))
        handle.is_retried = True
        handle.remote = None
        router.move(handle, decode)
        router.count("request_retries")
        logger.warning("retrying %s on %s", handle.request_id, decode.worker_id)
        router.send(decode.worker_id, GenerateRequest(
            handle.request_id, handle.prompt_token_ids, handle.params, time.time(),
            output_token_ids=list(handle.output_token_ids)))
        return True
