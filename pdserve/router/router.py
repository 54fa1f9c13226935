"""The router: owns the zmq socket to the workers, decides each request's route, runs the
remote-prefill handshake, and demultiplexes workers' outputs into per-request streams.

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
from dataclasses import dataclass

import zmq
import zmq.asyncio

from pdserve.engine.outputs import RequestDelta
from pdserve.memory import IdleTrimmer
from pdserve.security import ClusterKeys, PeerGate, secure_server
from pdserve.engine.sampling_params import SamplingParams
from pdserve.messages import (
    AbortRequests,
    ExpectRemoteKV,
    FirstToken,
    GenerateRequest,
    Heartbeat,
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
from pdserve.router.prefix_index import PrefixIndex
from pdserve.router.registry import WorkerInfo, WorkerRegistry

logger = logging.getLogger(__name__)

#: Wait between attempts to reserve KV blocks on a decode worker that was full.
RESERVE_RETRY_S = 0.05
#: Largest control message accepted (bytes); longer frames make libzmq drop the peer. A
#: 128k-token prompt with its sampling parameters encodes to well under 2 MiB.
MAX_CONTROL_MESSAGE_BYTES = 64 * 1024 * 1024
#: Pause before a failed router loop is restarted (seconds).
LOOP_RESTART_DELAY_S = 0.1


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
            then prefilled) before it ends with an error; 0 waits for ever.
        max_waiting_per_worker: requests a decode worker may hold beyond those it runs
            (its queue); when the chosen worker's is full a new request gets 503 at once.

    Raises:
        ValueError: naming the field.
    """

    prefill_threshold: int = 512
    kv_failure_policy: str = "recompute"
    reserve_timeout_s: float = 10.0
    first_token_timeout_s: float = 600.0
    max_waiting_per_worker: int = 512

    def __post_init__(self) -> None:
        if self.max_waiting_per_worker < 1:
            raise ValueError(f"max_waiting_per_worker must be >= 1, got "
                             f"{self.max_waiting_per_worker}")
        if self.first_token_timeout_s < 0:
            raise ValueError(f"first_token_timeout_s must be >= 0, got "
                             f"{self.first_token_timeout_s}")
        if self.prefill_threshold < 1:
            raise ValueError(f"prefill_threshold must be >= 1, got {self.prefill_threshold}")
        if self.kv_failure_policy not in ("recompute", "fail"):
            raise ValueError("kv_failure_policy must be 'recompute' or 'fail', got "
                             f"{self.kv_failure_policy!r}")


@dataclass
class RemotePrefill:
    """Handshake state of one remote-prefill request."""

    prefill_worker_id: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    started_s: float
    first_token_id: int | None = None
    is_kv_sent: bool = False
    is_resumed: bool = False


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
        self.output_token_ids: list[int] = []  # tokens handed to the consumer
        self.is_retried = False
        self.remote: RemotePrefill | None = None
        self.queue: asyncio.Queue[RequestDelta | Exception] = asyncio.Queue()
        self.finished = False

    def deliver(self, delta: RequestDelta) -> None:
        """Hand a worker's delta to the consumer and remember its tokens (for a retry)."""
        self.queue.put_nowait(delta)
        self.num_deltas += 1
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


