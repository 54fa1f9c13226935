"""Prefill worker: batched, chunked prefill in the shared engine; returns each request's
first token to the router at once (the TTFT clients see), then pushes its KV to the
decode worker that reserved blocks for it.

A request's blocks are copied out and freed as soon as its prefill finishes, so this worker
holds cache memory only while computing; the copy is what the sender thread pushes. KV goes
layer by layer: in the step that completes a prompt, each layer's blocks are copied and
queued for the sender as soon as the forward has written that layer, so the transfer of the
first layers overlaps the compute of the last ones (``LLMEngine.kv_layer_sink``). When decode
workers draft with EAGLE, the prompt's target hidden states (the head's input) follow the
layers as the transfer's hidden section (:mod:`.hidden_export`).
"""

from __future__ import annotations

import logging
import time

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestDelta
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.spec_decode.eagle_proposer import eagle_feature_layers
from pdserve.kvtransfer.wire import NATIVE_WIRE_DTYPES
from pdserve.messages import KVSent, PrefillDone, PrefillRequest, RequestFailed
from pdserve.prefill_worker.hidden_export import PromptHiddenExport
from pdserve.prefill_worker.kv_sender import KVJob, KVSenderThread
from pdserve.worker_base import EngineWorker
from pdserve.worker_metrics import KVTransferTotals

logger = logging.getLogger(__name__)

#: ``--kv-transfer-dtype`` values
KV_TRANSFER_DTYPES = ("fp8", "fp8-hadamard", "auto")


