"""The router: owns the zmq socket to the workers, picks a worker per request, and
demultiplexes each worker's step outputs into per-request streams.

Runs inside the API server's asyncio loop. Public surface::

    router = Router(address); await router.start()
    handle = router.add_request(request_id, prompt_token_ids, params)   # may raise
    async for delta in handle: ...      # RequestDelta objects until finished
    router.abort(request_id)            # e.g. client went away
"""

from __future__ import annotations

import asyncio
import logging
import time

import zmq
import zmq.asyncio

from pdserve.engine.outputs import RequestDelta
from pdserve.engine.sampling_params import SamplingParams
from pdserve.messages import (
    AbortRequests,
    GenerateRequest,
    Heartbeat,
    MessageCodec,
    RegisterAck,
    RegisterWorker,
    ReregisterRequest,
    RequestFailed,
    ShutdownWorker,
    StepOutputs,
)
from pdserve.router.registry import WorkerInfo, WorkerRegistry

logger = logging.getLogger(__name__)


class NoWorkerAvailable(RuntimeError):
    """No alive worker can take the request now (HTTP 503)."""


class RequestRejected(ValueError):
    """A worker refused the request as invalid (HTTP 400); the message is user-facing."""


class WorkerFailed(RuntimeError):
    """The worker serving a request died or failed internally (HTTP 500/503)."""


class RequestHandle:
    """One request's stream of :class:`RequestDelta`; iterate it with ``async for``.

    Iteration raises :class:`RequestRejected` or :class:`WorkerFailed` on failure.
    """

    def __init__(self, request_id: str, worker_id: str) -> None:
        self.request_id = request_id
        self.worker_id = worker_id
        self.queue: asyncio.Queue[RequestDelta | Exception] = asyncio.Queue()
        self.finished = False

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
    """Worker registry + request placement + output demultiplexing.

    Args:
        address: zmq address to bind (``tcp://127.0.0.1:5557``; port 0 picks a free one).
        heartbeat_interval_s: the period workers report at.
        max_missed_heartbeats: silence after which a worker is dead.
        max_num_inflight: requests in flight above which new ones get 503.
    """

    def __init__(self, address: str, heartbeat_interval_s: float = 1.0,
                 max_missed_heartbeats: int = 3, max_num_inflight: int = 1024) -> None:
        self.bind_address = address
        self.registry = WorkerRegistry(heartbeat_interval_s, max_missed_heartbeats)
        self.max_num_inflight = max_num_inflight
        self.codec = MessageCodec()
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.address = self._bind(address)
        self.handles: dict[str, RequestHandle] = {}
        self.worker_registered = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    def _bind(self, address: str) -> str:
        if address.startswith("tcp://") and address.endswith(":0"):
            host = address[len("tcp://"):-2]
            port = self.sock.bind_to_random_port(f"tcp://{host}")
            return f"tcp://{host}:{port}"
        self.sock.bind(address)
        return address

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._recv_loop()),
                       asyncio.create_task(self._liveness_loop())]

    async def stop(self, shutdown_workers: bool = False) -> None:
        if shutdown_workers:
            for w in list(self.registry.workers.values()):
                self._send(w.worker_id, ShutdownWorker())
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.sock.close(0)
        self.ctx.term()

    # -- placement -----------------------------------------------------------------------
    @property
    def num_inflight(self) -> int:
        return len(self.handles)

    def alive_workers(self, role: str | None = None) -> list[WorkerInfo]:
        return self.registry.alive(role)

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> RequestHandle:
        """Send a request to the least-loaded decode worker.

        Raises:
            NoWorkerAvailable: no alive worker, or the in-flight limit is reached.
        """
        if self.num_inflight >= self.max_num_inflight:
            raise NoWorkerAvailable(
                f"server is at its limit of {self.max_num_inflight} requests in flight")
        worker = self.registry.least_loaded("decode")
        if worker is None:
            raise NoWorkerAvailable("no decode worker is available")
        handle = RequestHandle(request_id, worker.worker_id)
        self.handles[request_id] = handle
        worker.inflight.add(request_id)
        self._send(worker.worker_id, GenerateRequest(
            request_id, list(prompt_token_ids), params, time.time()))
        return handle

    def abort(self, request_id: str) -> None:
        """Stop a request on its worker (no-op if it already finished)."""
        handle = self.handles.pop(request_id, None)
        if handle is None:
            return
        worker = self.registry.workers.get(handle.worker_id)
        if worker is not None:
            worker.inflight.discard(request_id)
            self._send(worker.worker_id, AbortRequests([request_id]))

    # -- socket --------------------------------------------------------------------------
    def _send(self, worker_id: str, msg) -> None:
        try:
            self.sock.send_multipart([worker_id.encode(), self.codec.encode(msg)],
                                     flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # unroutable (worker gone) or full: liveness handles it
            logger.warning("send to %s failed: %s", worker_id, exc)

    async def _recv_loop(self) -> None:
        while True:
            identity, data = await self.sock.recv_multipart()
            try:
                msg = self.codec.decode_to_router(data)
            except Exception as exc:
                logger.warning("dropping malformed message from %r: %s", identity, exc)
                continue
            self._dispatch(msg)

    def _dispatch(self, msg) -> None:
        if isinstance(msg, StepOutputs):
            self.registry.touch(msg.worker_id)
            worker = self.registry.workers.get(msg.worker_id)
            for delta in msg.deltas:
                handle = self.handles.get(delta.request_id)
                if handle is None:
                    continue  # aborted meanwhile
                handle.queue.put_nowait(delta)
                if delta.finished:
                    self._forget(delta.request_id, worker)
        elif isinstance(msg, Heartbeat):
            if self.registry.heartbeat(msg) is None:
                self._send(msg.worker_id, ReregisterRequest())
        elif isinstance(msg, RequestFailed):
            handle = self.handles.get(msg.request_id)
            if handle is not None:
                exc = (RequestRejected(msg.message) if msg.is_client_error
                       else WorkerFailed(msg.message))
                handle.queue.put_nowait(exc)
                self._forget(msg.request_id, self.registry.workers.get(handle.worker_id))
        elif isinstance(msg, RegisterWorker):
            self.registry.register(msg)
            self._send(msg.worker_id, RegisterAck(self.registry.heartbeat_interval_s))
            logger.info("worker %s (%s, pid %d) registered", msg.worker_id, msg.role, msg.pid)
            self.worker_registered.set()

    def _forget(self, request_id: str, worker: WorkerInfo | None) -> None:
        self.handles.pop(request_id, None)
        if worker is not None:
            worker.inflight.discard(request_id)

    async def _liveness_loop(self) -> None:
        while True:
            await asyncio.sleep(self.registry.heartbeat_interval_s / 2)
            for worker in self.registry.remove_dead():
                logger.warning("worker %s missed its heartbeats; dropping it", worker.worker_id)
                for rid in list(worker.inflight):
                    handle = self.handles.pop(rid, None)
                    if handle is not None:
                        handle.queue.put_nowait(
                            WorkerFailed(f"worker {worker.worker_id} stopped responding"))
