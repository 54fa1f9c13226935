"""The router's zmq ROUTER socket to the workers: bound once, authenticated with the
cluster's CURVE keys when it has them, sending without ever blocking the API server's
event loop, and checking every received message before the router sees it.

Hostile input: a message with other than two frames (identity, body), bytes that are not a
worker message, one claiming another worker's id, one from a worker that never registered,
one about a request another worker serves, or one of a type the router does not take is
dropped and counted (``pdserve:dropped_messages_total{reason}``); frames over
:data:`MAX_CONTROL_MESSAGE_BYTES` make libzmq drop the peer before buffering them.

Receiving never waits inside a read: the router awaits readability, then takes what is
queued with non-blocking reads (:meth:`WorkerSocket.receive_nowait`), each handled before
the next is read, so messages are handled in order whoever drains the socket (the receive
loop, or the liveness loop before it judges anyone dead). Each message comes with the fd of
its connection, for :class:`~pdserve.router.connections.ConnectionWatch`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Collection

import zmq
import zmq.asyncio

from pdserve.messages import Heartbeat, MessageCodec, RegisterWorker
from pdserve.router.connections import ConnectionWatch
from pdserve.security import ClusterKeys, PeerGate, secure_server

logger = logging.getLogger(__name__)

#: Largest control message accepted (bytes); longer frames make libzmq drop the peer. A
#: 128k-token prompt with its sampling parameters encodes to well under 2 MiB.
MAX_CONTROL_MESSAGE_BYTES = 64 * 1024 * 1024
#: Messages that may come from a worker before it is registered.
BEFORE_REGISTRATION = (RegisterWorker, Heartbeat)
#: Distinct (reason, sender) pairs of dropped messages that are logged; later ones are
#: only counted.
MAX_DROP_LOG_KEYS = 1024


class WorkerSocket:
    """One bound ROUTER socket; messages are ``[worker identity, msgspec body]``.

    Args:
        address: zmq address to bind (``tcp://127.0.0.1:5557``; port 0 picks a free one).
        cluster_keys: the deployment's CURVE keys (:mod:`pdserve.security`): only peers
            holding the cluster secret can connect; None runs unauthenticated.
        count: ``count(series, reason)`` adds one to a labelled counter
            (``refused_connections``, ``dropped_messages``).

    Attributes:
        address: the bound address (the chosen port for port 0).
        codec: the message codec (msgspec; never pickle).
    """

    def __init__(self, address: str, cluster_keys: ClusterKeys | None = None,
                 count: Callable[[str, str], None] = lambda _series, _reason: None) -> None:
        self.codec = MessageCodec()
        self.count = count
        self._dropped_logged: set[tuple[str, str]] = set()
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_MESSAGE_BYTES)
        self.gate: PeerGate | None = None
        if cluster_keys is not None:
            self.gate = PeerGate(self.ctx, cluster_keys,
                                 lambda _addr, reason: count("refused_connections", reason))
            secure_server(self.sock, cluster_keys)
        self.address = self._bind(address)
        #: connection events; it also counts failed CURVE handshakes, which the gate's own
        #: monitor would (a socket has one monitor)
        self.connections = ConnectionWatch(self.sock, self._on_handshake_failed)
        #: synchronous view of the socket: reads that never wait and never yield
        self._reader = zmq.Socket.shadow(self.sock.underlying)

    def _bind(self, address: str) -> str:
        if address.startswith("tcp://") and address.endswith(":0"):
            host = address[len("tcp://"):-2]
            port = self.sock.bind_to_random_port(f"tcp://{host}")
            return f"tcp://{host}:{port}"
        self.sock.bind(address)
        return address

    def send(self, worker_id: str, msg) -> None:
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

    async def wait_message(self) -> None:
        """Return once a message is queued (it may be taken by another reader first)."""
        await self.sock.poll(flags=zmq.POLLIN)

    def receive_nowait(self) -> tuple[list[bytes], int | None] | None:
        """The next queued message's frames (unchecked) and the fd of the connection it
        came on; None when nothing is queued. Never waits."""
        try:
            frames = self._reader.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        try:
            fd = frames[-1].get(zmq.SRCFD)
        except zmq.ZMQError:
            fd = None
        return [frame.bytes for frame in frames], fd

    def _on_handshake_failed(self, endpoint: str) -> None:
        """A peer failed the CURVE handshake: count it; log the first on each endpoint."""
        self.count("refused_connections", "handshake_failed")
        key = ("handshake_failed", endpoint)
        if key not in self._dropped_logged and len(self._dropped_logged) < MAX_DROP_LOG_KEYS:
            self._dropped_logged.add(key)
            logger.warning("a peer failed the CURVE handshake on %s (no cluster secret, a "
                           "different one, or plain zmq); further failures there are only "
                           "counted", endpoint)

    def check(self, frames: list[bytes], is_registered: Callable[[str], bool],
              serves: Callable[[str, str], bool],
              handled: Collection[type]) -> tuple[str, Any] | None:
        """Decode and check one received message (never raises).

        Args:
            frames: as received: ``[identity, body]``.
            is_registered: whether a worker id is registered.
            serves: whether a worker may report on a request id.
            handled: the message types the router takes.

        Returns:
            ``(worker id, message)``, or None when the message was dropped (counted, and
            logged once per reason and sender; see the module docstring).
        """
        sender = frames[0].decode("utf-8", "replace") if frames else ""
        if len(frames) != 2:
            return self.drop("frames", sender, f"{len(frames)} frames, expected 2")
        try:
            msg = self.codec.decode_to_router(frames[1])
        except Exception as exc:
            return self.drop("malformed", sender, str(exc)[:200])
        kind = type(msg)
        worker_id = sender.removesuffix("/heartbeat")
        claimed = getattr(msg, "worker_id", None)
        if kind is RegisterWorker and sender != msg.worker_id:
            # replies go to the identity the worker registers: it must be the sender's own
            return self.drop("impostor", sender, f"registration as {msg.worker_id!r}")
        if claimed is not None and claimed != worker_id:
            return self.drop("impostor", sender, f"{kind.__name__} claims worker {claimed!r}")
        if kind not in BEFORE_REGISTRATION and not is_registered(worker_id):
            return self.drop("unregistered", sender, kind.__name__)
        request_id = getattr(msg, "request_id", None)
        if request_id is not None and not serves(worker_id, request_id):
            return self.drop("not_its_request", sender, f"{kind.__name__} for {request_id!r}")
        if kind not in handled:  # decodable but not a worker-to-router message
            return self.drop("malformed", sender, f"unexpected {kind.__name__}")
        return worker_id, msg

    def drop(self, reason: str, sender: str, detail: str) -> None:
        """Count a dropped message; log the first of each (reason, sender)."""
        self.count("dropped_messages", reason)
        key = (reason, sender)
        if key not in self._dropped_logged and len(self._dropped_logged) < MAX_DROP_LOG_KEYS:
            self._dropped_logged.add(key)
            logger.warning("dropping a message from %r (%s): %s; further ones like it are "
                           "only counted", sender, reason, detail)

    def close(self) -> None:
        """Stop the authentication gate and the connection watch, and close the socket and
        its context."""
        if self.gate is not None:
            self.gate.stop()
        self.connections.close()
        self.sock.close(0)
        self.ctx.term()


def _log_send_failure(fut: asyncio.Future, worker_id: str) -> None:
    """Done-callback of a non-blocking send: log its error (never leave it unretrieved)."""
    if fut.cancelled():
        return
    exc = fut.exception()
    if exc is not None:
        logger.warning("send to %s failed: %s", worker_id, exc)
