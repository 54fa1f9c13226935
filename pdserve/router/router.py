"""The router: asks the routing policy for each request's route, demultiplexes workers'
outputs into per-request streams, and owns every way a request leaves (:meth:`Router.end`).

Its parts live apart, each testable without a socket: the worker registry with liveness
(:mod:`~pdserve.router.registry`), the routing policy (:mod:`~pdserve.router.policy`), the
remote-prefill state machine (:mod:`~pdserve.router.remote_prefill`) and the messages that
drive it (:mod:`~pdserve.router.handshake`), the per-request handle
(:mod:`~pdserve.router.requests`), the socket (:mod:`~pdserve.router.worker_socket`), its
receiving side that checks each message and dispatches it through one table by type
(:mod:`~pdserve.router.inbox`), the closed-connection watch
(:mod:`~pdserve.router.connections`) and the liveness loop (:mod:`~pdserve.router.liveness`).

Runs inside the API server's asyncio loop. Public surface::

    router = Router(address, RoutingConfig(...)); await router.start()
    handle = router.add_request(request_id, prompt_token_ids, params)   # may raise
    async for delta in handle: ...      # RequestDelta objects until finished
    router.abort(request_id)            # e.g. client went away

Routes (:mod:`~pdserve.router.policy`): ``local`` (the decode worker prefills the prompt
itself), ``remote_prefill`` (a prefill worker does, and pushes the KV to a decode worker
that reserved blocks first) or ``fallback`` (a long prompt, but no prefill worker alive). A
request asking for prompt logprobs is always ``local``: a prefill worker reports only the
first token.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from pdserve.security import ClusterKeys
from pdserve.engine.sampling_params import SamplingParams
from pdserve.messages import (
    AbortRequests,
    ExpectRemoteKV,
    GenerateRequest,
    Heartbeat,
    KVCacheEvents,
    RegisterAck,
    RegisterWorker,
    RequestFailed,
    ReregisterRequest,
    ShutdownWorker,
    StepOutputs,
)
from pdserve.router.handshake import RemotePrefillHandshake
from pdserve.router.inbox import Inbox
from pdserve.router.liveness import LivenessLoop
from pdserve.router.policy import (
    FALLBACK,
    LOCAL,
    POLICIES,
    REMOTE_PREFILL,
    Route,
    RouteRequest,
    RoutingPolicy,
)
from pdserve.router.prefix_index import PrefixIndex
from pdserve.router.registry import WorkerInfo, WorkerRegistry
from pdserve.router.recovery import RequestRecovery
from pdserve.router.remote_prefill import RemotePrefill
from pdserve.router.requests import (  # noqa: F401 (re-exported: the server imports them here)
    CLIENT_GONE,
    FAILED,
    FINISHED,
    SHUTDOWN,
    TIMED_OUT,
    WORKER_LOST,
    NoWorkerAvailable,
    RequestHandle,
    RequestRejected,
    RoutingConfig,
    WorkerFailed,
)
from pdserve.router.worker_socket import MAX_CONTROL_MESSAGE_BYTES, WorkerSocket

logger = logging.getLogger(__name__)

#: Pause before a failed router loop is restarted (seconds).
LOOP_RESTART_DELAY_S = 0.1


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

    Hostile input is dropped and counted (:mod:`~pdserve.router.worker_socket`; frames
    over :data:`MAX_CONTROL_MESSAGE_BYTES` never buffer). A worker is dropped when its
    connection closes (:mod:`~pdserve.router.connections`) or it stays silent too long
    (:mod:`~pdserve.router.liveness`). A failed receive, connections or liveness loop is
    logged, counted (``pdserve:router_loop_restarts_total``) and restarted; :attr:`is_healthy`
    is False while one is down.
    """

    def __init__(self, address: str, routing: RoutingConfig | None = None, metrics=None,
                 heartbeat_interval_s: float = 1.0, max_missed_heartbeats: int = 3,
                 max_num_inflight: int = 1024,
                 cluster_keys: ClusterKeys | None = None,
                 policy: RoutingPolicy | None = None) -> None:
        self.bind_address = address
        self.routing = routing or RoutingConfig()
        self.policy = policy or POLICIES[self.routing.policy](self.routing.prefill_threshold)
        self.metrics = metrics
        self.registry = WorkerRegistry(heartbeat_interval_s, max_missed_heartbeats)
        self.max_num_inflight = max_num_inflight
        self.socket = WorkerSocket(
            address, cluster_keys, lambda series, reason: self.count(series, reason))
        self.address = self.socket.address
        self.handshake = RemotePrefillHandshake(self)
        self.recovery = RequestRecovery(self)
        self.inbox = Inbox(self)
        self.liveness = LivenessLoop(self)
        self.handles: dict[str, RequestHandle] = {}
        #: decode worker id -> prompt prefixes it is believed to hold in its prefix cache
        self.prefix_indexes: dict[str, PrefixIndex] = {}
        self.worker_registered = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        #: loops currently down (between a failure and their restart)
        self._loops_down: set[str] = set()
        #: message type -> handler ``(msg, sender worker id)``: the whole dispatch
        self.handlers: dict[type, Callable[[Any, str], None]] = {
            StepOutputs: self._on_step_outputs,
            Heartbeat: self._on_heartbeat,
            RegisterWorker: self._on_register,
            RequestFailed: self._on_request_failed,
            KVCacheEvents: self._on_cache_events,
            **self.handshake.handlers(),
        }

    async def start(self) -> None:
        """Start the receive, connections and liveness loops (supervised) in the running
        event loop."""
        self._tasks = [asyncio.create_task(self._supervise(name, loop)) for name, loop in (
            ("receive", self.inbox.receive_loop),
            ("connections", self.inbox.connections_loop),
            ("liveness", self.liveness.run))]

    @property
    def is_healthy(self) -> bool:
        """True while the router's loops run (started and none down)."""
        return bool(self._tasks) and not self._loops_down and not any(t.done() for t in self._tasks)

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
            self.count("router_loop_restarts", name)
            await asyncio.sleep(LOOP_RESTART_DELAY_S)
            self._loops_down.discard(name)

    async def stop(self, shutdown_workers: bool = False) -> None:
        """Stop the loops and close the socket; with ``shutdown_workers`` every registered
        worker is first told to shut down."""
        if shutdown_workers:
            for w in list(self.registry.workers.values()):
                self.send(w.worker_id, ShutdownWorker())
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.socket.close()

    # -- the cluster as policies see it (ClusterView) -------------------------------------
    @property
    def num_inflight(self) -> int:
        """Requests the router holds (routed, not yet ended)."""
        return len(self.handles)

    def alive_workers(self, role: str | None = None) -> list[WorkerInfo]:
        """Alive workers, of ``role`` or all (draining ones included)."""
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

    def count(self, series: str, *labels: str, amount: float = 1.0) -> None:
        """Add ``amount`` to the counter ``series`` of the server metrics (if any) with
        the model name and ``labels``."""
        if self.metrics is not None:
            getattr(self.metrics, series).labels(self.metrics.model_name, *labels).inc(amount)

    def observe(self, series: str, value: float) -> None:
        """Record ``value`` in the histogram ``series`` of the server metrics (if any)."""
        if self.metrics is not None:
            getattr(self.metrics, series).labels(self.metrics.model_name).observe(value)

    # -- entry -----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, sibling: RequestHandle | None = None
                    ) -> RequestHandle:
        """Route a request (see the module docstring). ``sibling``: another choice of the
        same prompt (``n > 1``); while its remote prefill is under way this one goes to the
        same decode worker, to start from the prefix cache once that KV is in (one prefill
        for all the choices) when the worker keeps a prefix cache.

        Raises:
            NoWorkerAvailable: no accepting decode worker, its queue is full, or the
                in-flight limit is reached.
        """
        if self.num_inflight >= self.max_num_inflight:
            raise NoWorkerAvailable(
                f"server is at its limit of {self.max_num_inflight} requests in flight")
        shared = self._sibling_route(sibling)
        route = shared or self.policy.route(
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
        self.count("route_decisions", route.kind)
        handle = RequestHandle(request_id, decode.worker_id, route.kind,
                               list(prompt_token_ids), params)
        self.handles[request_id] = handle
        decode.inflight.add(request_id)
        if route.kind == REMOTE_PREFILL:
            handle.remote = RemotePrefill(list(prompt_token_ids), params)
            if route.prefill is not None:  # its queue grows now, not once D has reserved
                handle.remote.preferred_prefill_id = route.prefill.worker_id
                route.prefill.queue_prefill(request_id, len(prompt_token_ids))
            self.send(decode.worker_id, ExpectRemoteKV(
                request_id, list(prompt_token_ids), params, time.time()))
        else:
            decode.queue_prefill(request_id,  # shared: the prompt's tail
                                 decode.info.block_size if shared else
                                 len(prompt_token_ids) - route.num_cached_tokens)
            self.send(decode.worker_id, GenerateRequest(
                request_id, list(prompt_token_ids), params, time.time(),
                wait_for=sibling.request_id if shared else None))
        return handle

    def _sibling_route(self, sibling: RequestHandle | None) -> Route | None:
        """A local route to the decode worker where ``sibling`` waits for its remote KV, or
        None: no such wait, or that worker no longer accepts requests or keeps no prefix
        cache."""
        if sibling is None or sibling.finished or sibling.remote is None:
            return None
        worker = self.registry.workers.get(sibling.worker_id)
        if (worker is None or not worker.info.enable_prefix_caching
                or worker not in self.accepting("decode")):
            return None
        return Route(LOCAL, worker)

    # -- exits -----------------------------------------------------------------------------
    def abort(self, request_id: str) -> None:
        """Stop a request on its workers (no-op if it already finished)."""
        handle = self.handles.get(request_id)
        if handle is not None:
            self.end(handle, CLIENT_GONE)

    def fail_all(self, why: str) -> None:
        """End every request in flight with :class:`WorkerFailed` (``why``) and abort it on
        its workers (shutdown)."""
        for handle in list(self.handles.values()):
            self.end(handle, SHUTDOWN, WorkerFailed(why))

    def end(self, handle: RequestHandle, outcome: str, exc: Exception | None = None,
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
        self._forget_backlog(handle)
        worker = self.registry.workers.get(handle.worker_id)
        if worker is not None:
            worker.inflight.discard(rid)
            if abort_workers:
                self.send(worker.worker_id, AbortRequests([rid]))
        remote = handle.remote
        if remote is not None and remote.prefill_worker_id is not None:
            pworker = self.registry.workers.get(remote.prefill_worker_id)
            if pworker is not None:
                pworker.inflight.discard(rid)
                if abort_workers and remote.first_token_id is None:
                    self.send(pworker.worker_id, AbortRequests([rid]))

    def move(self, handle: RequestHandle, decode: WorkerInfo) -> None:
        """Make ``decode`` the decode worker of ``handle`` (the old one forgets it)."""
        old = self.registry.workers.get(handle.worker_id)
        if old is not None:
            old.inflight.discard(handle.request_id)
            old.prefill_backlog.pop(handle.request_id, None)
        handle.worker_id = decode.worker_id
        decode.inflight.add(handle.request_id)

    def _forget_backlog(self, handle: RequestHandle) -> None:
        """``handle``'s prompt no longer waits for a prefill on any of its workers."""
        remote = handle.remote
        ids = (handle.worker_id,) if remote is None else (
            handle.worker_id, remote.prefill_worker_id, remote.preferred_prefill_id)
        for worker in filter(None, map(self.registry.workers.get, ids)):
            worker.prefill_backlog.pop(handle.request_id, None)

    # -- worker outputs ----------------------------------------------------------------------
    def _on_step_outputs(self, msg: StepOutputs, sender: str = "") -> None:
        for delta in msg.deltas:
            handle = self.handles.get(delta.request_id)
            if handle is None:
                continue  # ended meanwhile
            if handle.worker_id != msg.worker_id:
                self.socket.drop("not_its_request", sender, f"delta for {delta.request_id!r}")
                continue
            if handle.num_deltas == 0:  # its prefill is done
                self._forget_backlog(handle)
            handle.deliver(delta)
            if delta.finished:
                self.end(handle, FINISHED, abort_workers=False)

    def _on_request_failed(self, msg: RequestFailed, _sender: str = "") -> None:
        handle = self.handles.get(msg.request_id)
        if handle is not None:
            self.end(handle, FAILED, RequestRejected(msg.message) if msg.is_client_error
                      else WorkerFailed(msg.message))

    def _on_cache_events(self, msg: KVCacheEvents, _sender: str = "") -> None:
        worker = self.registry.workers.get(msg.worker_id)
        if worker is None or worker.info.role != "decode":
            return
        if len(msg.stored) != len(msg.block_hashes):
            self.socket.drop("malformed", msg.worker_id, "cache events of unequal lengths")
            return
        self._prefix_index(worker).apply(msg.stored, msg.block_hashes, msg.reset)

    def _on_heartbeat(self, msg: Heartbeat, _sender: str = "") -> None:
        if self.registry.heartbeat(msg) is None:
            self.send(msg.worker_id, ReregisterRequest())

    def _on_register(self, msg: RegisterWorker, _sender: str = "") -> None:
        self.registry.register(msg)
        self.send(msg.worker_id, RegisterAck(self.registry.heartbeat_interval_s))
        logger.info("worker %s (%s, pid %d) registered", msg.worker_id, msg.role, msg.pid)
        self.worker_registered.set()
        if msg.role == "decode":
            self.recovery.place_orphans()

    # -- socket ----------------------------------------------------------------------------
    def send(self, worker_id: str, msg) -> None:
        """Queue ``msg`` for a worker without waiting (:meth:`WorkerSocket.send`)."""
        self.socket.send(worker_id, msg)

    def drain(self, max_messages: int) -> int:
        """Handle the messages already queued, up to ``max_messages`` (:meth:`Inbox.drain`);
        returns how many were handled."""
        return self.inbox.drain(max_messages)
