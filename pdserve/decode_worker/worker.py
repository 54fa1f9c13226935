"""Decode worker: continuous batching over the engine, plus the receiving half of
disaggregated prefill.

Remote prefill, decode side (see ARCHITECTURE.md, "push into reserved blocks")::

    router: ExpectRemoteKV ──► reserve blocks, park request ──► KVReserved
    P ──KV (FP8/native)──► KVInbox thread (verify; FP8 on CPU: dequantized straight into
                           the reserved blocks, layer by layer)┐
    router: FirstToken ───────────────────────────────────────┤ both here?
                                                               └► write blocks, join batch
    no KV within --kv-transfer-timeout of the first token, or a bad checksum
                                                     ──► KVTransferFailed to router,
    which answers ResumeLocally (recompute here) or aborts (policy "fail").

Each such request is a :class:`~pdserve.decode_worker.kv_lifecycle.RemoteKV` moving through
explicit states (reserved, receiving, ready, running, failed -> recomputing) with a
deadline on each; every way out of the KV wait frees its blocks in :meth:`_release_kv`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import torch

from pdserve.core_turns import YIELD_STEP_TOKENS
from pdserve.decode_worker.kv_inbox import KVInbox
from pdserve.decode_worker.kv_lifecycle import (
    FINAL, LIVE, RELEASES_KV, KVDeadlines, KVEvent, KVState, RemoteKV)
from pdserve.engine.llm_engine import KVCapacityError, LLMEngine
from pdserve.engine.request import RequestStatus
from pdserve.fp8 import dequantize_into_cache
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

#: On CPU, beside running decodes, a prompt prefilled here goes in chunks of at most this
#: many tokens a step (the scheduler's ``long_prefill_chunk``; alone, it takes the whole
#: step budget), so that the decodes still get a token every ~0.1-2 s. 2-core AVX2 EPYC: in
#: 2,048-token chunks a 7,000-token ``echo`` + ``logprobs`` prompt (which prefills here
#: whatever its length) stopped every other stream for 5-10 s a step (now at most 1.6 s, and
#: a short chat sent meanwhile 29-32 -> 7.4-10 s); colocated, a 3,000-token prompt beside four
#: streams: its TTFT 7.3 -> 8.3 s, a 200-token one's 6.8 -> 0.8-1.3 s, longest gap 4.4 -> 0.9 s.
LONG_PREFILL_CHUNK_TOKENS = 256


class DecodeWorker(EngineWorker):
    """See the module docstring.

    Args:
        kv_transport: transport name for receiving KV, or None to accept no remote prefill.
        kv_transfer_timeout_s: deadline from the first token (end of prefill) to a complete KV.
        kv_address: where the KV receiver listens (``tcp://HOST:PORT``, port ``*`` for any);
            None: the transport's loopback default.
        kv_advertise_host: host prefill workers connect to when it differs from the bound
            one (``kv_address`` on ``0.0.0.0``); None: the bound address as it is.
        kv_deadlines: each remote-KV state's deadline; None: the defaults, with
            ``kv_transfer_timeout_s`` for the receiving and ready states.
    """

    role = "decode"
    reports_cache_events = True

    def __init__(self, engine: LLMEngine, router_address: str, worker_id: str,
                 model_name: str, heartbeat_interval_s: float = 1.0,
                 kv_transport: str | None = "zmq", kv_transfer_timeout_s: float = 10.0,
                 kv_address: str | None = None, kv_advertise_host: str | None = None,
                 cluster_keys=None, kv_deadlines: KVDeadlines | None = None) -> None:
        super().__init__(engine, router_address, worker_id, model_name, heartbeat_interval_s,
                         cluster_keys)
        if engine.runner.kv_cache.device.type == "cpu":  # a GPU's 2,048-token step is short
            engine.scheduler.long_prefill_chunk = LONG_PREFILL_CHUNK_TOKENS
        self.kv_transport = kv_transport
        self.kv_transfer_timeout_s = kv_transfer_timeout_s
        self.kv_deadlines = kv_deadlines or KVDeadlines(receiving_s=kv_transfer_timeout_s,
                                                        ready_s=kv_transfer_timeout_s)
        #: remotely prefilled requests not yet running, recomputing or aborted
        self.remote: dict[str, RemoteKV] = {}
        #: parked request id -> requests with the same prompt (``GenerateRequest.wait_for``)
        #: that reach the engine once its KV is installed, to start from the prefix cache
        self.held: dict[str, list[GenerateRequest]] = {}
        # held by the inbox thread while it writes into reserved blocks; taken before the
        # engine thread frees them (_release_kv), so no write lands in a reused block, and
        # for each engine step (engine_step), so writes and steps take turns on the cores
        self._kv_write_lock = threading.RLock()
        self.inbox = None
        if kv_transport is not None:
            self.inbox = KVInbox(kv_transport, engine.arch.num_layers, engine.runner.dtype,
                                 address=kv_address, advertise_host=kv_advertise_host,
                                 keep_fp8=(engine.runner.kv_scales is not None
                                           or engine.runner.kv_cache.device.type == "cpu"),
                                 cluster_keys=cluster_keys, expects=self._expected_kv,
                                 writer=self._write_kv_layers,
                                 block_shape=(engine.config.block_size, engine.arch.num_kv_heads,
                                              engine.arch.head_dim))
        fused = engine.runner.fused_decode  # no request pays for a GEMM's compile
        if fused is not None:  # nor for a weight's reorder (it would skew the prefill rate)
            fused.pack_weights()
        self._stop_warming = (fused.start_warming(engine.scheduler.max_num_batched_tokens)
                              if fused is not None else None)

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
            if self._is_parked(msg.wait_for):
                self.held.setdefault(msg.wait_for, []).append(msg)
            else:
                self._add(msg)
        elif isinstance(msg, ExpectRemoteKV):
            self._reserve(msg)
        elif isinstance(msg, FirstToken):
            entry = self.remote.get(msg.request_id)
            if entry is not None and entry.first_token_id is None:
                entry.first_token_id = msg.token_id
                self._fire(msg.request_id, KVEvent.FIRST_TOKEN)
                self._try_install(msg.request_id)
        elif isinstance(msg, ResumeLocally):
            self._fire(msg.request_id, KVEvent.RESUME, msg.output_token_ids)
        else:
            super().handle(msg)

    def _add(self, msg: GenerateRequest) -> None:
        if msg.request_id in self.engine.requests:  # the router took this worker for dead
            self._fire(msg.request_id, KVEvent.ABORT)  # (a stall) and retries here: the
            self.engine.abort_request(msg.request_id)  # copy it gave up on goes
        try:
            self.engine.add_request(msg.request_id, msg.prompt_token_ids, msg.sampling_params,
                                    msg.arrival_time, output_token_ids=msg.output_token_ids)
        except ValueError as exc:
            self.send(RequestFailed(msg.request_id, str(exc)))

    def _is_parked(self, request_id: str | None) -> bool:
        """Whether ``request_id`` is an engine request still waiting for its remote KV."""
        req = self.engine.requests.get(request_id) if request_id is not None else None
        return req is not None and req.status is RequestStatus.WAITING_FOR_KV

    def _release_held(self) -> None:
        """Hand the engine the requests held for a parked one whose wait ended (its KV
        installed: they prefill from the prefix cache; or it failed or was aborted)."""
        for rid in [rid for rid in self.held if not self._is_parked(rid)]:
            for msg in self.held.pop(rid):
                self._add(msg)

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
        self.remote[msg.request_id] = RemoteKV(len(msg.prompt_token_ids))
        self.send(KVReserved(msg.request_id, num_cached))

    def _expected_kv(self, request_id: str) -> int | None:
        """The inbox thread's check: prompt tokens reserved for ``request_id`` whose KV may
        still be stored, else None (a dict read; the engine thread owns ``remote``)."""
        entry = self.remote.get(request_id)
        return entry.num_prompt_tokens if entry is not None and entry.accepts_kv else None

    def _fire(self, rid: str, event: KVEvent, output_token_ids: list[int] | None = None,
              ) -> KVState | None:
        """Move ``rid`` on by ``event`` and do what entering the new state means: release
        its KV, report a failure, recompute, abort. None: not here, or ignored."""
        entry = self.remote.get(rid)
        new = None if entry is None else entry.fire(event)
        if new is None:
            return None
        if new in RELEASES_KV:
            self._release_kv(rid, entry)
        if new is KVState.FAILED:
            self.send(KVTransferFailed(self.worker_id, rid, entry.failure or "timeout"))
        elif new is KVState.RECOMPUTING:
            self.engine.resume_locally(rid, list(output_token_ids or []))
        elif new is KVState.ABORTED:
            self.engine.abort_request(rid)
            if event is KVEvent.DEADLINE:  # the router never answered the failure
                self.send(RequestFailed(rid, "the KV transfer failed and the router did not "
                                             "answer in time", is_client_error=False))
        if new in FINAL:
            del self.remote[rid]
        return new

    def _release_kv(self, rid: str, entry: RemoteKV) -> None:
        """The one place a remotely prefilled request's KV is let go before it runs (failed,
        recomputing, aborted): the partly received layers and the reserved blocks. The
        request stays parked in the engine (resume_locally or abort_request ends it)."""
        entry.kv = None
        if self.inbox is not None:
            self.inbox.discard(rid)
        with self._kv_write_lock:  # an inbox write into these blocks ends first
            req = self.engine.requests.get(rid)
            if req is not None and req.status is RequestStatus.WAITING_FOR_KV:
                self.engine.block_manager.free(req)

    def _write_kv_layers(self, rid: str, decoded) -> bool:
        """Inbox thread: dequantize an FP8 message straight into ``rid``'s reserved blocks
        (one pass, while the prefill still computes the later layers), so the install at
        the end writes nothing. False where it does not apply (FP8 or non-CPU cache, a
        native wire): the inbox assembles the KV instead. A request no longer receiving
        has its message dropped (True). Raises ValueError: the message does not fit."""
        runner = self.engine.runner
        if not decoded.is_fp8 or runner.kv_scales is not None \
                or runner.kv_cache.device.type != "cpu":
            return False
        with self._kv_write_lock:
            entry = self.remote.get(rid)
            req = self.engine.requests.get(rid)
            if entry is None or not entry.accepts_kv or req is None or not req.block_table:
                return True
            bs = self.engine.block_manager.block_size
            num_blocks = self.engine.block_manager.num_blocks_for(req.num_prompt_tokens)
            if decoded.values.shape[2] != num_blocks:
                raise ValueError(f"{decoded.values.shape[2]} blocks for a {num_blocks}-block "
                                 "reservation")
            first = req.num_cached_tokens // bs  # blocks this worker had cached: kept
            ids = torch.tensor(req.block_table[first:num_blocks], dtype=torch.int64)
            dequantize_into_cache(decoded.values[:, :, first:], decoded.scales[:, :, first:],
                                  runner.kv_cache, ids, decoded.header.layer_start)
        return True

    def _try_install(self, rid: str) -> None:
        """Write a READY request's KV into its blocks and start it, once its first token
        is in; KV that does not fit fails it."""
        entry = self.remote.get(rid)
        if entry is None or entry.state is not KVState.READY or entry.first_token_id is None:
            return
        kv, entry.kv = entry.kv, None
        try:
            self.engine.complete_remote_prefill(rid, entry.first_token_id, *kv)
        except ValueError as exc:
            logger.warning("KV for %s does not fit: %s", rid, exc)
            entry.failure = "format"
            self._fire(rid, KVEvent.KV_BAD)
            return
        self._fire(rid, KVEvent.INSTALLED)

    def poll_extra(self) -> None:
        """Match KV that arrived on the inbox thread with waiting requests, then fire the
        deadline of every request whose state has lasted too long."""
        if self.inbox is not None:
            while True:
                try:
                    rid, item = self.inbox.ready.get_nowait()
                except queue.Empty:
                    break
                entry = self.remote.get(rid)
                if entry is None or not entry.accepts_kv:
                    continue  # aborted, resumed or already failed
                if isinstance(item, str):
                    entry.failure = item
                    self._fire(rid, KVEvent.KV_BAD)
                else:
                    entry.kv = item
                    self._fire(rid, KVEvent.KV_COMPLETE)
                    self._try_install(rid)
        self.check_kv_deadlines(time.monotonic())
        if self.held:
            self._release_held()

    def check_kv_deadlines(self, now_s: float) -> None:
        """Fire DEADLINE for each remote request whose state's deadline is before ``now_s``
        (the receiving state's runs from the first token: the prefill itself may take long
        on a busy prefill worker, whose death the router's heartbeats catch)."""
        for rid, entry in list(self.remote.items()):
            deadline = entry.deadline_s(self.kv_deadlines)
            if deadline is not None and now_s > deadline:
                if entry.state in LIVE:
                    entry.failure = "timeout"
                self._fire(rid, KVEvent.DEADLINE)

    def abort(self, request_id: str) -> None:
        """Abort a waiting remote request through its lifecycle too (late KV is dropped),
        and a held one before it reaches the engine."""
        for rid, msgs in self.held.items():
            self.held[rid] = [m for m in msgs if m.request_id != request_id]
        self._fire(request_id, KVEvent.ABORT)
        super().abort(request_id)

    def has_work(self) -> bool:
        """Engine requests, or requests held for a parked one."""
        return super().has_work() or any(self.held.values())

    def new_prompt_waits(self) -> bool:
        """While waiting for the cores: take in the messages that came, and say whether a
        prompt here still needs (some of) its prefill, so that a long prefill on the same
        cores pauses for it after :data:`~pdserve.core_turns.URGENT_SLICE_S` instead of
        :data:`~pdserve.core_turns.PAUSE_SLICE_S`."""
        self._receive_messages(wait=False)
        sched = self.engine.scheduler
        return sched.num_waiting > 0 or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in sched.running)

    def engine_step(self):
        """One engine step; while a prefill worker on the same cores waits for them (it
        paused a long prefill for this step, see :mod:`pdserve.core_turns`), at most
        :data:`~pdserve.core_turns.YIELD_STEP_TOKENS` tokens (every running decode still
        gets its token), so a short prompt's prefill does not hold up the long one.

        The step holds the KV write lock, so the inbox thread writes a prefilled prompt's KV
        between steps, not beside one: on a 2-core Xeon (W3, twelfth session) the writes of
        a long prompt's KV, landing during the decode worker's steps, made a step carrying
        two short prompts' prefills take 0.39 s (~0.09 s alone). With steps and writes
        taking turns the two short prompts that arrive 0.4 s into the 2,825-token prompt
        took 0.24-0.26 s in two runs and 0.49-0.69 in two more, against 0.45-0.59 in three
        without (the W3 tail is noisy; the prefill worker's FP8 encode of the same KV still
        runs beside the steps)."""
        with self._kv_write_lock:
            return self._engine_step()

    def _engine_step(self):
        turns, sched = self.core_turns, self.engine.scheduler
        if turns is None or not turns.is_waited_for():
            return self.engine.step()
        budget = sched.max_num_batched_tokens
        sched.max_num_batched_tokens = min(budget, max(YIELD_STEP_TOKENS, len(sched.running)))
        try:
            return self.engine.step()
        finally:
            sched.max_num_batched_tokens = budget

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
        """Stop the GEMM warm-up, the KV inbox thread and its transport."""
        if self._stop_warming is not None:
            self._stop_warming()
        if self.inbox is not None:
            self.inbox.close()
