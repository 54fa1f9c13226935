"""The router: owns the zmq socket to the workers, asks the routing policy for each request's
route, runs the remote-prefill handshake, and demultiplexes workers' outputs into
per-request streams.

Its parts live apart, each testable without a socket: the worker registry with liveness
(:mod:`pdserve.router.registry`), the routing policy (:mod:`pdserve.router.policy`), the
remote-prefill state machine (:mod:`pdserve.router.remote_prefill`) and the per-request
handle (:mod:`pdserve.router.requests`). This module is the socket loop, which checks and
decodes each message and dispatches it through one table by type, and the places where a
request leaves the router (:meth:`Router._end`).

Runs inside the API server's asyncio loop. Public surface::

    router = Router(address, RoutingConfig(...)); await router.start()
    handle = router.add_request(request_id, prompt_token_ids, params)   # may raise
    async for delta in handle: ...      # RequestDelta objects until finished
    router.abort(request_id)            # e.g. client went away

Routes (length-threshold policy): prompts with fewer than ``prefill_threshold`` tokens not
already cached on the chosen decode worker (as far as the router can tell, see
:mod:`pdserve.router.prefix_index`) go to the least-loaded decode worker (among equally
loaded ones, the one holding the longest prefix), which prefills them itself (``local``); longer ones are
prefilled by the least-loaded prefill worker and their KV pushed to a decode worker that
reserved blocks first (``remote_prefill``); with no prefill worker alive they fall back to
a decode worker (``fallback``). A request asking for prompt logprobs is always ``local``:
its prompt must run through the model on the worker that reports them, and a prefill worker
reports only the first token. The handshake::

    D <- ExpectRemoteKV         D -> KVReserved      (refused for capacity: retry, then 503)
    P <- PrefillRequest(dest=D) P -> PrefillDone     (first token: streamed to the client)
    D <- FirstToken             P -> KV ... -> D     (D joins the request to its batch)
    failure (P dead, transfer error, D timeout): D <- ResumeLocally (policy "recompute")
                                                  or the request fails (policy "fail")
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

import zmq
import zmq.asyncio

from pdserve.memory import IdleTrimmer
from pdserve.security import ClusterKeys, PeerGate, secure_server
from pdserve.engine.sampling_params import SamplingParams
from pdserve.messages import (
    AbortRequests,
    ExpectRemoteKV,
    FirstToken,
    GenerateRequest,
    Heartbeat,
    KVCacheEvents,
    KVReserved,
    KVReserveRefused,
    KVSent,
    KVTransferFailed,
    MessageCodec,
    PrefillDone,
    PrefillRequest,
    RegisterAck,
    RegisterWorker,
    RequestFailed,
    ReregisterRequest,
    ResumeLocally,
    ShutdownWorker,
    StepOutputs,
)
from pdserve.router.policy import (
    FALLBACK,
    REMOTE_PREFILL,
    RouteRequest,
    RoutingPolicy,
    ThresholdPolicy,
)
from pdserve.router.prefix_index import PrefixIndex
from pdserve.router.registry import WorkerInfo, WorkerRegistry
from pdserve.router.remote_prefill import RemoteEvent, RemotePrefill, RemoteState
from pdserve.router.requests import (  # noqa: F401 (re-exported: the server imports them here)
    NoWorkerAvailable,
    RequestHandle,
    RequestRejected,
    RoutingConfig,
    WorkerFailed,
)

logger = logging.getLogger(__name__)

#: Wait between attempts to reserve KV blocks on a decode worker that was full.
RESERVE_RETRY_S = 0.05
#: Largest control message accepted (bytes); longer frames make libzmq drop the peer. A
#: 128k-token prompt with its sampling parameters encodes to well under 2 MiB.
MAX_CONTROL_MESSAGE_BYTES = 64 * 1024 * 1024
#: Pause before a failed router loop is restarted (seconds).
LOOP_RESTART_DELAY_S = 0.1

#: How a request leaves the router (:meth:`Router._end`).
FINISHED, FAILED, TIMED_OUT, WORKER_LOST, CLIENT_GONE, SHUTDOWN = (
    "finished", "failed", "timed_out", "worker_lost", "client_gone", "shutdown")

#: Messages that may come from a worker before it is registered.
_BEFORE_REGISTRATION = (RegisterWorker, Heartbeat)


class Router:
    """The socket loop, request placement and the exits of requests; see the module
    docstring.

    Args:
        address: zmq address to bind (``tcp://127.0.0.1:5557``; port 0 picks a free one).
        routing: the routing settings.
        metrics: series to record routing and transfer events in (optional).
        heartbeat_interval_s: the period workers report at.
        max_missed_heartbeats: silence after which a worker is dead.
        max_num_inflight: requests in flight above which new ones get 503.
        cluster_keys: the deployment's CURVE keys (:mod:`pdserve.security`): only peers
            holding the cluster secret can connect; None runs unauthenticated.
        policy: the routing policy (default: :class:`ThresholdPolicy` at
            ``routing.prefill_threshold``).

    Hostile input on the socket: a message with other than two frames (identity, body),
    bytes that are not a worker message, one claiming another worker's id, one from a
    worker that never registered, or one about a request another worker serves is dropped
    and counted (``pdserve:dropped_messages_total{reason}``); frames over
    :data:`MAX_CONTROL_MESSAGE_BYTES` make libzmq drop the peer before buffering them.
    The receive and liveness loops are supervised: one that fails is logged, counted
    (``pdserve:router_loop_restarts_total``) and restarted; :attr:`is_healthy` is False
    while one is down.
    """

    def __init__(self, address: str, routing: RoutingConfig | None = None, metrics=None,
                 heartbeat_interval_s: float = 1.0, max_missed_heartbeats: int = 3,
                 max_num_inflight: int = 1024,
                 cluster_keys: ClusterKeys | None = None,
                 policy: RoutingPolicy | None = None) -> None:
        self.bind_address = address
        self.routing = routing or RoutingConfig()
        self.policy = policy or ThresholdPolicy(self.routing.prefill_threshold)
        self.metrics = metrics
        self.registry = WorkerRegistry(heartbeat_interval_s, max_missed_heartbeats)
        self.max_num_inflight = max_num_inflight
        self.codec = MessageCodec()
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_MESSAGE_BYTES)
        self.gate: PeerGate | None = None
        if cluster_keys is not None:
            self.gate = PeerGate(self.ctx, cluster_keys,
                                 lambda _addr, reason: self._count("refused_connections",
                                                                   reason))
            secure_server(self.sock, cluster_keys)
        self.address = self._bind(address)
        if self.gate is not None:
            self.gate.watch(self.sock)
        self.handles: dict[str, RequestHandle] = {}
        #: decode worker id -> prompt prefixes it is believed to hold in its prefix cache
        self.prefix_indexes: dict[str, PrefixIndex] = {}
        self.worker_registered = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        #: loops currently down (between a failure and their restart)
        self._loops_down: set[str] = set()
        self._dropped_logged: set[tuple[str, str]] = set()
        #: message type -> handler ``(msg, sender worker id)``: the whole dispatch
        self._handlers: dict[type, Callable[[Any, str], None]] = {
            StepOutputs: self._on_step_outputs,
            Heartbeat: self._on_heartbeat,
            RegisterWorker: self._on_register,
            RequestFailed: self._on_request_failed,
            KVReserved: self._on_reserved,
            KVReserveRefused: self._on_refused,
            PrefillDone: self._on_prefill_done,
            KVSent: self._on_kv_sent,
            KVTransferFailed: self._on_kv_failed,
            KVCacheEvents: self._on_cache_events,
        }

    def _bind(self, address: str) -> str:
        if address.startswith("tcp://") and address.endswith(":0"):
            host = address[len("tcp://"):-2]
            port = self.sock.bind_to_random_port(f"tcp://{host}")
            return f"tcp://{host}:{port}"
        self.sock.bind(address)
        return address

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._supervise("receive", self._recv_loop)),
                       asyncio.create_task(self._supervise("liveness", self._liveness_loop))]

    @property
    def is_healthy(self) -> bool:
        """True while the router's loops run (started and none down)."""
        return bool(self._tasks) and not self._loops_down and \
            not any(t.done() for t in self._tasks)

    async def _supervise(self, name: str, loop) -> None:
        """Run ``loop`` forever: an exception is logged and counted, and the loop restarts
        after :data:`LOOP_RESTART_DELAY_S` (never a silent death)."""
        while True:
            try:
                await loop()
                logger.error("router %s loop returned; restarting it", name)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("router %s loop failed; restarting it", name)
            self._loops_down.add(name)
            self._count("router_loop_restarts", name)
            await asyncio.sleep(LOOP_RESTART_DELAY_S)
            self._loops_down.discard(name)

    async def stop(self, shutdown_workers: bool = False) -> None:
        if shutdown_workers:
            for w in list(self.registry.workers.values()):
                self._send(w.worker_id, ShutdownWorker())
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.gate is not None:
            self.gate.stop()
        self.sock.close(0)
        self.ctx.term()

    # -- the cluster as policies see it (ClusterView) -------------------------------------
    @property
    def num_inflight(self) -> int:
        return len(self.handles)

    def alive_workers(self, role: str | None = None) -> list[WorkerInfo]:
        return self.registry.alive(role)

    def accepting(self, role: str) -> list[WorkerInfo]:
        """Alive, not draining workers of ``role``."""
        return self.registry.accepting(role)

    def num_cached_tokens(self, worker: WorkerInfo, prompt_token_ids: list[int]) -> int:
        """Prompt tokens ``worker`` is believed to hold (its :class:`PrefixIndex`)."""
        return self._prefix_index(worker).num_cached_tokens(prompt_token_ids)

    def _prefix_index(self, worker: WorkerInfo) -> PrefixIndex:
        index = self.prefix_indexes.get(worker.worker_id)
        if index is None or index.block_size != worker.info.block_size:
            index = PrefixIndex(worker.info.block_size)
            self.prefix_indexes[worker.worker_id] = index
        return index

    def _count(self, series: str, *labels: str, amount: float = 1.0) -> None:
        if self.metrics is not None:
            getattr(self.metrics, series).labels(self.metrics.model_name, *labels).inc(amount)

    def _observe(self, series: str, value: float) -> None:
        if self.metrics is not None:
            getattr(self.metrics, series).labels(self.metrics.model_name).observe(value)

    # -- entry -----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> RequestHandle:
        """Route a request (see the module docstring).

        Raises:
            NoWorkerAvailable: no accepting decode worker, its queue is full, or the
                in-flight limit is reached.
        """
        if self.num_inflight >= self.max_num_inflight:
            raise NoWorkerAvailable(
                f"server is at its limit of {self.max_num_inflight} requests in flight")
        route = self.policy.route(
            RouteRequest(request_id, prompt_token_ids, params.prompt_logprobs is not None),
            self)
        if route is None:
            raise NoWorkerAvailable("no decode worker is available")
        decode = route.decode
        running = decode.load.num_running if decode.load is not None else 0
        if len(decode.inflight) - running >= self.routing.max_waiting_per_worker:
            raise NoWorkerAvailable(
                f"every decode worker's queue is full ({self.routing.max_waiting_per_worker} "
                "waiting requests)")
        if route.kind == FALLBACK:
            logger.info("no prefill worker for %s (%d tokens); prefilling on %s",
                        request_id, len(prompt_token_ids), decode.worker_id)
        self._count("route_decisions", route.kind)
        handle = RequestHandle(request_id, decode.worker_id, route.kind,
                               list(prompt_token_ids), params)
        self.handles[request_id] = handle
        decode.inflight.add(request_id)
        if route.kind == REMOTE_PREFILL:
            handle.remote = RemotePrefill(list(prompt_token_ids), params)
            self._send(decode.worker_id, ExpectRemoteKV(
                request_id, list(prompt_token_ids), params, time.time()))
        else:
            self._send(decode.worker_id, GenerateRequest(
                request_id, list(prompt_token_ids), params, time.time()))
        return handle

    # -- exits -----------------------------------------------------------------------------
    def abort(self, request_id: str) -> None:
        """Stop a request on its workers (no-op if it already finished)."""
        handle = self.handles.get(request_id)
        if handle is not None:
            self._end(handle, CLIENT_GONE)

    def fail_all(self, why: str) -> None:
        """End every request in flight with :class:`WorkerFailed` (``why``) and abort it on
        its workers (shutdown)."""
        for handle in list(self.handles.values()):
            self._end(handle, SHUTDOWN, WorkerFailed(why))

    def _end(self, handle: RequestHandle, outcome: str, exc: Exception | None = None,
             abort_workers: bool = True) -> None:
        """Every way a request leaves the router, in one place: it is forgotten, its
        consumer gets ``exc`` (after what it already has), and each of its workers drops
        it from its count and, with ``abort_workers``, gets ``AbortRequests`` (the prefill
        worker only while it still owes the first token). Ending twice is a no-op.

        Args:
            outcome: :data:`FINISHED`, :data:`FAILED`, :data:`TIMED_OUT`,
                :data:`WORKER_LOST`, :data:`CLIENT_GONE` or :data:`SHUTDOWN` (for logs).
        """
        rid = handle.request_id
        if self.handles.get(rid) is not handle:
            return
        del self.handles[rid]
        if exc is not None:
            handle.queue.put_nowait(exc)
            logger.debug("%s ends (%s): %s", rid, outcome, exc)
        worker = self.registry.workers.get(handle.worker_id)
        if worker is not None:
            worker.inflight.discard(rid)
            if abort_workers:
                self._send(worker.worker_id, AbortRequests([rid]))
        remote = handle.remote
        if remote is not None and remote.prefill_worker_id is not None:
            pworker = self.registry.workers.get(remote.prefill_worker_id)
            if pworker is not None:
                pworker.inflight.discard(rid)
                if abort_workers and remote.first_token_id is None:
                    self._send(pworker.worker_id, AbortRequests([rid]))

    # -- remote prefill handshake (state machine: pdserve.router.remote_prefill) -----------
    def _remote(self, request_id: str) -> RequestHandle | None:
        """The live handle of a remote-prefill request, or None."""
        handle = self.handles.get(request_id)
        return handle if handle is not None and handle.remote is not None else None

    def _on_reserved(self, msg: KVReserved, _sender: str = "") -> None:
        handle = self._remote(msg.request_id)
        if handle is None:
            return
        remote = handle.remote
        decode = self.registry.workers.get(handle.worker_id)
        prefill = self.registry.least_loaded("prefill")
        if prefill is None or decode is None:
            if remote.accepts(RemoteEvent.NO_PREFILL_WORKER):
                self._count("route_decisions", FALLBACK)
                self._recompute(handle, RemoteEvent.NO_PREFILL_WORKER,
                                "no prefill worker alive")
            return
        if remote.fire(RemoteEvent.RESERVED) is None:
            return
        remote.prefill_worker_id = prefill.worker_id
        prefill.inflight.add(msg.request_id)
        self._send(prefill.worker_id, PrefillRequest(
            msg.request_id, remote.prompt_token_ids, remote.params, time.time(),
            decode.worker_id, decode.info.kv_address))

    def _on_refused(self, msg: KVReserveRefused, _sender: str = "") -> None:
        handle = self._remote(msg.request_id)
        if handle is None:
            return
        if not msg.is_capacity:
            self._end(handle, FAILED, RequestRejected(msg.message))
            return
        if handle.remote.fire(RemoteEvent.RESERVE_RETRY) is not None:
            asyncio.get_running_loop().call_later(RESERVE_RETRY_S, self._retry_reserve,
                                                  msg.request_id)

    def _retry_reserve(self, request_id: str) -> None:
        handle = self._remote(request_id)
        if handle is None or handle.remote.state is not RemoteState.RESERVING:
            return
        deadline = handle.remote.deadline_s(self.routing)
        if deadline is not None and time.monotonic() > deadline:
            self._end(handle, TIMED_OUT, WorkerFailed(
                "no decode worker could reserve KV blocks in time; retry later"))
            return
        decode = self.registry.least_loaded("decode")
        if decode is None:
            self._end(handle, WORKER_LOST, WorkerFailed("no decode worker is available"))
            return
        old = self.registry.workers.get(handle.worker_id)
        if old is not None:
            old.inflight.discard(request_id)
        handle.worker_id = decode.worker_id
        decode.inflight.add(request_id)
        remote = handle.remote
        self._send(decode.worker_id, ExpectRemoteKV(
            request_id, remote.prompt_token_ids, remote.params, time.time()))

    def _on_prefill_done(self, msg: PrefillDone, _sender: str = "") -> None:
        delta = msg.delta
        handle = self._remote(delta.request_id)
        if handle is None or not handle.remote.accepts(RemoteEvent.FIRST_TOKEN):
            return
        remote = handle.remote
        remote.first_token_id = delta.new_token_ids[0]
        self._observe("request_prefill_time", msg.prefill_time_s)
        handle.deliver(delta)
        if delta.finished:  # the first token ends it: release D's reservation
            self._end(handle, FINISHED)
            return
        remote.fire(RemoteEvent.FIRST_TOKEN)
        self._send(handle.worker_id, FirstToken(delta.request_id, delta.new_token_ids[0]))

    def _on_kv_sent(self, msg: KVSent, _sender: str = "") -> None:
        pworker = self.registry.workers.get(msg.worker_id)
        if pworker is not None:
            pworker.inflight.discard(msg.request_id)
        handle = self._remote(msg.request_id)
        if msg.error is not None:
            self._count("kv_transfer_failures", "send_error")
            if handle is not None:
                self._kv_failed(handle, f"KV send failed: {msg.error}")
            return
        self._count("kv_transfer_bytes", amount=msg.num_bytes)
        self._observe("kv_transfer_seconds", msg.seconds)
        if handle is not None:
            handle.remote.fire(RemoteEvent.KV_SENT)

    def _on_kv_failed(self, msg: KVTransferFailed, _sender: str = "") -> None:
        self._count("kv_transfer_failures", msg.reason)
        handle = self._remote(msg.request_id)
        if handle is not None:
            self._kv_failed(handle, f"KV transfer failed ({msg.reason})")

    def _kv_failed(self, handle: RequestHandle, why: str,
                   event: RemoteEvent = RemoteEvent.KV_FAILED) -> None:
        """The KV will not arrive: per ``kv_failure_policy``, recompute on D or fail."""
        if not handle.remote.accepts(event):
            return
        if self.routing.kv_failure_policy == "fail":
            self._end(handle, FAILED, WorkerFailed(why))
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
            self._send(remote.prefill_worker_id, AbortRequests([handle.request_id]))
        outputs = [] if remote.first_token_id is None else [remote.first_token_id]
        self._send(handle.worker_id, ResumeLocally(handle.request_id, outputs))

    # -- worker outputs ----------------------------------------------------------------------
    def _on_step_outputs(self, msg: StepOutputs, sender: str = "") -> None:
        self.registry.touch(msg.worker_id)
        for delta in msg.deltas:
            handle = self.handles.get(delta.request_id)
            if handle is None:
                continue  # ended meanwhile
            if handle.worker_id != msg.worker_id:
                self._drop("not_its_request", sender, f"delta for {delta.request_id!r}")
                continue
            handle.deliver(delta)
            if delta.finished:
                self._end(handle, FINISHED, abort_workers=False)

    def _on_request_failed(self, msg: RequestFailed, _sender: str = "") -> None:
        handle = self.handles.get(msg.request_id)
        if handle is not None:
            self._end(handle, FAILED, RequestRejected(msg.message) if msg.is_client_error
                      else WorkerFailed(msg.message))

    def _on_cache_events(self, msg: KVCacheEvents, _sender: str = "") -> None:
        worker = self.registry.workers.get(msg.worker_id)
        if worker is None or worker.info.role != "decode":
            return
        if len(msg.stored) != len(msg.block_hashes):
            self._drop("malformed", msg.worker_id, "cache events of unequal lengths")
            return
        self._prefix_index(worker).apply(msg.stored, msg.block_hashes, msg.reset)

    def _on_heartbeat(self, msg: Heartbeat, _sender: str = "") -> None:
        if self.registry.heartbeat(msg) is None:
            self._send(msg.worker_id, ReregisterRequest())

    def _on_register(self, msg: RegisterWorker, _sender: str = "") -> None:
        self.registry.register(msg)
        self._send(msg.worker_id, RegisterAck(self.registry.heartbeat_interval_s))
        logger.info("worker %s (%s, pid %d) registered", msg.worker_id, msg.role, msg.pid)
        self.worker_registered.set()

    # -- socket ----------------------------------------------------------------------------
    def _send(self, worker_id: str, msg) -> None:
        """Queue ``msg`` for a worker without waiting. A failure (unroutable: the worker is
        gone; or its queue is full) is logged; liveness tracking deals with the worker."""
        try:
            sent = self.sock.send_multipart([worker_id.encode(), self.codec.encode(msg)],
                                            flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.warning("send to %s failed: %s", worker_id, exc)
            return
        if isinstance(sent, asyncio.Future):  # zmq.asyncio reports errors on the future
            sent.add_done_callback(lambda fut: _log_send_failure(fut, worker_id))

    async def _recv_loop(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=True)
            self._on_frames(frames)

    def _drop(self, reason: str, sender: str, detail: str) -> None:
        """Count a dropped message; log the first of each (reason, sender)."""
        self._count("dropped_messages", reason)
        key = (reason, sender)
        if key not in self._dropped_logged and len(self._dropped_logged) < 1024:
            self._dropped_logged.add(key)
            logger.warning("dropping a message from %r (%s): %s; further ones like it are "
                           "only counted", sender, reason, detail)

    def _on_frames(self, frames: list[bytes]) -> None:
        """Check one received message and dispatch it (never raises)."""
        sender = frames[0].decode("utf-8", "replace") if frames else ""
        if len(frames) != 2:
            self._drop("frames", sender, f"{len(frames)} frames, expected 2")
            return
        try:
            msg = self.codec.decode_to_router(frames[1])
        except Exception as exc:
            self._drop("malformed", sender, str(exc)[:200])
            return
        kind = type(msg)
        worker_id = sender.removesuffix("/heartbeat")
        claimed = getattr(msg, "worker_id", None)
        if kind is RegisterWorker and sender != msg.worker_id:
            # replies go to the identity the worker registers: it must be the sender's own
            self._drop("impostor", sender, f"registration as {msg.worker_id!r}")
            return
        if claimed is not None and claimed != worker_id:
            self._drop("impostor", sender, f"{kind.__name__} claims worker {claimed!r}")
            return
        if kind not in _BEFORE_REGISTRATION and worker_id not in self.registry.workers:
            self._drop("unregistered", sender, kind.__name__)
            return
        request_id = getattr(msg, "request_id", None)
        if request_id is not None and not self._serves(worker_id, request_id):
            self._drop("not_its_request", sender, f"{kind.__name__} for {request_id!r}")
            return
        handler = self._handlers.get(kind)
        if handler is None:  # decodable but not a worker-to-router message
            self._drop("malformed", sender, f"unexpected {kind.__name__}")
            return
        try:
            handler(msg, worker_id)
        except Exception:  # a bad message must not stop the router
            logger.exception("failed to handle %s", kind.__name__)

    def _serves(self, worker_id: str, request_id: str) -> bool:
        """Whether ``worker_id`` may report on ``request_id`` (unknown ids pass: the
        handlers ignore requests that already ended)."""
        handle = self.handles.get(request_id)
        if handle is None:
            return True
        remote = handle.remote
        return worker_id == handle.worker_id or (
            remote is not None and worker_id == remote.prefill_worker_id)

    # -- deadlines and liveness ------------------------------------------------------------
    def _check_deadlines(self, now_s: float | None = None) -> None:
        """End or move on requests past a deadline: the first-token deadline of every
        request (``first_token_timeout_s``), and the deadline of a remote prefill's
        current state (:data:`~pdserve.router.remote_prefill.STATE_DEADLINES`)."""
        now = time.monotonic() if now_s is None else now_s
        limit = self.routing.first_token_timeout_s
        for handle in list(self.handles.values()):
            if limit and handle.num_deltas == 0 and now - handle.created_s > limit:
                self._count("request_timeouts", "first_token")
                self._end(handle, TIMED_OUT, WorkerFailed(
                    f"no first token within {limit:g} s (the server is overloaded); "
                    "retry later"))
                continue
            remote = handle.remote
            deadline = None if remote is None else remote.deadline_s(self.routing)
            if deadline is None or now <= deadline:
                continue
            if remote.state is RemoteState.RESERVING:
                self._count("request_timeouts", "reserve")
                self._end(handle, TIMED_OUT, WorkerFailed(
                    "no decode worker could reserve KV blocks in time; retry later"))
            elif remote.state is RemoteState.AWAITING_KV:
                self._count("kv_transfer_failures", "timeout")
                self._kv_failed(handle, f"no KV within {self.routing.kv_timeout_s:g} s of "
                                        "the first token")
            else:  # waiting for the prefill worker's first token
                self._count("request_timeouts", "first_token")
                self._end(handle, TIMED_OUT, WorkerFailed(
                    "the prefill worker produced no first token in time; retry later"))

    def _on_worker_lost(self, worker: WorkerInfo) -> None:
        """A worker missed its heartbeats: its decodes move to another decode worker (once)
        or fail; remote prefills it still owed anything go to their decode worker."""
        self.prefix_indexes.pop(worker.worker_id, None)
        logger.warning("worker %s (%s) missed its heartbeats; dropping it",
                       worker.worker_id, worker.info.role)
        for handle in list(self.handles.values()):
            remote = handle.remote
            if handle.worker_id == worker.worker_id:
                if not self._retry_elsewhere(handle):
                    self._end(handle, WORKER_LOST, WorkerFailed(
                        f"worker {worker.worker_id} stopped responding"))
            elif remote is not None and remote.prefill_worker_id == worker.worker_id \
                    and remote.accepts(RemoteEvent.PREFILL_WORKER_LOST):
                self._count("kv_transfer_failures", "prefill_worker_died")
                self._kv_failed(handle, f"prefill worker {worker.worker_id} died",
                                RemoteEvent.PREFILL_WORKER_LOST)

    def _retry_elsewhere(self, handle: RequestHandle) -> bool:
        """Re-place a request whose decode worker died, once; it then runs as a local
        request on another decode worker, continuing after the tokens the client already
        has (they are prefilled with the prompt, so nothing is duplicated or lost)."""
        if handle.is_retried or handle.params is None:
            return False
        decode = self.registry.least_loaded("decode")
        if decode is None:
            return False
        remote = handle.remote
        if remote is not None and remote.prefill_worker_id is not None:
            pworker = self.registry.workers.get(remote.prefill_worker_id)
            if pworker is not None:
                pworker.inflight.discard(handle.request_id)
                self._send(pworker.worker_id, AbortRequests([handle.request_id]))
        handle.is_retried = True
        handle.remote = None
        handle.worker_id = decode.worker_id
        decode.inflight.add(handle.request_id)
        self._count("request_retries")
        logger.warning("retrying %s on %s", handle.request_id, decode.worker_id)
        self._send(decode.worker_id, GenerateRequest(
            handle.request_id, handle.prompt_token_ids, handle.params, time.time(),
            output_token_ids=list(handle.output_token_ids)))
        return True

    async def _liveness_loop(self) -> None:
        trimmer = IdleTrimmer()
        while True:
            await asyncio.sleep(self.registry.heartbeat_interval_s / 4)
            self._check_deadlines()
            trimmer.tick(bool(self.handles), time.monotonic())
            for worker in self.registry.remove_dead():
                self._on_worker_lost(worker)


def _log_send_failure(fut: asyncio.Future, worker_id: str) -> None:
    """Done-callback of a non-blocking send: log its error (never leave it unretrieved)."""
    if fut.cancelled():
        return
    exc = fut.exception()
    if exc is not None:
        logger.warning("send to %s failed: %s", worker_id, exc)
