"""The router's side of the remote-prefill handshake: turns the workers' messages about a
remote-prefill request into events of its :class:`~pdserve.router.remote_prefill.RemotePrefill`
state machine and sends what each new state asks for::

    D <- ExpectRemoteKV         D -> KVReserved      (refused for capacity: retry, then 503)
    P <- PrefillRequest(dest=D) P -> PrefillDone     (first token: streamed to the client)
    D <- FirstToken             P -> KV ... -> D     (D joins the request to its batch)
    failure (P dead, transfer error, D timeout): D <- ResumeLocally (policy "recompute")
                                                  or the request fails (policy "fail")

It holds no state of its own: each request's state is on its handle, and every exit goes
through the router's single exit (:meth:`pdserve.router.router.Router.end`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from pdserve.messages import (
    AbortRequests,
    ExpectRemoteKV,
    FirstToken,
    KVReserved,
    KVReserveRefused,
    KVSent,
    KVTransferFailed,
    PrefillDone,
    PrefillRequest,
    ResumeLocally,
)
from pdserve.router.policy import FALLBACK
from pdserve.router.registry import WorkerInfo
from pdserve.router.remote_prefill import RemoteEvent, RemoteState
from pdserve.router.requests import (
    FAILED,
    FINISHED,
    TIMED_OUT,
    WORKER_LOST,
    RequestHandle,
    RequestRejected,
    WorkerFailed,
)

if TYPE_CHECKING:
    from pdserve.router.router import Router

logger = logging.getLogger(__name__)

#: Wait between attempts to reserve KV blocks on a decode worker that was full.
RESERVE_RETRY_S = 0.05


class RemotePrefillHandshake:
    """Drives every remote-prefill request of one router (see the module docstring).

    Args:
        router: the router whose handles, registry, settings and exits it uses.
    """

    def __init__(self, router: Router) -> None:
        self.router = router

    def handlers(self) -> dict[type, object]:
        """Message type -> handler ``(msg, sender worker id)`` for the router's dispatch."""
        return {KVReserved: self.on_reserved, KVReserveRefused: self.on_refused,
                PrefillDone: self.on_prefill_done, KVSent: self.on_kv_sent,
                KVTransferFailed: self.on_kv_failed}

    def _remote(self, request_id: str) -> RequestHandle | None:
        """The live handle of a remote-prefill request, or None."""
        handle = self.router.handles.get(request_id)
        return handle if handle is not None and handle.remote is not None else None

    def on_reserved(self, msg: KVReserved, _sender: str = "") -> None:
        """D reserved blocks: the least-loaded prefill worker gets the prompt (or, with
        none alive, D prefills it itself)."""
        router = self.router
        handle = self._remote(msg.request_id)
        if handle is None:
            return
        remote = handle.remote
        decode = router.registry.workers.get(handle.worker_id)
        preferred = router.registry.workers.get(remote.preferred_prefill_id or "")
        prefill = preferred if preferred in router.registry.accepting("prefill") \
            else router.registry.least_loaded("prefill")
        if prefill is None or decode is None:
            if remote.accepts(RemoteEvent.NO_PREFILL_WORKER):
                router.count("route_decisions", FALLBACK)
                self._recompute(handle, RemoteEvent.NO_PREFILL_WORKER,
                                "no prefill worker alive")
            return
        if remote.fire(RemoteEvent.RESERVED) is None:
            return
        if preferred is not None and preferred is not prefill:
            preferred.prefill_backlog.pop(msg.request_id, None)
        remote.prefill_worker_id = prefill.worker_id
        prefill.inflight.add(msg.request_id)
        prefill.queue_prefill(msg.request_id, len(remote.prompt_token_ids))
        router.send(prefill.worker_id, PrefillRequest(
            msg.request_id, remote.prompt_token_ids, remote.params, time.time(),
            decode.worker_id, decode.info.kv_address))

    def on_refused(self, msg: KVReserveRefused, _sender: str = "") -> None:
        """D refused: for capacity, ask again after :data:`RESERVE_RETRY_S`; otherwise the
        request is invalid (400)."""
        handle = self._remote(msg.request_id)
        if handle is None:
            return
        if not msg.is_capacity:
            self.router.end(handle, FAILED, RequestRejected(msg.message))
            return
        if handle.remote.fire(RemoteEvent.RESERVE_RETRY) is not None:
            asyncio.get_running_loop().call_later(RESERVE_RETRY_S, self.retry_reserve,
                                                  msg.request_id)

    def retry_reserve(self, request_id: str) -> None:
        """Ask the least-loaded decode worker to reserve, unless the reservation's deadline
        has passed or no decode worker is left (both end the request)."""
        router = self.router
        handle = self._remote(request_id)
        if handle is None or handle.remote.state is not RemoteState.RESERVING:
            return
        deadline = handle.remote.deadline_s(router.routing)
        if deadline is not None and time.monotonic() > deadline:
            router.end(handle, TIMED_OUT, WorkerFailed(
                "no decode worker could reserve KV blocks in time; retry later"))
            return
        decode = router.registry.least_loaded("decode")
        if decode is None:
            router.end(handle, WORKER_LOST, WorkerFailed("no decode worker is available"))
            return
        router.move(handle, decode)
        remote = handle.remote
        router.send(decode.worker_id, ExpectRemoteKV(
            request_id, remote.prompt_token_ids, remote.params, time.time()))

    def on_prefill_done(self, msg: PrefillDone, _sender: str = "") -> None:
        """P's first token: streamed to the client and passed to D (or, if it ends the
        request, D's reservation is released)."""
        router = self.router
        delta = msg.delta
        handle = self._remote(delta.request_id)
        if handle is None or not handle.remote.accepts(RemoteEvent.FIRST_TOKEN):
            return
        remote = handle.remote
        remote.first_token_id = delta.new_token_ids[0]
        pworker = router.registry.workers.get(remote.prefill_worker_id or "")
        if pworker is not None:
            pworker.prefill_backlog.pop(delta.request_id, None)
            pworker.observe_first_token(time.monotonic() - handle.created_s, msg.prefill_time_s)
        router.observe("request_prefill_time", msg.prefill_time_s)
        handle.deliver(delta)
        if delta.finished:
            router.end(handle, FINISHED)
            return
        remote.fire(RemoteEvent.FIRST_TOKEN)
        router.send(handle.worker_id, FirstToken(delta.request_id, delta.new_token_ids[0]))

    def on_kv_sent(self, msg: KVSent, _sender: str = "") -> None:
        """P finished sending the KV (or failed to): P is done with the request."""
        router = self.router
        pworker = router.registry.workers.get(msg.worker_id)
        if pworker is not None:
            pworker.inflight.discard(msg.request_id)
        handle = self._remote(msg.request_id)
        if msg.error is not None:
            router.count("kv_transfer_failures", "send_error")
            if handle is not None:
                self.kv_failed(handle, f"KV send failed: {msg.error}")
            return
        router.count("kv_transfer_bytes", amount=msg.num_bytes)
        router.observe("kv_transfer_seconds", msg.seconds)
        if handle is not None:
            if pworker is not None:
                pworker.observe_transfer(msg.num_bytes, len(handle.remote.prompt_token_ids),
                                         msg.push_s)
            handle.remote.fire(RemoteEvent.KV_SENT)

    def on_kv_failed(self, msg: KVTransferFailed, _sender: str = "") -> None:
        """D could not receive or use the KV."""
        self.router.count("kv_transfer_failures", msg.reason)
        handle = self._remote(msg.request_id)
        if handle is not None:
            self.kv_failed(handle, f"KV transfer failed ({msg.reason})")

    def on_prefill_worker_lost(self, handle: RequestHandle, worker: WorkerInfo) -> None:
        """``worker`` died while it was ``handle``'s prefill worker."""
        remote = handle.remote
        if remote.prefill_worker_id == worker.worker_id and \
                remote.accepts(RemoteEvent.PREFILL_WORKER_LOST):
            self.router.count("kv_transfer_failures", "prefill_worker_died")
            self.kv_failed(handle, f"prefill worker {worker.worker_id} died",
                           RemoteEvent.PREFILL_WORKER_LOST)

    def on_deadline(self, handle: RequestHandle) -> None:
        """``handle``'s current state waited past its deadline: a reservation or a first
        token ends the request; missing KV goes the way of a failed transfer."""
        router = self.router
        state = handle.remote.state
        if state is RemoteState.RESERVING:
            router.count("request_timeouts", "reserve")
            router.end(handle, TIMED_OUT, WorkerFailed(
                "no decode worker could reserve KV blocks in time; retry later"))
        elif state is RemoteState.AWAITING_KV:
            router.count("kv_transfer_failures", "timeout")
            self.kv_failed(handle, f"no KV within {router.routing.kv_timeout_s:g} s of "
                                   "the first token")
        else:
            router.count("request_timeouts", "first_token")
            router.end(handle, TIMED_OUT, WorkerFailed(
                "the prefill worker produced no first token in time; retry later"))

    def kv_failed(self, handle: RequestHandle, why: str,
                  event: RemoteEvent = RemoteEvent.KV_FAILED) -> None:
        """The KV will not arrive: per ``kv_failure_policy``, recompute on D or fail."""
        if not handle.remote.accepts(event):
            return
        if self.router.routing.kv_failure_policy == "fail":
            self.router.end(handle, FAILED, WorkerFailed(why))
            return
        self._recompute(handle, event, why)

    def _recompute(self, handle: RequestHandle, event: RemoteEvent, why: str) -> None:
        """Move to RECOMPUTING: the decode worker prefills itself, after the tokens the
        client already has."""
        remote = handle.remote
        if remote.fire(event) is not RemoteState.RECOMPUTING:
            return
        logger.warning("%s: %s; recomputing the prefill on %s", handle.request_id, why,
                       handle.worker_id)
        if remote.prefill_worker_id is not None and remote.first_token_id is None:
            self.router.send(remote.prefill_worker_id, AbortRequests([handle.request_id]))
        outputs = [] if remote.first_token_id is None else [remote.first_token_id]
        self.router.send(handle.worker_id, ResumeLocally(handle.request_id, outputs))
