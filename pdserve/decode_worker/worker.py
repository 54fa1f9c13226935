"""Decode worker: continuous batching over the engine, plus the receiving half of
disaggregated prefill.

Remote prefill, decode side (see ARCHITECTURE.md, "push into reserved blocks")::

    router: ExpectRemoteKV ──► reserve blocks, park request ──► KVReserved
    P ──KV (FP8/native)──► KVInbox thread (verify, dequantize)  ┐
    router: FirstToken ───────────────────────────────────────┤ both here?
                                                               └► write blocks, join batch
    no KV within --kv-transfer-timeout of the first token, or a bad checksum
                                                     ──► KVTransferFailed to router,
    which answers ResumeLocally (recompute here) or aborts (policy "fail").
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass

import torch

from pdserve.decode_worker.kv_inbox import KVInbox
from pdserve.engine.llm_engine import KVCapacityError, LLMEngine
from pdserve.messages import (
    ExpectRemoteKV,
    FirstToken,
    GenerateRequest,
    KVReserved,
    KVReserveRefused,
    KVTransferFailed,
    RequestFailed,
    ResumeLocally,
    StepOutputs,
)
from pdserve.worker_base import EngineWorker
from pdserve.worker_metrics import KVTransferTotals

logger = logging.getLogger(__name__)


@dataclass
class ParkedRequest:
    """A request waiting for its pushed KV and its first token."""

    reserved_s: float
    num_prompt_tokens: int = 0
    kv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # (kv, FP8 scales or None)
    first_token_id: int | None = None
    first_token_s: float | None = None  # when the prefill finished: the transfer's start
    is_failure_reported: bool = False


class DecodeWorker(EngineWorker):
    """See the module docstring.

    Args:
        kv_transport: transport name for receiving KV, or None to accept no remote prefill.
        kv_transfer_timeout_s: deadline from the first token (end of prefill) to a complete KV.
        kv_address: where the KV receiver listens (``tcp://HOST:PORT``, port ``*`` for any);
            None: the transport's loopback default.
        kv_advertise_host: host prefill workers connect to when it differs from the bound
            one (``kv_address`` on ``0.0.0.0``); None: the bound address as it is.
    """

    role = "decode"
    reports_cache_events = True

    def __init__(self, engine: LLMEngine, router_address: str, worker_id: str,
                 model_name: str, heartbeat_interval_s: float = 1.0,
                 kv_transport: str | None = "zmq", kv_transfer_timeout_s: float = 10.0,
                 kv_address: str | None = None, kv_advertise_host: str | None = None,
                 cluster_keys=None) -> None:
        super().__init__(engine, router_address, worker_id, model_name, heartbeat_interval_s,
                         cluster_keys)
        self.kv_transport = kv_transport
        self.kv_transfer_timeout_s = kv_transfer_timeout_s
        self.inbox = None
        if kv_transport is not None:
            self.inbox = KVInbox(kv_transport, engine.arch.num_layers, engine.runner.dtype,
                                 address=kv_address, advertise_host=kv_advertise_host,
                                 keep_fp8=engine.runner.kv_scales is not None,
                                 cluster_keys=cluster_keys, expects=self._expected_kv)
        self.parked: dict[str, ParkedRequest] = {}

    def registration_extras(self) -> dict:
        """The KV receiver's advertised address and transport, so the router can tell
        prefill workers where to push (none without a transport)."""
        if self.inbox is None:
            return {}
        return {"kv_address": self.inbox.address, "kv_transport": self.kv_transport}

    def handle(self, msg) -> None:
        """Requests to run here, reservations for remotely prefilled ones, their first
        tokens, and orders to recompute a parked request locally."""
        if isinstance(msg, GenerateRequest):
            try:
                self.engine.add_request(msg.request_id, msg.prompt_token_ids,
                                        msg.sampling_params, msg.arrival_time,
                                        output_token_ids=msg.output_token_ids)
            except ValueError as exc:
                self.send(RequestFailed(msg.request_id, str(exc)))
        elif isinstance(msg, ExpectRemoteKV):
            self._reserve(msg)
        elif isinstance(msg, FirstToken):
            parked = self.parked.get(msg.request_id)
            if parked is not None:
                parked.first_token_id = msg.token_id
                parked.first_token_s = time.monotonic()
                self._try_complete(msg.request_id)
        elif isinstance(msg, ResumeLocally):
            if self.parked.pop(msg.request_id, None) is not None:
                self.engine.resume_locally(msg.request_id, msg.output_token_ids)
        else:
            super().handle(msg)

    def _reserve(self, msg: ExpectRemoteKV) -> None:
        try:
            num_cached = self.engine.reserve_remote_prefill(
                msg.request_id, msg.prompt_token_ids, msg.sampling_params, msg.arrival_time)
        except KVCapacityError as exc:
            self.send(KVReserveRefused(msg.request_id, str(exc), is_capacity=True))
            return
        except ValueError as exc:
            self.send(KVReserveRefused(msg.request_id, str(exc), is_capacity=False))
            return
        self.parked[msg.request_id] = ParkedRequest(time.monotonic(),
                                                    len(msg.prompt_token_ids))
        self.send(KVReserved(msg.request_id, num_cached))

    def _expected_kv(self, request_id: str) -> int | None:
        """The inbox thread's check: prompt tokens reserved for ``request_id`` whose KV has
        not arrived yet, else None (a dict read; the engine thread owns ``parked``)."""
        parked = self.parked.get(request_id)
        if parked is None or parked.kv is not None or parked.is_failure_reported:
            return None
        return parked.num_prompt_tokens

    def _try_complete(self, rid: str) -> None:
        parked = self.parked[rid]
        if parked.kv is None or parked.first_token_id is None:
            return
        del self.parked[rid]
        try:
            self.engine.complete_remote_prefill(rid, parked.first_token_id, *parked.kv)
        except ValueError as exc:
            logger.warning("KV for %s does not fit: %s", rid, exc)
            self.parked[rid] = ParkedRequest(parked.reserved_s, parked.num_prompt_tokens, None,
                                             parked.first_token_id, parked.first_token_s, True)
            self.send(KVTransferFailed(self.worker_id, rid, "format"))

    def poll_extra(self) -> None:
        """Match KV that arrived on the inbox thread with parked requests, and report
        parked requests whose KV failed or did not come within
        ``kv_transfer_timeout_s`` of their first token."""
        if self.inbox is not None:
            while True:
                try:
                    rid, item = self.inbox.ready.get_nowait()
                except queue.Empty:
                    break
                parked = self.parked.get(rid)
                if parked is None or parked.is_failure_reported:
                    continue  # aborted, resumed or already failed
                if isinstance(item, str):
                    parked.is_failure_reported = True
                    self.send(KVTransferFailed(self.worker_id, rid, item))
                else:
                    parked.kv = item
                    self._try_complete(rid)
        # The deadline runs from the end of the prefill (the first token's arrival): the
        # prefill itself may take long on a busy prefill worker, whose death the router's
        # heartbeats catch.
        now = time.monotonic()
        for rid, parked in self.parked.items():
            if (parked.kv is None and not parked.is_failure_reported
                    and parked.first_token_s is not None
                    and now - parked.first_token_s > self.kv_transfer_timeout_s):
                parked.is_failure_reported = True
                self.send(KVTransferFailed(self.worker_id, rid, "timeout"))

    def abort(self, request_id: str) -> None:
        """Forget a parked request too, so late KV for it is dropped."""
        self.parked.pop(request_id, None)
        super().abort(request_id)

    def after_step(self, deltas) -> None:
        """Send the step's deltas to the router in one :class:`StepOutputs` and count the
        requests that finished."""
        if deltas:
            self.num_requests_served += sum(d.finished for d in deltas)
            self.send(StepOutputs(self.worker_id, deltas))

    def kv_transfer_totals(self) -> KVTransferTotals:
        """Bytes received, connections refused and messages dropped by the KV inbox."""
        if self.inbox is None:
            return KVTransferTotals()
        return KVTransferTotals(
            num_bytes_received=self.inbox.num_bytes_received,
            num_refused_connections=getattr(self.inbox.transport, "num_refused_peers", 0),
            num_dropped_kv_messages=self.inbox.num_dropped)

    def close(self) -> None:
        """Stop the KV inbox thread and its transport."""
        if self.inbox is not None:
            self.inbox.close()
