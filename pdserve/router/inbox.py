"""The router's receiving side: from the socket to the message handlers, in order.

Messages are read without waiting and each is checked and handled before the next is read
(:meth:`Inbox.drain`), whoever drains: the receive loop after the socket became readable,
or the liveness loop before it judges anyone dead (:mod:`~pdserve.router.liveness`). A
closed connection drops its worker at once (:mod:`~pdserve.router.connections`); the
connection events are read before a message from a connection not seen before, so a closed
connection's reused fd is never taken for the new one.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.router.router import Router

logger = logging.getLogger(__name__)

#: Messages the receive loop handles before it lets the API server's handlers run.
RECV_BATCH = 256


class Inbox:
    """Reads, checks and dispatches one router's messages and connection events.

    Args:
        router: the router whose socket, registry, handlers and recovery it uses.
    """

    def __init__(self, router: Router) -> None:
        self.router = router

    async def receive_loop(self) -> None:
        """Wait for messages, then handle what is queued, :data:`RECV_BATCH` at a time."""
        while True:
            await self.router.socket.wait_message()
            while self.drain(RECV_BATCH) == RECV_BATCH:
                await asyncio.sleep(0)  # the API server's handlers run between batches

    async def connections_loop(self) -> None:
        """Drop each worker whose connection closes, the moment it does."""
        while True:
            await self.router.socket.connections.wait()
            self.on_closed_connections()

    def drain(self, max_messages: int) -> int:
        """Handle the closed connections, then up to ``max_messages`` queued messages,
        each before the next is read (never waits); returns how many were handled."""
        self.on_closed_connections()
        for num_handled in range(max_messages):
            received = self.router.socket.receive_nowait()
            if received is None:
                return num_handled
            self.on_frames(*received)
        return max_messages

    def on_closed_connections(self) -> None:
        """Drop the workers whose connection closed since the last call."""
        for worker_id in self.router.socket.connections.closed_workers():
            self.router.recovery.on_worker_exit(worker_id, "closed its connection")

    def on_frames(self, frames: list[bytes], fd: int | None = None) -> None:
        """Check one message (received on connection ``fd``; None: unknown) and dispatch it
        by type (never raises)."""
        router, connections = self.router, self.router.socket.connections
        sender = frames[0].decode("utf-8", "replace") if frames else ""
        if not connections.is_known(fd, sender):
            self.on_closed_connections()  # first: fd may be a closed connection's number
            connections.note(fd, sender)
        checked = router.socket.check(frames, router.registry.workers.__contains__,
                                      self.serves, router.handlers)
        if checked is None:
            return
        worker_id, msg = checked
        router.registry.touch(worker_id)  # any message is a sign of life
        try:
            router.handlers[type(msg)](msg, worker_id)
        except Exception:  # a bad message must not stop the router
            logger.exception("failed to handle %s", type(msg).__name__)

    def serves(self, worker_id: str, request_id: str) -> bool:
        """Whether ``worker_id`` may report on ``request_id`` (unknown ids pass: the
        handlers ignore requests that already ended)."""
        handle = self.router.handles.get(request_id)
        if handle is None:
            return True
        remote = handle.remote
        return worker_id == handle.worker_id or (
            remote is not None and worker_id == remote.prefill_worker_id)
