"""Which worker each TCP connection of the router's socket carries, and which connections
closed: a worker whose process died is dropped the moment its connection closes, not after
its missed heartbeats, whoever started it (``serve``'s supervisor or a person by hand).

How: every received message carries the file descriptor of the connection it came on
(``ZMQ_SRCFD``), so the router learns ``fd -> sender``; a socket monitor reports
``EVENT_DISCONNECTED`` with the fd of each connection that closed.

NOTE (fd reuse): libzmq reports a connection's ``EVENT_DISCONNECTED`` before it closes the
fd, so before the kernel can hand that number to a new connection, let alone before a
message from it is queued. The router therefore reads the pending connection events before
it records a connection it has not seen (:meth:`ConnectionWatch.is_known`): a closed
connection is never mistaken for the new one that reuses its number.

Decision (two connections per worker): each worker has a main and a heartbeat connection
(identities ``<id>`` and ``<id>/heartbeat``). Either closing drops the worker: a process
that died closes both, and libzmq closes a connection only when its peer closed it, the
network failed, or the peer broke the protocol (e.g. a frame over the size limit). A live
worker whose connection failed is dropped too; its requests migrate, and it is back within
a heartbeat (its next heartbeat is answered with ``ReregisterRequest``). A worker that
reconnects because the *router* restarted is never dropped by this: the new router process
has never seen its old connections.

The monitor also reports failed CURVE handshakes (a peer without the cluster secret, or
plain zmq): one monitor per socket is all libzmq allows, so this watch counts them
(``pdserve:refused_connections_total{reason="handshake_failed"}``) in place of
:meth:`pdserve.security.PeerGate.watch`.
"""

from __future__ import annotations

import logging
from typing import Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

logger = logging.getLogger(__name__)

#: The events the router's socket monitor reports.
MONITOR_EVENTS = (zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                  | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
#: Suffix of a worker's heartbeat connection identity.
HEARTBEAT_SUFFIX = "/heartbeat"


class ConnectionWatch:
    """The connection events of one bound ROUTER socket, read without blocking.

    Args:
        sock: the bound zmq.asyncio ROUTER socket (one monitor per socket: nothing else
            may monitor it).
        on_handshake_failed: called with the endpoint of each failed CURVE handshake.

    Attributes:
        sender_by_fd: fd of an open connection -> the identity that sent on it.
        num_closed: connections seen closing (any, known or not).
    """

    def __init__(self, sock: zmq.asyncio.Socket,
                 on_handshake_failed: Callable[[str], None] = lambda _endpoint: None) -> None:
        self.sock = sock
        self.monitor = sock.get_monitor_socket(MONITOR_EVENTS)
        #: synchronous view of the monitor: reads that never wait and never yield
        self._events = zmq.Socket.shadow(self.monitor.underlying)
        self.on_handshake_failed = on_handshake_failed
        self.sender_by_fd: dict[int, str] = {}
        self.num_closed = 0

    async def wait(self) -> None:
        """Return once a connection event is pending."""
        await self.monitor.poll(flags=zmq.POLLIN)

    def is_known(self, fd: int | None, sender: str) -> bool:
        """Whether the connection ``fd`` is already recorded as ``sender``'s (None: the
        message came on no connection the router can name, e.g. in a test)."""
        return fd is None or self.sender_by_fd.get(fd) == sender

    def note(self, fd: int, sender: str) -> None:
        """Record that ``sender`` (an identity, heartbeat suffix included) sent on ``fd``.
        Read the pending events (:meth:`closed_workers`) first: see the module NOTE."""
        self.sender_by_fd[fd] = sender

    def closed_workers(self) -> list[str]:
        """Read every pending event without waiting; the ids of the workers whose
        connection closed (in order; unknown connections are skipped), each once."""
        workers: list[str] = []
        while True:
            try:
                event = parse_monitor_message(self._events.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return workers
            kind, fd = event["event"], int(event["value"])
            if kind == zmq.EVENT_DISCONNECTED:
                self.num_closed += 1
                sender = self.sender_by_fd.pop(fd, None)
                worker_id = None if sender is None else sender.removesuffix(HEARTBEAT_SUFFIX)
                if worker_id is not None and worker_id not in workers:
                    workers.append(worker_id)
            elif kind in (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
                          zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL):
                endpoint = event.get("endpoint", b"")
                self.on_handshake_failed(endpoint.decode("utf-8", "replace")
                                         if isinstance(endpoint, bytes) else str(endpoint))

    def close(self) -> None:
        """Stop monitoring and close the monitor socket (before the socket itself)."""
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(0)
