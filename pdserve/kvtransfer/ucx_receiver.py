"""The UCX receiver: headers from every sender on one tag, each message's parts received
beside them into a staging buffer (the wire format is in :mod:`ucx_transport`'s doc)."""

from __future__ import annotations

import asyncio
import itertools
import queue
import struct
import threading
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import zmq
import zmq.asyncio

from pdserve.kvtransfer.errors import KVFormatError, KVTransferTimeout
from pdserve.kvtransfer.transport import KVReceiverConfig, ReceivedKV, StagingBuffers
from pdserve.kvtransfer.ucx_bootstrap import HELLO as _HELLO
from pdserve.kvtransfer.wire import KVHeader, decode_header

DEFAULT_ADDRESS = "tcp://127.0.0.1:*"  # the zmq bootstrap socket
HEADER_TAG = 0xFFFF_FFFF_0000_0001  # sender ids stay below 2**31, so no payload tag collides
MAX_HEADER_FRAME_BYTES = 1 << 16
MAX_DRAINS = 4  # refused messages whose parts are taken off UCX's queues at once
MAX_ABANDONED = 8  # staging buffers given up to parts that never came (then: wait for them)
_FRAME_PREFIX = struct.Struct("<QI")  # payload_tag, header_len

if TYPE_CHECKING:
    from pdserve.kvtransfer.ucx_transport import UcxTransport


