"""zmq transport: PUSH (sender) -> PULL (receiver), one multipart message per KV message.

    frame 0  KVHeader msgpack      (copied; ~200 bytes)
    frame 1  payload bytes         (zero-copy send; recv_into a staging buffer)
    frame 2  scale bytes           (zero-copy send; recv_into the same staging buffer)

Many senders may push to one receiver (zmq fair-queues whole messages). ``send`` waits on
zmq's message trackers, so it returns only once zmq has let go of the caller's buffers.
With cluster keys (:mod:`pdserve.security`) the receiver is a CURVE server that admits only
the cluster's senders: a push from anyone else never reaches ``recv``. A message over the receiver's
``max_message_bytes`` is refused after its header (the rest is drained, the stream goes
on); a frame over twice that is refused by libzmq before it is buffered
(``ZMQ_MAXMSGSIZE``: the peer is disconnected), so no sender can make the receiver hold more
than that per connection. Works over ``tcp://`` (default ``tcp://127.0.0.1:*``, an ephemeral loopback port) and
``ipc://`` addresses. Needs pyzmq >= 26.4 (``Socket.recv_into``). zmq sockets are not
thread-safe: use each sender and receiver from one thread.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import zmq

from pdserve.kvtransfer.errors import KVFormatError, KVTransferTimeout
from pdserve.kvtransfer.transport import (
    KVReceiverConfig, ReceivedKV, StagingBuffers, check_send_buffers, send_within)
from pdserve.kvtransfer.wire import KVHeader, decode_header, encode_header
from pdserve.security import ClusterKeys, PeerGate, secure_client, secure_server

DEFAULT_ADDRESS = "tcp://127.0.0.1:*"
# Whole messages buffered per direction before send() blocks (backpressure).
MAX_QUEUED_MESSAGES = 4
LINGER_MS = 1000


class ZmqTransport:
    """zmq KV transport; with ``cluster_keys`` every socket runs CURVE (see module doc).

    Attributes:
        gate: the ZAP handler admitting senders (receiving side with keys), else None.
    """

    name = "zmq"
    supports_cluster_keys = True

    def __init__(self, io_threads: int = 1, cluster_keys: ClusterKeys | None = None) -> None:
        self._ctx = zmq.Context(io_threads)
        self._keys = cluster_keys
        self.gate: PeerGate | None = None

    def create_receiver(self, config: KVReceiverConfig) -> ZmqReceiver:
        """A PULL receiver bound at ``config.address`` (default: an ephemeral loopback
        port); with keys, the first one starts the ZAP gate."""
        if self._keys is not None and self.gate is None:
            self.gate = PeerGate(self._ctx, self._keys)
        return ZmqReceiver(self._ctx, config, self._keys, self.gate)

    def create_sender(self, address: str, *, timeout_s: float) -> ZmqSender:
        """A PUSH sender connected to ``address``; waits up to ``timeout_s`` for the
        connection, then raises KVTransferTimeout."""
        return ZmqSender(self._ctx, address, timeout_s, self._keys)

    @property
    def num_refused_peers(self) -> int:
        """Connections refused for want of the cluster's key (0 without keys)."""
        return 0 if self.gate is None else self.gate.num_refused

    def close(self) -> None:
        """Stop the gate and destroy the context (each socket lingers up to
        :data:`LINGER_MS` to flush)."""
        if self.gate is not None:
            self.gate.stop()
        self._ctx.destroy(linger=LINGER_MS)


class ZmqSender:
    """A PUSH socket connected to one receiver; sends payload and scales zero-copy."""
    def __init__(self, ctx: zmq.Context, address: str, timeout_s: float,
                 keys: ClusterKeys | None = None) -> None:
        self._sock = ctx.socket(zmq.PUSH)
        secure_client(self._sock, keys)
        # A multipart message counts one slot per frame against the high-water mark.
        self._sock.setsockopt(zmq.SNDHWM, 3 * MAX_QUEUED_MESSAGES)
        self._sock.setsockopt(zmq.LINGER, LINGER_MS)
        # Queue only on completed connections, so POLLOUT means "a receiver is there".
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        self._sock.connect(address)
        self._address = address
        # PUSH is writable only once a peer is connected: wait for that here, once.
        if not self._sock.poll(_ms(timeout_s), zmq.POLLOUT):
            self._sock.close(linger=0)
            raise KVTransferTimeout(f"no KV receiver reachable at {address} within "
                                    f"{timeout_s} s")

    def send_nowait(self, header: KVHeader, buffers: Sequence, *,
                    timeout_s: float) -> ZmqSendHandle:
        """Queue the three frames and return a handle tracking the two zero-copy ones.
        Raises KVTransferTimeout when the socket is not writable within ``timeout_s``
        (the receiver's queue is full or it went away), KVFormatError."""
        payload, scales = check_send_buffers(header, buffers)
        if not self._sock.poll(_ms(timeout_s), zmq.POLLOUT):
            raise KVTransferTimeout(f"zmq send of {header.request_id!r} to {self._address}: "
                                    f"not writable within {timeout_s} s")
        # Once frame 0 is accepted, zmq accepts the rest of the message without blocking.
        self._sock.send(encode_header(header), zmq.SNDMORE | zmq.DONTWAIT)
        trackers = [self._sock.send(payload, zmq.SNDMORE, copy=False, track=True),
                    self._sock.send(scales, 0, copy=False, track=True)]
        return ZmqSendHandle(trackers, f"zmq send of {header.request_id!r} to "
                                       f"{self._address}")

    def send(self, header: KVHeader, buffers: Sequence, *, timeout_s: float) -> None:
        """Send and wait until zmq has released both buffers, within ``timeout_s``."""
        send_within(self, header, buffers, timeout_s)

    def close(self) -> None:
        """Close the socket, flushing queued messages for up to :data:`LINGER_MS`."""
        self._sock.close()


