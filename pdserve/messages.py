"""Typed control and token-stream messages between the router and the workers.

msgspec structs, msgpack on the wire, one tagged union per direction; never pickle. The
router binds one zmq ROUTER socket; each worker connects a DEALER socket whose identity is
its ``worker_id``, so one connection carries both directions.

Worker -> router: :class:`RegisterWorker`, :class:`Heartbeat`, :class:`StepOutputs`,
:class:`RequestFailed`, :class:`KVCacheEvents`. Router -> worker: :class:`RegisterAck`, :class:`GenerateRequest`,
:class:`AbortRequests`, :class:`ReregisterRequest`, :class:`ShutdownWorker`. The disaggregation work adds its
messages to the same unions.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from pdserve.engine.outputs import RequestDelta
from pdserve.engine.sampling_params import SamplingParams


#: An integer that must be positive / not negative (a message that breaks it is dropped at
#: decoding: a peer holding the cluster secret still cannot make the router divide by zero
#: or cap every request's context at -1).
Positive = Annotated[int, msgspec.Meta(gt=0)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
#: Speculative positions reported per worker (each becomes a metrics series).
MAX_SPEC_POSITIONS = 32


class RegisterWorker(msgspec.Struct, tag="register"):
    """A worker announces itself (sent at start, and again if the router forgets it)."""

    worker_id: str
    role: Literal["decode", "prefill"]
    model_name: str
    max_model_len: Positive
    block_size: Annotated[int, msgspec.Meta(gt=0, le=4096)]
    num_kv_blocks: NonNegative
    pid: int
    kv_address: str | None = None  # where a decode worker receives pushed KV
    kv_transport: str | None = None
    #: the worker's own Prometheus endpoint (``http://HOST:PORT/metrics``), None if it
    #: serves none; ``pdserve serve``'s API server merges it into its ``/metrics``
    metrics_address: str | None = None
    #: whether the engine keeps a prefix cache (requests sharing a prompt can then share
    #: one prefill: the router sends ``n > 1`` siblings after the first one's KV)
    enable_prefix_caching: bool = True


class RegisterAck(msgspec.Struct, tag="register_ack"):
    """The router accepted a registration; ``heartbeat_interval_s`` is the expected period."""

    heartbeat_interval_s: float


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    """Periodic load report of one worker."""

    worker_id: str
    num_running: int
    num_waiting: int
    num_free_blocks: int
    kv_cache_usage: float
    num_preemptions: int = 0
    num_prefix_hit_tokens: int = 0
    num_prefix_queried_tokens: int = 0
    num_requests_served: int = 0  # requests this worker finished (prefills, for P)
    # speculative decoding, cumulative since the worker started
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    num_spec_accepted_tokens_per_pos: Annotated[
        list[int], msgspec.Meta(max_length=MAX_SPEC_POSITIONS)] = msgspec.field(
            default_factory=list)
    #: the worker got SIGTERM: it finishes what it runs and takes nothing new
    draining: bool = False
    #: prompt tokens admitted but not prefilled yet (waiting and partly prefilled requests)
    num_prefill_tokens_queued: int = 0
    #: moving average of measured prefill throughput, tokens/s over the engine steps that
    #: prefilled (0: none measured yet)
    prefill_tokens_per_s: float = 0.0
    #: prompt tokens the worker ran through its model since it started (cache hits and KV
    #: received from a prefill worker excluded)
    num_prompt_tokens_computed: int = 0


class GenerateRequest(msgspec.Struct, tag="generate"):
    """Router -> worker: prefill (if needed) and decode this request."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    # tokens already streamed to the client (a retry after a decode worker died):
    # generation continues after them and they count toward max_tokens
    output_token_ids: list[int] = msgspec.field(default_factory=list)
    # a request on this worker waiting for its remote KV with the same prompt: this one
    # reaches the engine once that KV is installed (or that wait ends), so it prefills from
    # the prefix cache instead of computing the prompt again (``n > 1`` choices)
    wait_for: str | None = None


class ExpectRemoteKV(msgspec.Struct, tag="expect_kv"):
    """Router -> decode worker: reserve blocks for this prompt; its KV will be pushed."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float


class KVReserved(msgspec.Struct, tag="kv_reserved"):
    """Decode worker -> router: blocks reserved (``num_cached_tokens`` already cached)."""

    request_id: str
    num_cached_tokens: int


class KVReserveRefused(msgspec.Struct, tag="kv_refused"):
    """Decode worker -> router: cannot reserve now (``is_capacity``) or invalid request."""

    request_id: str
    message: str
    is_capacity: bool


class PrefillRequest(msgspec.Struct, tag="prefill"):
    """Router -> prefill worker: prefill, return the first token, push the KV to ``dest``."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    dest_worker_id: str
    dest_kv_address: str


