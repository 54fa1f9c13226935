"""Decode worker process: runs the engine's step loop and talks to the router over zmq.

The loop never blocks on the socket while the engine has work: it drains incoming messages
without waiting, runs one engine step and sends that step's outputs as one message. When
idle it waits on the socket instead of spinning. Heartbeats come from their own thread and
socket, so a long step (a big prefill chunk on CPU) never makes the worker look dead.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import zmq

from pdserve.engine.llm_engine import LLMEngine
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

logger = logging.getLogger(__name__)

#: Re-send the registration this often until the router acknowledges it.
REGISTER_RETRY_S = 1.0


class DecodeWorker:
    """Engine loop of one decode worker.

    Args:
        engine: the engine (already loaded).
        router_address: zmq address of the router's ROUTER socket (``tcp://host:port``).
        worker_id: unique name; also the zmq identity.
        model_name: the served model name reported to the router.
        heartbeat_interval_s: load report period.
    """

    role = "decode"

    def __init__(self, engine: LLMEngine, router_address: str, worker_id: str,
                 model_name: str, heartbeat_interval_s: float = 1.0) -> None:
        self.engine = engine
        self.router_address = router_address
        self.worker_id = worker_id
        self.model_name = model_name
        self.heartbeat_interval_s = heartbeat_interval_s
        self.codec = MessageCodec()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, worker_id.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(router_address)
        self.is_registered = False
        self.should_stop = False

    def _send(self, msg) -> None:
        self.sock.send(self.codec.encode(msg), copy=False)

    def _register(self) -> None:
        self._send(RegisterWorker(
            worker_id=self.worker_id, role=self.role, model_name=self.model_name,
            max_model_len=self.engine.max_model_len, block_size=self.engine.config.block_size,
            num_kv_blocks=self.engine.block_manager.num_blocks, pid=os.getpid(),
        ))

    def _load(self) -> Heartbeat:
        """A snapshot of the engine's load (plain counters, safe to read from another thread)."""
        bm = self.engine.block_manager
        sched = self.engine.scheduler
        return Heartbeat(
            worker_id=self.worker_id, num_running=sched.num_running,
            num_waiting=sched.num_waiting, num_free_blocks=bm.num_free_blocks,
            kv_cache_usage=bm.usage, num_preemptions=sched.num_preemptions,
            num_prefix_hit_tokens=bm.num_prefix_hit_tokens,
            num_prefix_queried_tokens=bm.num_prefix_queried_tokens,
        )

    def _heartbeat_loop(self) -> None:
        """Thread: report load every ``heartbeat_interval_s`` on a socket of its own."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"{self.worker_id}/heartbeat".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.router_address)
        codec = MessageCodec()
        try:
            while not self.should_stop:
                if self.is_registered:
                    sock.send(codec.encode(self._load()))
                time.sleep(self.heartbeat_interval_s)
        finally:
            sock.close(0)

    def _handle(self, data: bytes) -> None:
        try:
            msg = self.codec.decode_to_worker(data)
        except Exception as exc:  # malformed bytes must not kill the worker
            logger.warning("dropping malformed message: %s", exc)
            return
        if isinstance(msg, GenerateRequest):
            try:
                self.engine.add_request(msg.request_id, msg.prompt_token_ids,
                                        msg.sampling_params, msg.arrival_time)
            except ValueError as exc:
                self._send(RequestFailed(msg.request_id, str(exc)))
        elif isinstance(msg, AbortRequests):
            for rid in msg.request_ids:
                self.engine.abort_request(rid)
        elif isinstance(msg, RegisterAck):
            self.is_registered = True
            self.heartbeat_interval_s = msg.heartbeat_interval_s
        elif isinstance(msg, ReregisterRequest):
            self.is_registered = False
        elif isinstance(msg, ShutdownWorker):
            self.should_stop = True

    def _step(self) -> None:
        try:
            deltas = self.engine.step()
        except Exception:  # an engine bug fails the batch, not the worker
            logger.exception("engine step failed; failing its requests")
            for rid in list(self.engine.requests):
                self.engine.abort_request(rid)
                self._send(RequestFailed(rid, "internal engine error", is_client_error=False))
            return
        if deltas:
            self._send(StepOutputs(self.worker_id, deltas))

    def run(self) -> None:
        """Serve until SIGTERM/SIGINT or a :class:`ShutdownWorker` message."""
        def _stop(signum, frame):  # noqa: ARG001
            self.should_stop = True

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        heartbeats = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        heartbeats.start()
        last_register = 0.0
        while not self.should_stop:
            now = time.monotonic()
            if not self.is_registered and now - last_register >= REGISTER_RETRY_S:
                self._register()
                last_register = now
            busy = self.engine.has_unfinished_requests
            timeout_ms = 0 if busy else int(REGISTER_RETRY_S * 1000)
            while poller.poll(timeout_ms):
                self._handle(self.sock.recv())
                timeout_ms = 0
            if self.engine.has_unfinished_requests:
                self._step()
        logger.info("decode worker %s stopping", self.worker_id)
        heartbeats.join(timeout=2 * self.heartbeat_interval_s)
        self.sock.close(0)
        self.ctx.term()