class ZmqSendHandle:
    """Done once zmq has released both zero-copy frames (written to the socket)."""

    def __init__(self, trackers: list, what: str) -> None:
        self._trackers = trackers
        self._what = what

    def done(self) -> bool:
        """Whether both buffers may be reused."""
        return all(t.done for t in self._trackers)

    def wait(self, *, timeout_s: float) -> None:
        """Block until both buffers are released; KVTransferTimeout after ``timeout_s``
        (then close the sender: zmq may still read the buffers)."""
        deadline = time.monotonic() + timeout_s
        for tracker in self._trackers:
            try:
                tracker.wait(max(0.0, deadline - time.monotonic()))
            except zmq.NotDone:
                raise KVTransferTimeout(f"{self._what}: not sent within {timeout_s} s; "
                                        "close this sender") from None


class ZmqReceiver:
    """A bound PULL socket receiving each message's frames straight into a staging
    buffer."""
    def __init__(self, ctx: zmq.Context, config: KVReceiverConfig,
                 keys: ClusterKeys | None = None, gate: PeerGate | None = None) -> None:
        self._sock = ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, 3 * MAX_QUEUED_MESSAGES)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, 2 * config.max_message_bytes + 65536)
        secure_server(self._sock, keys)
        self._sock.bind(config.address or DEFAULT_ADDRESS)
        if gate is not None:
            gate.watch(self._sock)
        self._address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._staging = StagingBuffers(config.num_buffers, config.max_message_bytes)

    @property
    def address(self) -> str:
        """The bound endpoint, with the port resolved (e.g. ``tcp://127.0.0.1:40123``)."""
        return self._address

    def recv(self, *, timeout_s: float) -> ReceivedKV:
        """The next message from any sender. A malformed or oversized message is drained
        and raises KVFormatError; RuntimeError if every staging buffer is held;
        KVTransferTimeout if nothing arrives within ``timeout_s``."""
        self._staging.check_free()
        if not self._sock.poll(_ms(timeout_s), zmq.POLLIN):
            raise KVTransferTimeout(f"no KV message at {self._address} within {timeout_s} s")
        # The whole multipart message has arrived once its first frame is readable.
        header_bytes = self._sock.recv()
        try:
            if not self._sock.get(zmq.RCVMORE):
                raise KVFormatError("KV message has a header frame only")
            header = decode_header(header_bytes)
            index, payload, scales = self._staging.acquire(header)
        except (KVFormatError, RuntimeError):
            self._drain()
            raise
        try:
            self._recv_frame_into(payload, "payload", more=True)
            self._recv_frame_into(scales, "scales", more=False)
        except KVFormatError:
            self._staging.release(index)
            self._drain()
            raise
        return self._staging.received(header, index, payload, scales)

    def close(self) -> None:
        """Close the socket at once, dropping messages not yet received."""
        self._sock.close()

    def _recv_frame_into(self, view: memoryview, what: str, *, more: bool) -> None:
        num_bytes = self._sock.recv_into(view)
        if num_bytes != view.nbytes:
            raise KVFormatError(f"{what} frame of {num_bytes} bytes, header says "
                                f"{view.nbytes}")
        if bool(self._sock.get(zmq.RCVMORE)) != more:
            raise KVFormatError(f"KV message has {'too few' if more else 'too many'} frames")

    def _drain(self) -> None:
        """Discard the rest of a rejected multipart message."""
        while self._sock.get(zmq.RCVMORE):
            self._sock.recv_into(bytearray())


def _ms(timeout_s: float) -> int:
    return max(0, int(timeout_s * 1000))