class Router:
    """Worker registry + routing + remote-prefill orchestration + output demultiplexing.

    Args:
        address: zmq address to bind (``tcp://127.0.0.1:5557``; port 0 picks a free one).
        routing: the routing policy.
        metrics: series to record routing and transfer events in (optional).
        heartbeat_interval_s: the period workers report at.
        max_missed_heartbeats: silence after which a worker is dead.
        max_num_inflight: requests in flight above which new ones get 503.
        cluster_keys: the deployment's CURVE keys (:mod:`pdserve.security`): only peers
            holding the cluster secret can connect; None runs unauthenticated.

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
                 cluster_keys: ClusterKeys | None = None) -> None:
        self.bind_address = address
        self.routing = routing or RoutingConfig()
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

    # -- placement -----------------------------------------------------------------------
    @property
    def num_inflight(self) -> int:
        return len(self.handles)

    def alive_workers(self, role: str | None = None) -> list[WorkerInfo]:
        return self.registry.alive(role)

    def _count(self, series: str, *labels: str, amount: float = 1.0) -> None:
        if self.metrics is not None:
            getattr(self.metrics, series).labels(self.metrics.model_name, *labels).inc(amount)

    def _observe(self, series: str, value: float) -> None:
        if self.metrics is not None:
            getattr(self.metrics, series).labels(self.metrics.model_name).observe(value)

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> RequestHandle:
        """Route a request (see the module docstring).

        Raises:
            NoWorkerAvailable: no alive decode worker, or the in-flight limit is reached.
        """
        if self.num_inflight >= self.max_num_inflight:
            raise NoWorkerAvailable(
                f"server is at its limit of {self.max_num_inflight} requests in flight")
        decode, num_cached = self._choose_decode(prompt_token_ids)
        if decode is None:
            raise NoWorkerAvailable("no decode worker is available")
        running = decode.load.num_running if decode.load is not None else 0
        if len(decode.inflight) - running >= self.routing.max_waiting_per_worker:
            raise NoWorkerAvailable(
                f"every decode worker's queue is full ({self.routing.max_waiting_per_worker} "
                "waiting requests)")
        route = "local"
        if params.prompt_logprobs is None and \
                len(prompt_token_ids) - num_cached >= self.routing.prefill_threshold:
            prefill = self.registry.least_loaded("prefill")
            if prefill is not None and decode.info.kv_address:
                route = "remote_prefill"
            else:
                route = "fallback"
                logger.info("no prefill worker for %s (%d tokens); prefilling on %s",
                            request_id, len(prompt_token_ids), decode.worker_id)
        self._count("route_decisions", route)
        self._prefix_index(decode).record(prompt_token_ids)
        handle = RequestHandle(request_id, decode.worker_id, route, list(prompt_token_ids),
                               params)
        self.handles[request_id] = handle
        decode.inflight.add(request_id)
        if route == "remote_prefill":
            handle.remote = RemotePrefill(None, list(prompt_token_ids), params, time.monotonic())
            self._send(decode.worker_id, ExpectRemoteKV(
                request_id, list(prompt_token_ids), params, time.time()))
        else:
            self._send(decode.worker_id, GenerateRequest(
                request_id, list(prompt_token_ids), params, time.time()))
        return handle

    def _prefix_index(self, worker: WorkerInfo) -> PrefixIndex:
        index = self.prefix_indexes.get(worker.worker_id)
        if index is None or index.block_size != worker.info.block_size:
            index = PrefixIndex(worker.info.block_size, worker.info.num_kv_blocks)
            self.prefix_indexes[worker.worker_id] = index
        return index

    def _choose_decode(self, prompt_token_ids: list[int]) -> tuple[WorkerInfo | None, int]:
        """The least-loaded decode worker, ties going to the longest cached prefix, and the
        prompt tokens it is believed to hold."""
        best, best_key = None, None
        for worker in self.registry.accepting("decode"):
            cached = self._prefix_index(worker).num_cached_tokens(prompt_token_ids)
            key = (worker.load_score, -cached)
            if best_key is None or key < best_key:
                best, best_key = worker, key
        return best, (0 if best_key is None else -best_key[1])

    def abort(self, request_id: str) -> None:
        """Stop a request on its workers (no-op if it already finished)."""
        handle = self.handles.pop(request_id, None)
        if handle is None:
            return
        self._release(handle, abort=True)

    def _release(self, handle: RequestHandle, abort: bool) -> None:
        rid = handle.request_id
        worker = self.registry.workers.get(handle.worker_id)
        if worker is not None:
            worker.inflight.discard(rid)
            if abort:
                self._send(worker.worker_id, AbortRequests([rid]))
        remote = handle.remote
        if remote is not None and remote.prefill_worker_id is not None:
            pworker = self.registry.workers.get(remote.prefill_worker_id)
            if pworker is not None:
                pworker.inflight.discard(rid)
                if abort and remote.first_token_id is None:
                    self._send(pworker.worker_id, AbortRequests([rid]))

    def fail_all(self, why: str) -> None:
        """End every request in flight with :class:`WorkerFailed` (``why``) and abort it on
        its workers (shutdown)."""
        for handle in list(self.handles.values()):
            self._fail(handle, WorkerFailed(why))

    def _fail(self, handle: RequestHandle, exc: Exception) -> None:
        self.handles.pop(handle.request_id, None)
        handle.queue.put_nowait(exc)
        self._release(handle, abort=True)

    # -- remote prefill handshake --------------------------------------------------------
    def _on_reserved(self, msg: KVReserved) -> None:
        handle = self.handles.get(msg.request_id)
        if handle is None or handle.remote is None:
            return
        decode = self.registry.workers.get(handle.worker_id)
        prefill = self.registry.least_loaded("prefill")
        remote = handle.remote
        if prefill is None or decode is None:
            self._count("route_decisions", "fallback")
            self._resume_locally(handle, "no prefill worker alive")
            return
        remote.prefill_worker_id = prefill.worker_id
        prefill.inflight.add(msg.request_id)
        self._send(prefill.worker_id, PrefillRequest(
            msg.request_id, remote.prompt_token_ids, remote.params, time.time(),
            decode.worker_id, decode.info.kv_address))

    def _on_refused(self, msg: KVReserveRefused) -> None:
        handle = self.handles.get(msg.request_id)
        if handle is None or handle.remote is None:
            return
        if not msg.is_capacity:
            self._fail(handle, RequestRejected(msg.message))
            return
        if time.monotonic() - handle.remote.started_s > self.routing.reserve_timeout_s:
            self._fail(handle, WorkerFailed(
                "no decode worker could reserve KV blocks in time; retry later"))
            return
        asyncio.get_running_loop().call_later(RESERVE_RETRY_S, self._retry_reserve,
                                              msg.request_id)

    def _retry_reserve(self, request_id: str) -> None:
        handle = self.handles.get(request_id)
        if handle is None or handle.remote is None:
            return
        decode = self.registry.least_loaded("decode")
        if decode is None:
            self._fail(handle, WorkerFailed("no decode worker is available"))
            return
        old = self.registry.workers.get(handle.worker_id)
        if old is not None:
            old.inflight.discard(request_id)
        handle.worker_id = decode.worker_id
        decode.inflight.add(request_id)
        remote = handle.remote
        self._send(decode.worker_id, ExpectRemoteKV(
            request_id, remote.prompt_token_ids, remote.params, time.time()))

    def _on_prefill_done(self, msg: PrefillDone) -> None:
        delta = msg.delta
        handle = self.handles.get(delta.request_id)
        if handle is None or handle.remote is None or handle.remote.is_resumed:
            return
        handle.remote.first_token_id = delta.new_token_ids[0]
        self._observe("request_prefill_time", msg.prefill_time_s)
        handle.deliver(delta)
        if delta.finished:  # the first token ends it: release D's reservation
            self.handles.pop(delta.request_id, None)
            self._release(handle, abort=True)
            return
        self._send(handle.worker_id, FirstToken(delta.request_id, delta.new_token_ids[0]))

    def _on_kv_sent(self, msg: KVSent) -> None:
        handle = self.handles.get(msg.request_id)
        pworker = self.registry.workers.get(msg.worker_id)
        if pworker is not None:
            pworker.inflight.discard(msg.request_id)
        if msg.error is not None:
            self._count("kv_transfer_failures", "send_error")
            if handle is not None and handle.remote is not None:
                self._kv_failed(handle, f"KV send failed: {msg.error}")
            return
        self._count("kv_transfer_bytes", amount=msg.num_bytes)
        self._observe("kv_transfer_seconds", msg.seconds)
        if handle is not None and handle.remote is not None:
            handle.remote.is_kv_sent = True

    def _on_kv_failed(self, msg: KVTransferFailed) -> None:
        self._count("kv_transfer_failures", msg.reason)
        handle = self.handles.get(msg.request_id)
        if handle is not None and handle.remote is not None:
            self._kv_failed(handle, f"KV transfer failed ({msg.reason})")

    def _kv_failed(self, handle: RequestHandle, why: str) -> None:
        if self.routing.kv_failure_policy == "fail":
            self._fail(handle, WorkerFailed(why))
            return
        self._resume_locally(handle, why)

    def _resume_locally(self, handle: RequestHandle, why: str) -> None:
        """Policy "recompute": the decode worker prefills itself, after the tokens the
        client already has."""
        remote = handle.remote
        if remote is None or remote.is_resumed:
            return
        remote.is_resumed = True
        logger.warning("%s: %s; recomputing the prefill on %s", handle.request_id, why,
                       handle.worker_id)
        if remote.prefill_worker_id is not None and remote.first_token_id is None:
            self._send(remote.prefill_worker_id, AbortRequests([handle.request_id]))
        outputs = [] if remote.first_token_id is None else [remote.first_token_id]
        self._send(handle.worker_id, ResumeLocally(handle.request_id, outputs))

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

    # -- socket --------------------------------------------------------------------------
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
        worker_id = sender.removesuffix("/heartbeat")
        claimed = getattr(msg, "worker_id", None)
        if isinstance(msg, RegisterWorker) and sender != msg.worker_id:
            # replies go to the identity the worker registers: it must be the sender's own
            self._drop("impostor", sender, f"registration as {msg.worker_id!r}")
            return
        if claimed is not None and claimed != worker_id:
            self._drop("impostor", sender, f"{type(msg).__name__} claims worker {claimed!r}")
            return
        if not isinstance(msg, (RegisterWorker, Heartbeat)) and \
                worker_id not in self.registry.workers:
            self._drop("unregistered", sender, type(msg).__name__)
            return
        request_id = getattr(msg, "request_id", None)
        if request_id is not None and not self._serves(worker_id, request_id):
            self._drop("not_its_request", sender, f"{type(msg).__name__} for {request_id!r}")
            return
        try:
            self._dispatch(msg, worker_id)
        except Exception:  # a bad message must not stop the router
            logger.exception("failed to handle %s", type(msg).__name__)

    def _serves(self, worker_id: str, request_id: str) -> bool:
        """Whether ``worker_id`` may report on ``request_id`` (unknown ids pass: the
        handlers ignore requests that already ended)."""
        handle = self.handles.get(request_id)
        if handle is None:
            return True
        remote = handle.remote
        return worker_id == handle.worker_id or (
            remote is not None and worker_id == remote.prefill_worker_id)

    def _dispatch(self, msg, sender: str = "") -> None:
        if isinstance(msg, StepOutputs):
            self.registry.touch(msg.worker_id)
            for delta in msg.deltas:
                handle = self.handles.get(delta.request_id)
                if handle is None:
                    continue  # aborted meanwhile
                if handle.worker_id != msg.worker_id:
                    self._drop("not_its_request", sender, f"delta for {delta.request_id!r}")
                    continue
                handle.deliver(delta)
                if delta.finished:
                    self.handles.pop(delta.request_id, None)
                    self._release(handle, abort=False)
        elif isinstance(msg, Heartbeat):
            if self.registry.heartbeat(msg) is None:
                self._send(msg.worker_id, ReregisterRequest())
        elif isinstance(msg, PrefillDone):
            self._on_prefill_done(msg)
        elif isinstance(msg, KVReserved):
            self._on_reserved(msg)
        elif isinstance(msg, KVReserveRefused):
            self._on_refused(msg)
        elif isinstance(msg, KVSent):
            self._on_kv_sent(msg)
        elif isinstance(msg, KVTransferFailed):
            self._on_kv_failed(msg)
        elif isinstance(msg, RequestFailed):
            handle = self.handles.get(msg.request_id)
            if handle is not None:
                exc = (RequestRejected(msg.message) if msg.is_client_error
                       else WorkerFailed(msg.message))
                self._fail(handle, exc)
        elif isinstance(msg, RegisterWorker):
            self.registry.register(msg)
            self._send(msg.worker_id, RegisterAck(self.registry.heartbeat_interval_s))
            logger.info("worker %s (%s, pid %d) registered", msg.worker_id, msg.role, msg.pid)
            self.worker_registered.set()

    def _expire_queued(self) -> None:
        """End requests that waited past ``first_token_timeout_s`` without a first token."""
        limit = self.routing.first_token_timeout_s
        if not limit:
            return
        now = time.monotonic()
        for handle in list(self.handles.values()):
            if handle.num_deltas == 0 and now - handle.created_s > limit:
                self._count("request_timeouts", "first_token")
                self._fail(handle, WorkerFailed(
                    f"no first token within {limit:g} s (the server is overloaded); "
                    "retry later"))

    async def _liveness_loop(self) -> None:
        trimmer = IdleTrimmer()
        while True:
            await asyncio.sleep(self.registry.heartbeat_interval_s / 4)
            self._expire_queued()
            trimmer.tick(bool(self.handles), time.monotonic())
            for worker in self.registry.remove_dead():
                self.prefix_indexes.pop(worker.worker_id, None)
                logger.warning("worker %s (%s) missed its heartbeats; dropping it",
                               worker.worker_id, worker.info.role)
                for handle in list(self.handles.values()):
                    remote = handle.remote
                    if handle.worker_id == worker.worker_id:
                        if not self._retry_elsewhere(handle):
                            self._fail(handle, WorkerFailed(
                                f"worker {worker.worker_id} stopped responding"))
                    elif (remote is not None and remote.prefill_worker_id == worker.worker_id
                          and not remote.is_kv_sent):
                        self._count("kv_transfer_failures", "prefill_worker_died")
                        self._kv_failed(handle, f"prefill worker {worker.worker_id} died")


def _log_send_failure(fut: asyncio.Future, worker_id: str) -> None:
    """Done-callback of a non-blocking send: log its error (never leave it unretrieved)."""
    if fut.cancelled():
        return
    exc = fut.exception()
    if exc is not None:
        logger.warning("send to %s failed: %s", worker_id, exc)