class UcxReceiver:
    """Receives ahead: a task on the loop thread pulls each message into a free staging
    buffer as soon as its header arrives (while the caller works on the previous one);
    ``recv`` hands messages out as they complete."""

    def __init__(self, transport: UcxTransport, config: KVReceiverConfig) -> None:
        self._transport = transport
        self._num_buffers = config.num_buffers
        self._staging = StagingBuffers(config.num_buffers, config.max_message_bytes)
        self._completed: queue.Queue = queue.Queue()  # ReceivedKV | KVTransferError
        self._num_held = 0  # handed out by recv() and not yet released
        self._lock = threading.Lock()
        self._free_slots: asyncio.Semaphore | None = None  # loop thread only
        self._tasks: list[asyncio.Task] = []
        self._authenticate = config.authenticate
        self._draining: set[asyncio.Task] = set()  # refused messages' parts (loop thread)
        self._receiving: set[asyncio.Task] = set()  # accepted messages' parts (loop thread)
        self._parts_timeout_s = config.parts_timeout_s
        # (parts' future, its old staging buffer) given up after parts_timeout_s (loop thread)
        self._abandoned: dict[asyncio.Future, np.ndarray] = {}  # freed if the parts come
        # The bootstrap socket lives on the loop thread only, from bind to close, so that
        # asyncio never watches a closed (and possibly reused) file descriptor.
        self._address = transport.run(self._start(config.address or DEFAULT_ADDRESS),
                                      timeout_s=10.0, what="UCX receiver start")

    @property
    def address(self) -> str:
        """The bootstrap endpoint senders connect to, with the port resolved."""
        return self._address

    def recv(self, *, timeout_s: float) -> ReceivedKV:
        """The next message received ahead (arrival order); a receive error raises here."""
        with self._lock:
            if self._num_held >= self._num_buffers:
                raise RuntimeError(f"all {self._num_buffers} receive buffers are held; "
                                   "release() a ReceivedKV before receiving more")
        try:
            item = self._completed.get(timeout=timeout_s)
        except queue.Empty:
            raise KVTransferTimeout(f"no KV message at {self._address} within "
                                    f"{timeout_s} s") from None
        if isinstance(item, Exception):
            raise item
        with self._lock:
            self._num_held += 1
        return item

    def close(self) -> None:
        """Stop the bootstrap and receive tasks on the loop thread."""
        if self._tasks:
            self._transport.run(self._stop(), timeout_s=10.0, what="UCX receiver close")

    def _release(self, index: int) -> None:
        """ReceivedKV.release(), from any thread."""
        self._staging.release(index)
        with self._lock:
            self._num_held -= 1
        self._transport.call_soon(self._free_slots.release)

    async def _start(self, address: str) -> str:
        sock = self._transport.async_zmq_ctx.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(address)
        except zmq.ZMQError:
            sock.close()
            raise
        self._free_slots = asyncio.Semaphore(self._num_buffers)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._serve_bootstrap(sock)),
                       loop.create_task(self._pump())]
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    async def _stop(self) -> None:
        tasks = self._tasks + list(self._draining) + list(self._receiving)
        tasks += list(self._abandoned)
        self._tasks = []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _serve_bootstrap(self, sock: zmq.asyncio.Socket) -> None:
        """Answer each sender's hello with this worker's UCX address and a new sender id."""
        worker_address = self._transport.ctx.worker_address.tobytes()
        try:
            for sender_id in itertools.count(1):
                request = await sock.recv_multipart()  # every frame, so REP can answer
                reply = ([worker_address, sender_id.to_bytes(4, "little")]
                         if request == [_HELLO] else [b"", b""])
                await sock.send_multipart(reply)
        finally:
            sock.close()

    async def _pump(self) -> None:
        """Receive headers forever; each accepted one's parts go to a free staging buffer in
        a task of their own (:meth:`_receive`)."""
        ctx = self._transport.ctx
        header_buf = np.empty(MAX_HEADER_FRAME_BYTES, dtype=np.uint8)
        while True:
            try:  # anyone can send here: no frame may end this task
                await ctx.recv(header_buf, tag=HEADER_TAG)
            except Exception as e:  # e.g. a frame over MAX_HEADER_FRAME_BYTES (truncated)
                self._completed.put(KVFormatError(f"KV header frame: {type(e).__name__}"))
                continue
            try:
                payload_tag, header_len = _FRAME_PREFIX.unpack_from(header_buf)
                header = decode_header(header_buf[_FRAME_PREFIX.size:
                                                  _FRAME_PREFIX.size + header_len])
                if self._authenticate is not None and not self._authenticate(header):
                    self._drain_aside(header, payload_tag)  # the pump never waits for it
                    raise KVFormatError(f"unauthenticated KV header for "
                                        f"{header.request_id[:64]!r}: dropped unread")
                if header.num_message_bytes > self._staging.max_message_bytes:
                    self._drain_aside(header, payload_tag, any_size=True)
                    raise KVFormatError(
                        f"message of {header.num_message_bytes} bytes (request "
                        f"{header.request_id!r}) exceeds max_message_bytes="
                        f"{self._staging.max_message_bytes}")
            except KVFormatError as e:
                self._completed.put(e)
                continue
            await self._free_slots.acquire()
            index, payload, scales = self._staging.acquire(header)
            task = asyncio.get_running_loop().create_task(
                self._receive(header, index, payload, scales, payload_tag))
            self._receiving.add(task)
            task.add_done_callback(self._receiving.discard)

    async def _receive(self, header: KVHeader, index: int, payload: memoryview,
                       scales: memoryview, payload_tag: int) -> None:
        """Receive one message's parts into staging buffer ``index``; beside the pump, so a
        sender that dies between header and payload holds only this task (the buffer is
        replaced after ``parts_timeout_s``: UCX cannot take back a posted receive)."""
        parts = asyncio.ensure_future(self._recv_parts(payload, scales, payload_tag))
        parts.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved
        try:
            await asyncio.wait_for(asyncio.shield(parts), self._parts_timeout_s)
        except asyncio.TimeoutError:
            if len(self._abandoned) < MAX_ABANDONED:
                self._abandoned[parts] = self._staging.replace(index)
                parts.add_done_callback(lambda f: self._abandoned.pop(f, None))
                error = f"not received within {self._parts_timeout_s} s"
            else:  # keep the buffer held: it frees when (if) the parts come
                await asyncio.gather(parts, return_exceptions=True)
                error = "received late"
            self._fail(index, KVFormatError(f"KV payload of {header.request_id!r}: {error}"))
            return
        except Exception as e:  # ucxx errors: truncated message, peer gone
            self._fail(index, KVFormatError(
                f"KV payload of {header.request_id!r}: {type(e).__name__}: {e}"))
            return
        self._completed.put(ReceivedKV(header, payload, scales,
                                       on_release=partial(self._release, index)))

    def _fail(self, index: int, error: KVFormatError) -> None:
        self._staging.release(index)
        self._free_slots.release()
        self._completed.put(error)

    async def _recv_parts(self, payload: memoryview, scales: memoryview,
                          payload_tag: int) -> None:
        parts = [self._transport.ctx.recv(payload, tag=payload_tag)]
        if scales.nbytes:
            parts.append(self._transport.ctx.recv(scales, tag=payload_tag + 1))
        # both done before the buffer may be reused, even when one of them failed
        for result in await asyncio.gather(*parts, return_exceptions=True):
            if isinstance(result, BaseException):
                raise result

    def _drain_aside(self, header: KVHeader, payload_tag: int, any_size: bool = False) -> None:
        """Take a refused header's parts off UCX's queues in a task of their own (at most
        MAX_DRAINS at once; none over ``max_message_bytes`` unless ``any_size``, for an
        authentic header): a peer that sends none holds only that task."""
        if len(self._draining) < MAX_DRAINS and (
                any_size or header.num_message_bytes <= self._staging.max_message_bytes):
            task = asyncio.get_running_loop().create_task(self._discard(header, payload_tag))
            self._draining.add(task)
            task.add_done_callback(lambda t: (self._draining.discard(t),
                                              t.cancelled() or t.exception()))

    async def _discard(self, header: KVHeader, payload_tag: int) -> None:
        """Consume a rejected message's parts so they do not linger in UCX's queues."""
        sink = memoryview(np.empty(header.num_message_bytes, dtype=np.uint8))
        await self._recv_parts(sink[: header.payload_bytes],
                               sink[header.payload_bytes:], payload_tag)
