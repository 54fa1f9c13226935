"""Sending side of pushed KV: a thread that encodes (FP8 or native) and pushes prefills'
blocks to their decode workers, over connections set up once per destination.

A job is a request's whole KV, or one layer range of it while the prefill's forward is still
computing the later layers (:attr:`LLMEngine.kv_layer_sink`): a request is reported once, when
its last layer has gone (or at its first failure; its later layers are then dropped)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch

from pdserve.core_turns import CoreTurns
from pdserve.cpu_affinity import background_priority
from pdserve.kvtransfer.hidden import encode_hidden
from pdserve.kvtransfer.transport import MAX_KV_MESSAGE_BYTES, KVSender, create_transport
from pdserve.kvtransfer.wire import encode_kv
from pdserve.kvtransfer.wire_auth import sign_header

logger = logging.getLogger(__name__)


@dataclass
class KVJob:
    """One request's KV to push.

    Attributes:
        kv: ``[L, 2, num_blocks, block_size, H, D]`` copy of layers ``[layer_start,
            layer_start + L)`` of the prompt's blocks.
        layer_start: the first layer in ``kv``.
        num_layers: the model's layer count (the request is done once its last layer went);
            None: ``kv`` holds them all.
        scales: with float8_e4m3fn ``kv`` (an FP8 cache's blocks), their ``[L, 2,
            num_blocks, H]`` fp32 scales: sent as they are, whatever the transfer dtype.
        hidden_size: width of the hidden section that follows the request's layers (its
            KV messages announce it); 0: none follows.
        hidden: the hidden-section job (``kv`` None): the prompt's target hidden states
            ``[num_tokens - hidden_start, hidden_size]`` (:mod:`pdserve.kvtransfer.hidden`),
            queued after the request's last layer.
        hidden_start: the first prompt position in ``hidden``.
    """

    request_id: str
    kv: torch.Tensor | None
    num_tokens: int
    dest_address: str
    layer_start: int = 0
    num_layers: int | None = None
    scales: torch.Tensor | None = None
    hidden_size: int = 0
    hidden: torch.Tensor | None = None
    hidden_start: int = 0

    @property
    def is_last(self) -> bool:
        """Whether the request's transfer ends with this job: its hidden section, or
        (without one) its last layer."""
        if self.kv is None:
            return True
        if self.hidden_size:
            return False
        total = self.kv.shape[0] if self.num_layers is None else self.num_layers
        return self.layer_start + self.kv.shape[0] >= total


def layers_per_message(kv: torch.Tensor, use_fp8: bool) -> int:
    """How many layers fit one message under :data:`MAX_KV_MESSAGE_BYTES`."""
    per_layer = kv[0].numel() * (1 if use_fp8 else kv.element_size())
    return max(1, min(kv.shape[0], MAX_KV_MESSAGE_BYTES // max(per_layer, 1)))


class KVSenderThread:
    """Pushes :class:`KVJob` objects in order; reports each with ``on_done``.

    Args:
        transport_name: a registered transport.
        use_fp8: quantize to FP8 e4m3 with per-(layer, K/V, block, head) scales.
        timeout_s: deadline for one message.
        rotation: "hadamard" rotates K/V along head_dim before quantizing to FP8
            (:mod:`pdserve.kvtransfer.rotation`); "none" does not.
        on_done: ``(request_id, num_bytes, seconds, error or None, push_s)``, called on
            this thread: ``seconds`` from the first layer's push to the end, ``push_s``
            of it spent encoding and pushing (the rest waited for layers to be prefilled).
    """

    def __init__(self, transport_name: str, use_fp8: bool, timeout_s: float,
                 on_done: Callable[[str, int, float, str | None, float], None],
                 cluster_keys=None, rotation: str = "none") -> None:
        self.transport = create_transport(transport_name, cluster_keys)
        self.cluster_keys = cluster_keys
        self.use_fp8 = use_fp8
        self.rotation = rotation
        self.timeout_s = timeout_s
        self.on_done = on_done
        self.jobs: queue.Queue[KVJob | None] = queue.Queue()
        self._senders: dict[str, KVSender] = {}
        # request id -> (bytes sent so far, monotonic start, seconds pushing) while its
        # layers stream; failed requests whose remaining layers are dropped
        self._streaming: dict[str, tuple[int, float, float]] = {}
        self._failed: set[str] = set()
        self._turns: CoreTurns | None = None  # take_turns: pushes wait for the cores
        self._thread = threading.Thread(target=self._run, name="kv-sender", daemon=True)
        self._thread.start()

    def take_turns(self, directory) -> None:
        """Push each job only while holding the cores of ``directory`` (a
        :class:`~pdserve.core_turns.CoreTurns` directory; call before the first job), so
        the FP8 encode and the push alternate with the workers' steps on the same cores
        instead of running beside them."""
        self._turns = CoreTurns(directory)

    def submit(self, job: KVJob) -> None:
        """Queue ``job`` behind the others (returns at once; any thread)."""
        self.jobs.put(job)

    def _sender(self, address: str) -> KVSender:
        sender = self._senders.get(address)
        if sender is None:
            sender = self.transport.create_sender(address, timeout_s=self.timeout_s)
            self._senders[address] = sender
        return sender

    def _encode(self, job: KVJob) -> list[tuple[object, list, int]]:
        """``job`` as wire messages: (header, signed where the cluster has keys; buffers;
        bytes of payload and scales), at most :data:`MAX_KV_MESSAGE_BYTES` of KV each."""
        if job.hidden is not None:
            encoded = [encode_hidden(job.request_id, job.hidden, hidden_start=job.hidden_start,
                                     num_tokens=job.num_tokens)]
        else:
            use_fp8 = self.use_fp8 or job.scales is not None
            step = layers_per_message(job.kv, use_fp8)
            encoded = [encode_kv(
                job.request_id, job.kv[start:start + step], layer_start=job.layer_start + start,
                num_tokens=job.num_tokens, use_fp8=use_fp8, hidden_size=job.hidden_size,
                rotation=self.rotation,
                scales=None if job.scales is None else job.scales[start:start + step])
                for start in range(0, job.kv.shape[0], step)]
        messages = []
        for enc in encoded:
            header = enc.header
            if self.cluster_keys is not None:
                header = sign_header(header, self.cluster_keys, job.dest_address)
            messages.append((header, enc.buffers, enc.header.num_message_bytes))
        return messages

    def _push(self, job: KVJob) -> tuple[int, float]:
        """Encode ``job`` (in a turn at the cores where this thread takes turns) and send
        it. Returns (bytes sent, seconds waited for the cores). Raises what the encode or
        the transport raises (KVTransferTimeout, KVFormatError, ...)."""
        wait_start = time.monotonic()
        with self._turns.turn() if self._turns is not None else nullcontext():
            waited_s = time.monotonic() - wait_start
            messages = self._encode(job)
        sender = self._sender(job.dest_address)  # the send holds no turn: a receiver that
        for header, buffers, _ in messages:      # went away must not keep the cores
            sender.send(header, buffers, timeout_s=self.timeout_s)
        return sum(m[2] for m in messages), waited_s

    def _run(self) -> None:
        background_priority()
        while True:
            job = self.jobs.get()
            if job is None:
                return
            rid = job.request_id
            if rid in self._failed:  # an earlier layer failed: already reported
                if job.is_last:
                    self._failed.discard(rid)
                continue
            sent_before, start, push_s = self._streaming.pop(rid, (0, time.monotonic(), 0.0))
            push_start = time.monotonic()
            try:
                num_bytes, waited_s = self._push(job)
                num_bytes += sent_before
            except Exception as exc:
                logger.warning("KV push of %s failed: %s", rid, exc)
                sender = self._senders.pop(job.dest_address, None)
                if sender is not None:  # a timed-out sender may still read our buffers
                    sender.close()
                if not job.is_last:
                    self._failed.add(rid)
                self.on_done(rid, 0, time.monotonic() - start, str(exc) or "error", push_s)
                continue
            now = time.monotonic()
            push_s += now - push_start - waited_s  # not counting the wait for the cores
            if job.is_last:
                self.on_done(rid, num_bytes, now - start, None, push_s)
            else:
                self._streaming[rid] = (num_bytes, start, push_s)

    def close(self) -> None:
        """Push the jobs already queued (waiting up to 5 s), then close every sender
        and the transport."""
        self.jobs.put(None)
        self._thread.join(timeout=5.0)
        for sender in self._senders.values():
            sender.close()
        self.transport.close()
        if self._turns is not None and not self._thread.is_alive():
            self._turns.close()
