"""UCX transport through ucxx (PyPI ``ucxx-cu12``; imports and runs without a GPU).

Connection set-up, once per (sender, receiver) pair::

    sender --zmq REQ "hello"--> receiver's bootstrap REP socket (receiver.address)
           <-- [receiver's UCX worker address, sender_id] --
    sender: create_endpoint_from_worker_address(...)   (endpoint error handling off)

Endpoints made from a worker address reach the peer over shared memory on one host (8-10
GB/s; the listener path ended on TCP, ~1.5 GB/s), offered only with endpoint error handling
off; cma (process_vm_readv) moves the large parts in one copy into the staging buffer.

Each message is three tagged sends; the receiver matches headers from every sender on one
tag, then posts the payload receives straight into a free staging buffer, in the
background (receive-ahead), so the next message lands while the caller still verifies or
scatters the previous one::

    tag HEADER_TAG               [payload_tag u64 | header_len u32 | KVHeader msgpack]
    tag payload_tag              payload bytes    payload_tag = sender_id << 32 | 2*seq
    tag payload_tag + 1          scale bytes      (not sent when scale_bytes == 0)

NOTE (threads). ucxx is asyncio-based: each transport runs one event loop on its own thread
and the synchronous ``send``/``recv`` hand coroutines to it. UCX progress runs in "thread"
mode with Python futures (a C++ progress thread sleeps in epoll, a notifier thread completes
the futures): 47 MB messages at 4.4-6.2 GB/s vs 1.7-2.1 for "blocking" mode, ~0 % CPU idle
where "blocking" yields in a loop and burned ~70 % of a core (blocking wins only in latency:
~0.2 vs ~1 ms per 8 KiB message). The notifier thread is a daemon: a process that forgets
close() still exits.

NOTE (trust). UCX admits any peer: a header is authenticated before its payload is awaited,
and no frame ends the receive or bootstrap task. Parts are awaited beside the header loop,
at most ``parts_timeout_s``: a sender killed between header and payload held it for good."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
from collections.abc import Mapping, Sequence
from types import MappingProxyType

import zmq
import zmq.asyncio

from pdserve.kvtransfer.errors import KVTransferError, KVTransferTimeout
from pdserve.kvtransfer.ucx_bootstrap import bootstrap as _bootstrap
from pdserve.kvtransfer.ucx_receiver import _FRAME_PREFIX, HEADER_TAG, UcxReceiver
from pdserve.kvtransfer.transport import (
    KVReceiverConfig, check_send_buffers, send_within)
from pdserve.kvtransfer.wire import KVHeader, encode_header

DEFAULT_UCX_OPTIONS = MappingProxyType({"WARN_UNUSED_ENV_VARS": "n"})  # quiet on ucxx own vars


def ucx_unavailable_reason() -> str | None:
    """None if ucxx imports here, else why not (for skips and error messages)."""
    try:
        import ucxx  # noqa: F401
        from ucxx._lib_async import ApplicationContext  # noqa: F401
    except Exception as e:  # ImportError, or a missing libucx .so (OSError)
        return f"ucxx unavailable: {type(e).__name__}: {e}"
    return None


class UcxTransport:
    """Owns a UCX context, its worker and the loop thread; call close() when done."""

    name = "ucx"

    def __init__(self, progress_mode: str = "thread",
                 ucx_options: Mapping[str, str] | None = None,
                 enable_python_future: bool = True) -> None:
        reason = ucx_unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"{reason}; install the pinned ucxx-cu12 (scripts/setup.sh)")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever,
                                        name="kv-ucx-loop", daemon=True)
        self._thread.start()
        options = dict(DEFAULT_UCX_OPTIONS if ucx_options is None else ucx_options)
        self.ctx = self.run(self._create_context(options, progress_mode,
                                                 enable_python_future), timeout_s=30.0,
                            what="UCX context creation")
        self.zmq_ctx = zmq.Context()  # sender bootstrap, on the caller's thread
        self.async_zmq_ctx = zmq.asyncio.Context()  # receiver bootstrap, on the loop thread
        self._is_closed = False

    @staticmethod
    async def _create_context(options: dict[str, str], progress_mode: str,
                              enable_python_future: bool):
        from ucxx._lib_async import ApplicationContext

        # Created on the loop thread so that UCX progress binds to this loop.
        return ApplicationContext(options, progress_mode=progress_mode,
                                  enable_python_future=enable_python_future)

    def submit(self, coro) -> concurrent.futures.Future:
        """Schedule a coroutine on the transport's loop thread."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def call_soon(self, callback) -> None:
        """Run a plain callback on the loop thread (no-op once the transport is closed)."""
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(callback)

    def run(self, coro, *, timeout_s: float, what: str):
        """Run a coroutine on the loop thread and wait; KVTransferTimeout after timeout_s."""
        future = self.submit(coro)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise KVTransferTimeout(f"{what}: not done within {timeout_s} s") from None

    async def _shutdown(self) -> None:
        """Stop UCX progress from the loop thread itself: its file-descriptor readers must
        not be removed from another thread while the loop runs."""
        current = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.ctx.clear_progress_tasks()

    def create_receiver(self, config: KVReceiverConfig) -> UcxReceiver:
        """A receiver bootstrapping senders at ``config.address``, receiving ahead."""
        return UcxReceiver(self, config)

    def create_sender(self, address: str, *, timeout_s: float) -> UcxSender:
        """A sender with an endpoint to the receiver at ``address``, within ``timeout_s``."""
        return UcxSender(self, address, timeout_s)

    def close(self) -> None:
        """Stop UCX progress, the zmq contexts and the loop thread (idempotent)."""
        if self._is_closed:
            return
        self._is_closed = True
        try:
            self.run(self._shutdown(), timeout_s=10.0, what="UCX progress shutdown")
        except KVTransferTimeout:
            pass
        self.ctx.stop_notifier_thread()
        self.zmq_ctx.destroy(linger=0)
        self.async_zmq_ctx.destroy(linger=0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5.0)
        if not self._thread.is_alive():
            self._loop.close()


