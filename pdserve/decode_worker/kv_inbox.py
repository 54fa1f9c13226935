"""Receiving side of pushed KV: a thread that takes messages off the transport, verifies
them, dequantizes into the cache dtype and assembles each request's layers, and the
transfer's hidden section (the prompt's hidden states for an EAGLE head) when its KV
messages announce one: a request is ready once both are here.

The engine's cache is written by the worker's main thread at install
(:meth:`LLMEngine.complete_remote_prefill`), or, through the ``writer`` the decode worker
gives (FP8 wire into a CPU cache), by this thread layer by layer as messages arrive, under
the worker's lock that its engine thread takes before it frees a request's blocks: an abort
racing a transfer never lets a write land in blocks handed to another request.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from functools import partial

import torch

from pdserve.cpu_affinity import background_priority
from pdserve.fp8 import dequantize_blocks
from pdserve.kvtransfer.addressing import replace_tcp_host
from pdserve.kvtransfer.errors import KVChecksumError, KVFormatError, KVTransferTimeout
from pdserve.kvtransfer.hidden import DecodedHidden, decode_hidden
from pdserve.kvtransfer.transport import MAX_KV_MESSAGE_BYTES, KVReceiverConfig, create_transport
from pdserve.kvtransfer.wire import SECTION_HIDDEN
from pdserve.kvtransfer.wire_auth import header_is_authentic

logger = logging.getLogger(__name__)


def _is_authentic_for(keys, dest: list[str], header) -> bool:
    """Whether ``header`` carries the cluster's HMAC for the receiver at ``dest[0]`` (False
    until that address is known)."""
    return bool(dest) and header_is_authentic(header, keys, dest[0])

#: Largest single KV message accepted (senders split a request's layers to stay below it).
#: How long the receive call waits before checking whether to stop.
RECV_POLL_S = 0.1


class KVInbox:
    """Receives KV messages on its own thread; results come out of :attr:`ready`.

    Args:
        transport_name: a registered transport ("zmq", "ucx", "inproc").
        num_layers: layers of the model (a request is complete when all have arrived).
        cache_dtype: dtype the KV is dequantized to.
        stale_after_s: partial requests not touched this long are dropped.
        keep_fp8: FP8 messages are kept as codes and scales, not dequantized here: the
            engine writes them into an FP8 cache as they are, or into a CPU cache of
            another dtype dequantizing in the same pass as the scatter (one pass over
            the KV instead of two).
        address: where to listen; None: the transport's loopback default.
        advertise_host: host written into :attr:`address` in place of the bound one (for a
            receiver bound on ``0.0.0.0``); None: the bound address as it is.
        expects: ``expects(request_id)`` -> the number of prompt tokens whose KV this worker
            reserved blocks for, or None when it reserved nothing for that id. A message
            for an unreserved id, or larger than the reservation, is dropped before it is
            decoded or stored (counted in :attr:`num_dropped`). None: accept every id.
        writer: ``writer(request_id, decoded) -> bool``, called on this thread with each
            verified KV message: True when it wrote the layers into the request's blocks
            itself (then only their count is kept and ``ready`` yields ``kv`` None), False
            to have them assembled here. None: always assembled here.
        cluster_keys: the deployment's keys: zmq admits only the cluster's senders, and
            on every transport a message whose header does not carry the cluster's HMAC
            for this receiver (:func:`~pdserve.kvtransfer.wire_auth.sign_header`) is dropped
            unread, before any block is written.
        block_shape: ``(block_size, num_kv_heads, head_dim)`` of this worker's cache: a KV
            message of another shape is dropped unread (its request's tensor is never
            allocated at the sender's word). None: not checked.

    ``ready`` yields ``(request_id, (kv, scales, hidden, hidden_start))`` with ``kv`` a
    ``[num_layers, 2, num_blocks, block_size, H, D]`` tensor in ``cache_dtype`` and
    ``scales`` None, or (``keep_fp8``) float8_e4m3fn codes with ``[num_layers, 2,
    num_blocks, H]`` fp32 ``scales``; ``hidden`` the hidden section's ``[num_tokens -
    hidden_start, hidden_size]`` rows in their wire dtype, or None (the transfer had none);
    or ``(request_id, reason)`` with ``reason`` "checksum" or "format" when a message was
    bad (a hidden section that does not match its KV's announcement included).
    """

    def __init__(self, transport_name: str, num_layers: int, cache_dtype: torch.dtype,
                 stale_after_s: float = 30.0, address: str | None = None,
                 advertise_host: str | None = None, keep_fp8: bool = False,
                 cluster_keys=None, expects=None, writer=None,
                 block_shape: tuple[int, int, int] | None = None) -> None:
        self.transport = create_transport(transport_name, cluster_keys)
        self.cluster_keys = cluster_keys
        # the receiver checks headers against the address it advertises (known once it is
        # bound); no reference back to this inbox: a cycle would leave the UCX objects to
        # the cyclic GC, which tore them down at random points (and crashed)
        dest: list[str] = []
        self.receiver = self.transport.create_receiver(KVReceiverConfig(
            address=address, max_message_bytes=MAX_KV_MESSAGE_BYTES, num_buffers=2,
            authenticate=None if cluster_keys is None else partial(
                _is_authentic_for, cluster_keys, dest)))
        self.address = self.receiver.address
        if advertise_host is not None:
            self.address = replace_tcp_host(self.address, advertise_host)
        dest.append(self.address)
        self.num_layers = num_layers
        self.cache_dtype = cache_dtype
        self.stale_after_s = stale_after_s
        self.keep_fp8 = keep_fp8
        self.ready: queue.Queue[tuple[str, tuple | str]] = queue.Queue()
        self.num_bytes_received = 0
        self.expects = expects
        self.writer = writer
        self.block_shape = block_shape
        #: messages dropped unread: no reservation for their request, or too large for it
        self.num_dropped = 0
        # request id -> (kv, scales or None, bit mask of the layers received, last touched)
        self._partial: dict[str, tuple[torch.Tensor, torch.Tensor | None, int, float]] = {}
        # request id -> (kv, scales, announced hidden_size, num_tokens, last touched): every
        # layer here, its hidden section not yet; request id -> (hidden section, touched)
        self._kv_done: dict[str, tuple[torch.Tensor, torch.Tensor | None, int, int, float]] = {}
        self._hidden: dict[str, tuple[DecodedHidden, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-inbox", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        background_priority()
        while not self._stop.is_set():
            try:
                msg = self.receiver.recv(timeout_s=RECV_POLL_S)
            except KVTransferTimeout:
                self._drop_stale()
                continue
            except KVFormatError as exc:  # malformed or oversized: drained by the receiver
                self._count_drop(f"malformed KV message: {exc}")
                continue
            except Exception:
                if self._stop.is_set():
                    return
                logger.exception("KV receive failed")
                continue
            with msg:
                rid = msg.header.request_id
                if not self._is_reserved(msg.header):
                    continue
                try:
                    if msg.header.section == SECTION_HIDDEN:
                        self._add_hidden(rid, decode_hidden(msg.header, msg.payload,
                                                            msg.scales))
                    else:
                        self._add(rid, msg.decode())
                except KVChecksumError:
                    logger.warning("KV for %s failed its checksum", rid)
                    self._forget(rid)
                    self.ready.put((rid, "checksum"))
                except (KVFormatError, ValueError) as exc:
                    logger.warning("bad KV message for %s: %s", rid, exc)
                    self._forget(rid)
                    self.ready.put((rid, "format"))
                except Exception:  # the receive loop must outlive any one message
                    logger.exception("failed to store KV for %s", rid)
                    self._forget(rid)
                    self.ready.put((rid, "format"))

    def _is_reserved(self, header) -> bool:
        """Whether ``header``'s request has blocks reserved here that its KV fits in."""
        why = None
        if self.cluster_keys is not None and not header_is_authentic(
                header, self.cluster_keys, self.address):
            why = "its cluster token is missing or wrong"
        elif self.expects is not None:
            num_tokens = self.expects(header.request_id)
            if num_tokens is None:
                why = "no blocks reserved for it"
            elif header.num_tokens > num_tokens or (header.block_size and  # hidden: none
                                                     header.num_blocks
                                                     > -(-num_tokens // header.block_size)):
                why = f"larger than its {num_tokens}-token reservation"
        shape = (header.block_size, header.num_kv_heads, header.head_dim)
        if why is None and self.block_shape is not None and header.section != SECTION_HIDDEN \
                and shape != self.block_shape:
            why = f"its blocks {shape} are not this cache's {self.block_shape}"
        if why is None:
            return True
        self._count_drop(f"KV message for {header.request_id[:64]!r} "
                         f"({header.num_tokens} tokens): {why}")
        return False

    def _count_drop(self, what: str) -> None:
        """Count a message dropped unread; log the first ten, then every thousandth."""
        self.num_dropped += 1
        if self.num_dropped <= 10 or self.num_dropped % 1000 == 0:
            logger.warning("dropped a %s (%d dropped so far)", what, self.num_dropped)

    def _add(self, rid: str, decoded) -> None:
        h = decoded.header
        self.num_bytes_received += h.payload_bytes + h.scale_bytes
        entry = self._partial.get(rid)
        written = self.writer is not None and self.writer(rid, decoded)
        if entry is None and written:
            entry = (None, None, 0, time.monotonic())
        if written != (entry is not None and entry[0] is None):
            raise KVFormatError("a request's KV messages were partly written in place")
        if written:
            self._count_layers(rid, entry, h)
            return
        as_codes = self.keep_fp8 and decoded.is_fp8
        if entry is None:
            shape = (self.num_layers, 2, h.num_blocks, h.block_size, h.num_kv_heads, h.head_dim)
            if as_codes:
                entry = (torch.empty(shape, dtype=decoded.values.dtype),
                         torch.empty(shape[:3] + shape[4:5], dtype=decoded.scales.dtype), 0,
                         time.monotonic())
            else:
                entry = (torch.empty(shape, dtype=self.cache_dtype), None, 0, time.monotonic())
        full, full_scales, num_done, _ = entry
        if full.shape[2:] != decoded.values.shape[2:] or h.layer_end > self.num_layers:
            raise KVFormatError(f"message shape {tuple(decoded.values.shape)} does not match "
                                f"the request's {tuple(full.shape)}")
        if as_codes != (full_scales is not None):
            raise KVFormatError("a request's KV messages mix FP8 and native dtypes")
        if as_codes:
            full[h.layer_start:h.layer_end] = decoded.values
            full_scales[h.layer_start:h.layer_end] = decoded.scales
        elif decoded.is_fp8:  # straight from the staging buffer into the request's tensor
            dequantize_blocks(decoded.values, decoded.scales, self.cache_dtype,
                              out=full[h.layer_start:h.layer_end])
        else:
            full[h.layer_start:h.layer_end].copy_(decoded.values)
        self._count_layers(rid, entry, h)

    def _count_layers(self, rid: str, entry: tuple, h) -> None:
        """Count ``h``'s layers into ``entry`` (kv, scales, layers done, touched); hand the
        request on once all are here (``kv`` None: written in place by :attr:`writer`)."""
        full, full_scales, done, _ = entry
        layers = (1 << h.layer_end) - (1 << h.layer_start)
        if done & layers:  # a repeat would stand in for a layer that never came
            raise KVFormatError(f"layers {h.layer_start}..{h.layer_end - 1} arrived twice")
        done |= layers
        if done == (1 << self.num_layers) - 1:
            self._partial.pop(rid, None)
            self._kv_done[rid] = (full, full_scales, h.hidden_size, h.num_tokens,
                                  time.monotonic())
            self._put_ready(rid)
        else:
            self._partial[rid] = (full, full_scales, done, time.monotonic())

    def num_layers_received(self, request_id: str) -> int:
        """Layers of ``request_id`` received and held while its others are awaited."""
        entry = self._partial.get(request_id)
        return 0 if entry is None else bin(entry[2]).count("1")

    def discard(self, request_id: str) -> None:
        """Drop the layers (and hidden section) received so far for ``request_id`` (any
        thread; its later messages are dropped by ``expects``)."""
        self._forget(request_id)

    def _add_hidden(self, rid: str, decoded: DecodedHidden) -> None:
        """Keep a hidden section (a copy: the receive buffer is reused) until its KV is here."""
        if rid in self._hidden:
            raise KVFormatError("a second hidden section for the request")
        self.num_bytes_received += decoded.header.payload_bytes
        copy = DecodedHidden(decoded.header, decoded.features.clone())
        self._hidden[rid] = (copy, time.monotonic())
        self._put_ready(rid)

    def _put_ready(self, rid: str) -> None:
        """Hand a request on once every layer and the hidden section they announced (if
        any) are here. Raises KVFormatError: the section does not match the announcement."""
        done = self._kv_done.get(rid)
        if done is None:
            return
        kv, scales, hidden_size, num_tokens, _ = done
        if hidden_size == 0:
            del self._kv_done[rid]
            self.ready.put((rid, (kv, scales, None, 0)))
            return
        if rid not in self._hidden:
            return
        del self._kv_done[rid]
        hidden = self._hidden.pop(rid)[0]
        h = hidden.header
        if (h.hidden_size, h.num_tokens) != (hidden_size, num_tokens):
            raise KVFormatError(f"hidden section of {h.num_tokens} tokens x {h.hidden_size} "
                                f"for KV of {num_tokens} tokens announcing {hidden_size}")
        self.ready.put((rid, (kv, scales, hidden.features, hidden.hidden_start)))

    def _forget(self, rid: str) -> None:
        """Drop whatever arrived for ``rid`` (a bad message ended its transfer)."""
        self._partial.pop(rid, None)
        self._kv_done.pop(rid, None)
        self._hidden.pop(rid, None)

    def _drop_stale(self) -> None:
        now = time.monotonic()
        for parts in (self._partial, self._kv_done, self._hidden):
            for rid, entry in list(parts.items()):
                if now - entry[-1] > self.stale_after_s:
                    del parts[rid]

    def close(self) -> None:
        """Stop the receiving thread (waiting up to 2 s for it), then close the receiver
        and the transport."""
        self._stop.set()
        self._thread.join(timeout=2.0)
        self.receiver.close()
        self.transport.close()