class PrefillWorker(EngineWorker):
    """See the module docstring.

    Args:
        kv_transport: transport name used to push KV.
        kv_transfer_dtype: "fp8" (e4m3 with scales), "fp8-hadamard" (the same after a
            Hadamard rotation along head_dim, undone on receipt) or "auto" (the cache
            dtype, exact).
        kv_transfer_timeout_s: deadline for one KV message.
        eagle_model: the decode workers' EAGLE head (``--speculative-model``): send each
            prompt's target hidden states it reads (final ones, or an EAGLE-3 head's fused
            layer inputs) with its KV; None: send none.
        hidden_dtype: their wire dtype, "bfloat16", "float16", "float32", "auto" (the
            model's) or "none" (send none).

    Raises:
        ValueError: a bad ``kv_transfer_dtype`` or ``hidden_dtype``, an engine that has a
            proposer (a prefill worker drafts nothing), or a bad head config.json.
        FileNotFoundError: ``eagle_model`` names no head folder.
    """

    role = "prefill"

    def __init__(self, engine: LLMEngine, router_address: str, worker_id: str,
                 model_name: str, heartbeat_interval_s: float = 1.0,
                 kv_transport: str = "zmq", kv_transfer_dtype: str = "fp8",
                 kv_transfer_timeout_s: float = 10.0, cluster_keys=None,
                 eagle_model: str | None = None, hidden_dtype: str = "bfloat16") -> None:
        super().__init__(engine, router_address, worker_id, model_name, heartbeat_interval_s,
                         cluster_keys)
        if kv_transfer_dtype not in KV_TRANSFER_DTYPES:
            raise ValueError(f"kv_transfer_dtype must be one of {list(KV_TRANSFER_DTYPES)}, "
                             f"got {kv_transfer_dtype!r}")
        self.hidden = None
        if eagle_model is not None and hidden_dtype != "none":
            self.hidden = _hidden_export(engine, eagle_model, hidden_dtype)
            self.engine.proposer = self.hidden  # called after every step with its hidden
        self.sender = KVSenderThread(
            kv_transport, kv_transfer_dtype != "auto", kv_transfer_timeout_s, self._on_sent,
            cluster_keys, rotation="hadamard" if kv_transfer_dtype == "fp8-hadamard" else "none")
        self.pending: dict[str, tuple[PrefillRequest, float]] = {}
        self.num_kv_bytes_sent = 0  # written by the sender thread only
        self.num_kv_transfers_sent = 0
        self.num_kv_transfers_failed = 0
        self.engine.kv_layer_sink = self._on_kv_layer
        fused = engine.runner.fused_decode  # no request pays for a GEMM's compile
        self._stop_warming = (fused.start_warming(engine.scheduler.max_num_batched_tokens)
                              if fused is not None else None)

    def share_cores_with_decode(self) -> None:
        """Set up for taking turns at the cores with a decode worker (:attr:`core_turns`
        set): a long forward hands the cores over between decoder layers
        (:meth:`~pdserve.core_turns.CoreTurns.pause_between_layers`), KV goes after the
        first token (:meth:`stream_kv_by_layer`), and the sender thread encodes and pushes
        it in turns too (:meth:`KVSenderThread.take_turns`): beside the decode worker's
        steps, the FP8 encode of a long prompt's KV slowed them (W3 on a 2-core Xeon, a
        thirteenth-session figure in the README)."""
        runner = self.engine.runner
        self.core_turns.pause_between_layers(runner.model, fused=runner.fused_decode)
        self.stream_kv_by_layer(False)
        self.sender.take_turns(self.core_turns.directory)

    def stream_kv_by_layer(self, enabled: bool) -> None:
        """Push each layer's KV as the forward writes it (True, the default: the transfer of
        the first layers overlaps the compute of the last ones), or a prompt's whole KV once
        its first token has gone to the router (False). ``serve`` turns streaming off where
        this worker takes turns at the cores with the decode worker: nothing idles beside
        the forward to overlap with, and the sender's and the receiving decode worker's work
        ran on the forward's cores (a lone ~1,900-token prompt on a 2-core Xeon: TTFT
        1.03-1.18 s streaming, 0.89-0.95 s with no KV pushed at all)."""
        self.engine.kv_layer_sink = self._on_kv_layer if enabled else None

    def _on_kv_layer(self, request_id: str, layer: int, kv, scales, num_tokens: int) -> None:
        """Engine thread, inside a forward: queue one layer of a finishing prefill (an FP8
        cache's codes go with their scales, as stored)."""
        entry = self.pending.get(request_id)
        if entry is None or entry[0].sampling_params.max_tokens == 1:
            return  # aborted, or the first token is all it wants (no decode worker waits)
        self.sender.submit(KVJob(request_id, kv, num_tokens, entry[0].dest_kv_address,
                                 layer_start=layer, num_layers=self.engine.arch.num_layers,
                                 scales=scales, hidden_size=self._hidden_size))

    @property
    def _hidden_size(self) -> int:
        """Width of the hidden section this worker's transfers carry (0: none)."""
        return 0 if self.hidden is None else self.hidden.width

    def handle(self, msg) -> None:
        """Start a :class:`PrefillRequest` with its KV exported, or report why the
        engine refused it."""
        if isinstance(msg, PrefillRequest):
            try:
                self.engine.add_request(msg.request_id, msg.prompt_token_ids,
                                        msg.sampling_params, msg.arrival_time, export_kv=True)
            except ValueError as exc:
                self.send(RequestFailed(msg.request_id, str(exc)))
                return
            self.pending[msg.request_id] = (msg, time.monotonic())
        else:
            super().handle(msg)

    def abort(self, request_id: str) -> None:
        """Forget a pending prefill too, so none of its KV is pushed."""
        self.pending.pop(request_id, None)
        if self.hidden is not None:
            self.hidden.pop(request_id)
        super().abort(request_id)

    def after_step(self, deltas: list[RequestDelta]) -> None:
        """For each finished prefill: send its first token to the router and queue any KV
        still to push for the decode worker, unless that token ends the request."""
        for delta in deltas:
            entry = self.pending.pop(delta.request_id, None)
            kv = self.engine.pop_exported_kv(delta.request_id)
            hidden = None if self.hidden is None else self.hidden.pop(delta.request_id)
            if entry is None:
                continue
            msg, start = entry
            is_natural_end = _first_token_ends_request(delta, msg.sampling_params)
            first = RequestDelta(
                request_id=delta.request_id, new_token_ids=delta.new_token_ids,
                new_logprobs=delta.new_logprobs,
                finish_reason=delta.finish_reason if is_natural_end else None,
                num_prompt_tokens=delta.num_prompt_tokens,
                num_cached_tokens=delta.num_cached_tokens, queue_time_s=delta.queue_time_s)
            self.send(PrefillDone(self.worker_id, first, time.monotonic() - start))
            self.num_requests_served += 1
            num_tokens = len(msg.prompt_token_ids)
            # layers went during the forward (kv_layer_sink), or go now as one copy
            is_kv_sent = kv is None and msg.sampling_params.max_tokens != 1
            if not is_natural_end and kv is not None:
                self.sender.submit(KVJob(delta.request_id, kv, num_tokens, msg.dest_kv_address,
                                         hidden_size=self._hidden_size))
                is_kv_sent = True
            if is_kv_sent and hidden is not None:  # the hidden section their headers announced
                self.sender.submit(KVJob(delta.request_id, None, num_tokens, msg.dest_kv_address,
                                         hidden_start=hidden[0], hidden=hidden[1]))

    def _on_sent(self, request_id: str, num_bytes: int, seconds: float,
                 error: str | None, push_s: float) -> None:
        self.num_kv_bytes_sent += num_bytes
        if error is None:
            self.num_kv_transfers_sent += 1
        else:
            self.num_kv_transfers_failed += 1
        self.send(KVSent(self.worker_id, request_id, num_bytes, seconds, error, push_s))

    def kv_transfer_totals(self) -> KVTransferTotals:
        """Bytes pushed and transfers sent or failed, as counted by the sender thread."""
        return KVTransferTotals(num_bytes_sent=self.num_kv_bytes_sent,
                                num_transfers_sent=self.num_kv_transfers_sent,
                                num_transfers_failed=self.num_kv_transfers_failed)

    def close(self) -> None:
        """Stop the GEMM warm-up and the KV sender thread (it pushes the jobs already queued
        first, for up to 5 s)."""
        if self._stop_warming is not None:
            self._stop_warming()
        self.sender.close()


def _hidden_export(engine: LLMEngine, eagle_model: str,
                   hidden_dtype: str) -> PromptHiddenExport:
    """The collector of the prompt hidden states the head ``eagle_model`` reads
    (``hidden_dtype`` "auto": the model's dtype)."""
    if engine.proposer is not None:
        raise ValueError("a prefill worker drafts nothing: its engine must have no proposer "
                         "to send prompt hidden states")
    if hidden_dtype == "auto":
        dtype = engine.runner.dtype
    elif hidden_dtype in NATIVE_WIRE_DTYPES:
        dtype = NATIVE_WIRE_DTYPES[hidden_dtype]
    else:
        raise ValueError(f"hidden_dtype must be one of {[*NATIVE_WIRE_DTYPES, 'auto']}, got "
                         f"{hidden_dtype!r}")
    layers = eagle_feature_layers(eagle_model, engine.arch.num_layers)
    return PromptHiddenExport(layers, engine.arch.hidden_size, dtype)


def _first_token_ends_request(delta: RequestDelta, params: SamplingParams) -> bool:
    """Whether the request ends with its first token under its real parameters (the engine
    ran it with max_tokens=1, so "length" alone says nothing)."""
    return delta.finish_reason == "stop" or params.max_tokens == 1