class PrefillDone(msgspec.Struct, tag="prefill_done"):
    """Prefill worker -> router: the first token (sent before the KV transfer starts).

    ``delta.finish_reason`` is set only when the first token really ends the request.
    """

    worker_id: str
    delta: RequestDelta
    prefill_time_s: float


class KVSent(msgspec.Struct, tag="kv_sent"):
    """Prefill worker -> router: a request's KV transfer finished (or failed)."""

    worker_id: str
    request_id: str
    num_bytes: NonNegative
    seconds: Annotated[float, msgspec.Meta(ge=0)]
    error: str | None = None
    #: seconds the sender spent encoding and pushing (``seconds`` also covers the waits
    #: for layers still being prefilled)
    push_s: float = 0.0


class FirstToken(msgspec.Struct, tag="first_token"):
    """Router -> decode worker: the prefill worker's first token of a parked request."""

    request_id: str
    token_id: int


class ResumeLocally(msgspec.Struct, tag="resume_locally"):
    """Router -> decode worker: the KV will not come; recompute the prefill here and go
    on after ``output_token_ids`` (tokens the client already has)."""

    request_id: str
    output_token_ids: list[int]


class KVTransferFailed(msgspec.Struct, tag="kv_failed"):
    """Decode worker -> router: a parked request's KV did not arrive intact in time."""

    worker_id: str
    request_id: str
    reason: str  # "timeout" | "checksum" | "format"


class AbortRequests(msgspec.Struct, tag="abort"):
    """Router -> worker: stop these requests and free their blocks now."""

    request_ids: list[str]


class ReregisterRequest(msgspec.Struct, tag="reregister"):
    """Router -> worker: the router does not know you (restarted, or dropped you as dead)."""


class ShutdownWorker(msgspec.Struct, tag="shutdown"):
    """Router -> worker: exit cleanly."""


class StepOutputs(msgspec.Struct, tag="step_outputs"):
    """Worker -> router: every request's new tokens from one engine step."""

    worker_id: str
    deltas: list[RequestDelta]


class KVCacheEvents(msgspec.Struct, tag="kv_cache_events"):
    """Decode worker -> router: changes to the worker's prefix cache, in order.

    ``stored[i]`` True: block hash ``block_hashes[i]`` became cached (its K/V computed or
    installed); False: it was evicted. With ``reset`` the lists give every cached block and
    replace what the router knew (a new router, or a journal that overflowed). Hashes are
    :func:`~pdserve.engine.block_manager.chain_block_hashes`' (signed 64-bit).
    """

    worker_id: str
    stored: list[bool]
    block_hashes: list[int]
    reset: bool = False


class RequestFailed(msgspec.Struct, tag="request_failed"):
    """Worker -> router: a request was refused or failed; ``message`` is user-facing."""

    request_id: str
    message: str
    is_client_error: bool = True


ToRouter = (RegisterWorker | Heartbeat | StepOutputs | RequestFailed | KVReserved
            | KVReserveRefused | PrefillDone | KVSent | KVTransferFailed | KVCacheEvents)
ToWorker = (RegisterAck | GenerateRequest | AbortRequests | ReregisterRequest | ShutdownWorker
            | ExpectRemoteKV | PrefillRequest | FirstToken | ResumeLocally)


class MessageCodec:
    """Encoder/decoders for both directions (one instance per socket owner)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._to_router = msgspec.msgpack.Decoder(ToRouter)
        self._to_worker = msgspec.msgpack.Decoder(ToWorker)

    def encode(self, msg: ToRouter | ToWorker) -> bytes:
        """msgpack bytes of a message to either side (its struct tag says which type)."""
        return self._encoder.encode(msg)

    def decode_to_router(self, data: bytes) -> ToRouter:
        """Raises ``msgspec.DecodeError``/``ValidationError`` for malformed bytes."""
        return self._to_router.decode(data)

    def decode_to_worker(self, data: bytes) -> ToWorker:
        """Raises ``msgspec.DecodeError``/``ValidationError`` for malformed bytes."""
        return self._to_worker.decode(data)
