"""In-process transport: a bounded queue per receiver address (tests, colocated workers).

``send`` snapshots the header bytes and both buffers into the queue (so the caller may
reuse its buffers at once); ``recv`` copies them into a staging buffer, like a wire would.
Senders and receivers must come from the same :class:`InprocTransport` instance.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Sequence

from pdserve.kvtransfer.errors import KVFormatError, KVTransferTimeout
from pdserve.kvtransfer.transport import (
    CompletedSend, KVReceiverConfig, ReceivedKV, StagingBuffers, check_send_buffers,
    send_within)
from pdserve.kvtransfer.wire import KVHeader, decode_header, encode_header

# Messages queued per receiver before send() blocks (then times out).
MAX_QUEUED_MESSAGES = 64


class InprocTransport:
    """Transport over in-memory queues, one per receiver address, for tests and
    colocated workers; addresses are ``inproc://kv-N``."""
    name = "inproc"

    def __init__(self) -> None:
        self._queues: dict[str, queue.Queue] = {}
        self._lock = threading.Lock()
        self._next_id = itertools.count()

    def create_receiver(self, config: KVReceiverConfig) -> InprocReceiver:
        """A receiver at ``config.address`` (default: a fresh ``inproc://kv-N``); ValueError
        if that address already has one."""
        address = config.address or f"inproc://kv-{next(self._next_id)}"
        with self._lock:
            if address in self._queues:
                raise ValueError(f"address: {address!r} already has a receiver")
            q: queue.Queue = queue.Queue(maxsize=MAX_QUEUED_MESSAGES)
            self._queues[address] = q
        return InprocReceiver(address, q, config, on_close=lambda: self._remove(address))

    def create_sender(self, address: str, *, timeout_s: float) -> InprocSender:
        """A sender to the receiver at ``address``; KVTransferTimeout at once if there is
        none (nothing to wait for in-process)."""
        with self._lock:
            q = self._queues.get(address)
        if q is None:
            raise KVTransferTimeout(f"no inproc receiver at {address!r}")
        return InprocSender(q)

    def close(self) -> None:
        """Forget every receiver's queue; later senders find no receiver."""
        with self._lock:
            self._queues.clear()

    def _remove(self, address: str) -> None:
        with self._lock:
            self._queues.pop(address, None)


class InprocSender:
    """Puts copies of each message on one receiver's queue."""
    def __init__(self, q: queue.Queue) -> None:
        self._queue = q

    def send_nowait(self, header: KVHeader, buffers: Sequence, *,
                    timeout_s: float) -> CompletedSend:
        """Copy the header and both buffers into the receiver's queue; the handle is done
        at once. Raises KVTransferTimeout if the queue stays full for ``timeout_s``."""
        payload, scales = check_send_buffers(header, buffers)
        item = (encode_header(header), bytes(payload), bytes(scales))
        try:
            self._queue.put(item, timeout=timeout_s)
        except queue.Full:
            raise KVTransferTimeout(f"inproc send of {header.request_id!r}: receiver queue "
                                    f"full for {timeout_s} s") from None
        return CompletedSend()  # the bytes were copied: the buffers are free already

    def send(self, header: KVHeader, buffers: Sequence, *, timeout_s: float) -> None:
        """The same as :meth:`send_nowait`: the copy is the whole send."""
        send_within(self, header, buffers, timeout_s)

    def close(self) -> None:
        """Nothing to release: the queue belongs to the receiver."""
        pass


class InprocReceiver:
    """Takes messages off its queue and copies each into a staging buffer."""
    def __init__(self, address: str, q: queue.Queue, config: KVReceiverConfig,
                 on_close) -> None:
        self._address = address
        self._queue = q
        self._staging = StagingBuffers(config.num_buffers, config.max_message_bytes)
        self._on_close = on_close

    @property
    def address(self) -> str:
        """The ``inproc://`` address senders pass to ``create_sender``."""
        return self._address

    def recv(self, *, timeout_s: float) -> ReceivedKV:
        """The next queued message, copied into a free staging buffer. Raises
        KVTransferTimeout, KVFormatError (parts disagree with the header), RuntimeError
        (every staging buffer is held)."""
        self._staging.check_free()
        try:
            header_bytes, payload, scales = self._queue.get(timeout=timeout_s)
        except queue.Empty:
            raise KVTransferTimeout(f"no KV message at {self._address} within "
                                    f"{timeout_s} s") from None
        header = decode_header(header_bytes)
        if len(payload) != header.payload_bytes or len(scales) != header.scale_bytes:
            raise KVFormatError(f"message parts of ({len(payload)}, {len(scales)}) bytes, "
                                f"header says ({header.payload_bytes}, {header.scale_bytes})")
        index, payload_view, scales_view = self._staging.acquire(header)
        payload_view[:] = payload
        scales_view[:] = scales
        return self._staging.received(header, index, payload_view, scales_view)

    def close(self) -> None:
        """Remove this receiver's address from the transport."""
        self._on_close()
