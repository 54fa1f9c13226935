"""The transport interface (``KVTransport``, ``KVSender``, ``KVReceiver``) and its registry.

A transport instance owns its process-wide resources (a zmq context, a UCX worker and its
progress thread); it makes receivers, which listen at an address, and senders, which
connect to one address once and then carry any number of messages::

    transport = create_transport("zmq")                   # once per process
    receiver = transport.create_receiver(KVReceiverConfig(max_message_bytes=...))
    sender = other_transport.create_sender(receiver.address, timeout_s=5.0)
    sender.send(encoded.header, encoded.buffers, timeout_s=5.0)   # or send_nowait(...)
    with receiver.recv(timeout_s=5.0) as msg:             # lands in a preallocated buffer
        scatter_blocks(kv_cache, my_block_ids, msg.decode())

NOTE (buffer ownership). ``send`` returns once the caller may reuse its buffers. ``recv``
returns a :class:`ReceivedKV` whose bytes live in one of the receiver's ``num_buffers``
staging buffers until ``release()``; holding all of them and calling ``recv`` again raises
``RuntimeError``. After a ``KVTransferTimeout`` from ``send`` the transport may still read
the caller's buffers, so the sender must be closed and the buffers not reused.
"""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

import numpy as np

from pdserve.kvtransfer.errors import KVFormatError
from pdserve.kvtransfer.wire import DecodedKV, KVHeader, decode_kv

# Where the scales start inside a staging buffer: the payload size rounded up to this.
_SCALES_ALIGN_BYTES = 64


@dataclass(frozen=True)
class KVReceiverConfig:
    """How a receiver listens and how much it preallocates."""

    max_message_bytes: int  # payload + scale bytes of the largest message accepted
    num_buffers: int = 2  # staging buffers (messages held at once before release())
    address: str | None = None  # where to listen; None: the transport's loopback default
    #: ``authenticate(header) -> bool``: where the transport itself admits anyone (UCX), a
    #: header it refuses is dropped before any payload is awaited. None: every header.
    authenticate: Callable[[KVHeader], bool] | None = None
    #: seconds a message's parts may take after its header (UCX, where they travel apart:
    #: a sender that died between the two must not hold a staging buffer for good)
    parts_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.parts_timeout_s > 0:
            raise ValueError(f"parts_timeout_s: must be > 0, got {self.parts_timeout_s}")
        if self.max_message_bytes < 1:
            raise ValueError(f"max_message_bytes: must be >= 1, got {self.max_message_bytes}")
        if self.num_buffers < 1:
            raise ValueError(f"num_buffers: must be >= 1, got {self.num_buffers}")


class ReceivedKV:
    """One received message; its bytes alias a staging buffer until :meth:`release`."""

    def __init__(self, header: KVHeader, payload: memoryview, scales: memoryview,
                 on_release) -> None:
        self.header = header
        self.payload = payload  # header.payload_bytes bytes
        self.scales = scales  # header.scale_bytes bytes
        self._on_release = on_release

    def decode(self) -> DecodedKV:
        """Verify the checksum and view as tensors (valid until release())."""
        return decode_kv(self.header, self.payload, self.scales)

    def release(self) -> None:
        """Give the staging buffer back for reuse (idempotent)."""
        on_release, self._on_release = self._on_release, None
        if on_release is not None:
            on_release()

    def __enter__(self) -> ReceivedKV:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class KVSendHandle(Protocol):
    """An in-flight send; the caller must keep its buffers untouched until done."""

    def done(self) -> bool:
        """Whether the buffers may be reused (never blocks)."""
        ...

    def wait(self, *, timeout_s: float) -> None:
        """Block until the buffers may be reused; raises KVTransferTimeout."""
        ...


class KVSender(Protocol):
    """One connection to one receiver, set up once and reused for every message."""

    def send_nowait(self, header: KVHeader, buffers: Sequence, *,
                    timeout_s: float) -> KVSendHandle:
        """Start sending header + (payload, scales) and return at once, so that several
        messages (e.g. one per layer) can be in flight. ``timeout_s`` bounds only the wait
        for room in the send queue. Raises KVTransferTimeout, KVFormatError (sizes
        disagree with the header)."""
        ...

    def send(self, header: KVHeader, buffers: Sequence, *, timeout_s: float) -> None:
        """``send_nowait(...).wait(...)`` within one deadline of ``timeout_s``."""
        ...

    def close(self) -> None:
        """Drop the connection (what the caller must do after a send timed out)."""
        ...


class CompletedSend:
    """The handle of a send that finished before send_nowait returned."""

    def done(self) -> bool:
        """Always True: nothing is in flight."""
        return True

    def wait(self, *, timeout_s: float) -> None:
        """Returns at once."""
        pass


def send_within(sender: KVSender, header: KVHeader, buffers: Sequence,
                timeout_s: float) -> None:
    """The shared body of ``send``: send_nowait, then wait, under one deadline."""
    deadline = time.monotonic() + timeout_s
    handle = sender.send_nowait(header, buffers, timeout_s=timeout_s)
    handle.wait(timeout_s=max(0.0, deadline - time.monotonic()))


class KVReceiver(Protocol):
    """Listens at one address and receives from any number of senders into its staging
    buffers (see the module's NOTE on buffer ownership)."""

    @property
    def address(self) -> str:
        """What a sender passes to ``create_sender`` (resolved, e.g. the bound port)."""
        ...

    def recv(self, *, timeout_s: float) -> ReceivedKV:
        """The next message from any sender. Raises KVTransferTimeout, KVFormatError."""
        ...

    def close(self) -> None:
        """Stop listening; messages not yet received are lost."""
        ...