class UcxSender:
    """One UCX endpoint to one receiver; each message is three tagged sends (module doc)."""

    def __init__(self, transport: UcxTransport, address: str, timeout_s: float) -> None:
        self._transport = transport
        self._address = address
        worker_address, self._sender_id = _bootstrap(transport.zmq_ctx, address, timeout_s)
        self._ep = transport.run(self._connect(worker_address), timeout_s=timeout_s,
                                 what=f"UCX endpoint to {address}")
        self._seq = itertools.count()
        self._is_broken = False

    async def _connect(self, worker_address: bytes):
        from ucxx._lib.libucxx import UCXAddress

        address = UCXAddress.create_from_buffer(worker_address)
        return await self._transport.ctx.create_endpoint_from_worker_address(
            address, endpoint_error_handling=False)

    @property
    def endpoint(self):
        """The ucxx Endpoint (for diagnostics and the raw baseline in bench/kv_transfer.py)."""
        return self._ep

    def send_nowait(self, header: KVHeader, buffers: Sequence, *,
                    timeout_s: float) -> UcxSendHandle:
        """Start the sends on the loop thread; KVTransferError once an earlier one failed."""
        if self._is_broken:
            raise KVTransferError(f"UCX sender to {self._address} failed or timed out "
                                  "earlier; close it")
        payload, scales = check_send_buffers(header, buffers)
        payload_tag = (self._sender_id << 32) | ((2 * next(self._seq)) & 0xFFFF_FFFF)
        header_bytes = encode_header(header)
        frame = _FRAME_PREFIX.pack(payload_tag, len(header_bytes)) + header_bytes
        future = self._transport.submit(self._send(frame, payload, scales, payload_tag))
        return UcxSendHandle(future, self, f"UCX send of {header.request_id!r} to "
                                           f"{self._address}")

    def send(self, header: KVHeader, buffers: Sequence, *, timeout_s: float) -> None:
        """Send and wait until UCX is done with both buffers, within ``timeout_s``."""
        send_within(self, header, buffers, timeout_s)

    async def _send(self, frame: bytes, payload: memoryview, scales: memoryview,
                    payload_tag: int) -> None:
        sends = [self._ep.send(frame, tag=HEADER_TAG, force_tag=True),
                 self._ep.send(payload, tag=payload_tag, force_tag=True)]
        if scales.nbytes:
            sends.append(self._ep.send(scales, tag=payload_tag + 1, force_tag=True))
        await asyncio.gather(*sends)

    def mark_broken(self) -> None:
        """A send timed out: UCX may still read its buffers, so refuse further sends."""
        self._is_broken = True

    def close(self) -> None:
        """Abort the endpoint on the loop thread (idempotent)."""
        ep, self._ep = self._ep, None
        if ep is not None:
            self._transport.call_soon(ep.abort)


class UcxSendHandle:
    """An in-flight UCX send; a failure or timeout marks its sender broken."""
    def __init__(self, future: concurrent.futures.Future, sender: UcxSender,
                 what: str) -> None:
        self._future = future
        self._sender = sender
        self._what = what

    def done(self) -> bool:
        """Whether the sends finished (successfully or not)."""
        return self._future.done()

    def wait(self, *, timeout_s: float) -> None:
        """Block until the buffers may be reused; on KVTransferTimeout or KVTransferError
        (UCX failed) the sender refuses further sends."""
        try:
            self._future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            self._sender.mark_broken()
            raise KVTransferTimeout(f"{self._what}: not sent within {timeout_s} s; close "
                                    "this sender") from None
        except Exception as e:  # ucxx errors (endpoint closed, peer gone, ...)
            self._sender.mark_broken()
            raise KVTransferError(f"{self._what} failed: {type(e).__name__}: {e}") from e