class KVTransport(Protocol):
    """A transport's process-wide resources; makes receivers and senders (module doc).
    Implementations are looked up by ``name`` in :data:`TRANSPORTS`."""

    name: str

    def create_receiver(self, config: KVReceiverConfig) -> KVReceiver:
        """A receiver listening at ``config.address`` (None: the transport's default)."""
        ...

    def create_sender(self, address: str, *, timeout_s: float) -> KVSender:
        """A sender connected to the receiver at ``address``; raises KVTransferTimeout
        when it cannot connect within ``timeout_s``."""
        ...

    def close(self) -> None:
        """Release the transport's resources; its senders and receivers stop working."""
        ...


#: Largest KV message a decode worker receives (bytes); senders split a request's layers
#: into messages under it.
MAX_KV_MESSAGE_BYTES = 64 * 1024 * 1024

# name -> "module:Class"; imported on first use so that e.g. ucxx loads only for "ucx".
TRANSPORTS: Mapping[str, str] = MappingProxyType({
    "inproc": "pdserve.kvtransfer.inproc:InprocTransport",
    "zmq": "pdserve.kvtransfer.zmq_transport:ZmqTransport",
    "ucx": "pdserve.kvtransfer.ucx_transport:UcxTransport",
})


def create_transport(name: str, cluster_keys=None, **options) -> KVTransport:
    """A new transport by registry name; ``options`` go to its constructor.

    ``cluster_keys`` (:class:`pdserve.security.ClusterKeys`) goes to transports that
    authenticate their sockets with it (``supports_cluster_keys``: zmq, under CURVE); the
    others ignore it.
    """
    if name not in TRANSPORTS:
        raise ValueError(f"transport: expected one of {sorted(TRANSPORTS)}, got {name!r}")
    module_name, class_name = TRANSPORTS[name].split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    if cluster_keys is not None and getattr(cls, "supports_cluster_keys", False):
        options["cluster_keys"] = cluster_keys
    return cls(**options)


def check_send_buffers(header: KVHeader, buffers: Sequence) -> tuple[memoryview, memoryview]:
    """Byte views of (payload, scales), checked against the header; raises KVFormatError."""
    if len(buffers) != 2:
        raise KVFormatError(f"buffers: expected (payload, scales), got {len(buffers)} buffers")
    payload, scales = (memoryview(b).cast("B") for b in buffers)
    if payload.nbytes != header.payload_bytes or scales.nbytes != header.scale_bytes:
        raise KVFormatError(f"buffers: header says ({header.payload_bytes}, "
                            f"{header.scale_bytes}) bytes, got ({payload.nbytes}, "
                            f"{scales.nbytes})")
    return payload, scales


class StagingBuffers:
    """``num_buffers`` preallocated receive buffers, each with room for one message::

        [ payload (payload_bytes) | pad to 64 | scales (scale_bytes) | unused ]
    """

    def __init__(self, num_buffers: int, max_message_bytes: int) -> None:
        self.max_message_bytes = max_message_bytes
        capacity = max_message_bytes + _SCALES_ALIGN_BYTES
        self._buffers = [np.empty(capacity, dtype=np.uint8) for _ in range(num_buffers)]
        for buf in self._buffers:
            buf.fill(0)  # touch every page now, not during the first transfer
        self._free = list(range(num_buffers))
        self._lock = threading.Lock()

    def check_free(self) -> None:
        """Raise RuntimeError if no buffer is free (call before taking a message off the
        wire, so that a refused recv() loses nothing)."""
        with self._lock:
            if not self._free:
                raise RuntimeError(f"all {len(self._buffers)} receive buffers are held; "
                                   "release() a ReceivedKV before receiving more")

    def acquire(self, header: KVHeader) -> tuple[int, memoryview, memoryview]:
        """A free buffer's (index, payload view, scales view) sized for ``header``."""
        if header.num_message_bytes > self.max_message_bytes:
            raise KVFormatError(f"message of {header.num_message_bytes} bytes (request "
                                f"{header.request_id!r}) exceeds max_message_bytes="
                                f"{self.max_message_bytes}")
        with self._lock:
            if not self._free:
                raise RuntimeError(f"all {len(self._buffers)} receive buffers are held; "
                                   "release() a ReceivedKV before receiving more")
            index = self._free.pop()
        buf = memoryview(self._buffers[index])
        scales_start = -(-header.payload_bytes // _SCALES_ALIGN_BYTES) * _SCALES_ALIGN_BYTES
        return (index, buf[: header.payload_bytes],
                buf[scales_start: scales_start + header.scale_bytes])

    def replace(self, index: int) -> np.ndarray:
        """Put a new buffer at held ``index`` and return the old one, which a receive that
        never finished may still write into: the caller keeps it alive."""
        old = self._buffers[index]
        self._buffers[index] = np.empty_like(old)
        self._buffers[index].fill(0)
        return old

    def release(self, index: int) -> None:
        """Give buffer ``index`` back to the free list (once per acquire)."""
        with self._lock:
            assert index not in self._free, "staging buffer released twice"
            self._free.append(index)

    def received(self, header: KVHeader, index: int, payload: memoryview,
                 scales: memoryview) -> ReceivedKV:
        """Wrap a filled buffer; releasing the result frees ``index``."""
        return ReceivedKV(header, payload, scales, lambda: self.release(index))
