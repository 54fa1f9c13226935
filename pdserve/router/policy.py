"""Routing policies: where a new request's prompt is prefilled and which decode worker runs it.

A policy is a pure decision over the router's view of the cluster (:class:`ClusterView`):
no sockets, no state of its own, so it is tested with a registry built in memory. The
router asks it once per request (:meth:`RoutingPolicy.route`) and carries the request out.

:class:`ThresholdPolicy` is the length-threshold rule (the default): the least-loaded
accepting decode worker (ties to the one holding the longest cached prefix of the prompt)
runs the request; its prompt is prefilled by a prefill worker when at least
``prefill_threshold`` of its tokens are not cached there, else by the decode worker itself.

:class:`PredictedTTFTPolicy` needs no threshold: it predicts each path's time to first
token from the rates the workers measure and report, and weighs what a local prefill costs
the decode worker's running requests (see its docstring).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pdserve.router.registry import WorkerInfo

#: Route kinds: prefilled by the decode worker; by a prefill worker with the KV pushed to
#: the decode worker; long enough for a prefill worker but none is alive.
LOCAL, REMOTE_PREFILL, FALLBACK = "local", "remote_prefill", "fallback"


@dataclass(frozen=True)
class RouteRequest:
    """What a policy knows of a request.

    Attributes:
        request_id: for logs.
        prompt_token_ids: the prompt.
        wants_prompt_logprobs: the prompt must run through the model on the worker that
            reports its logprobs (a prefill worker reports only the first token).
    """

    request_id: str
    prompt_token_ids: list[int]
    wants_prompt_logprobs: bool = False


@dataclass(frozen=True)
class Route:
    """A policy's decision.

    Attributes:
        kind: :data:`LOCAL`, :data:`REMOTE_PREFILL` or :data:`FALLBACK`.
        decode: the decode worker that runs the request.
        num_cached_tokens: prompt tokens believed cached on ``decode``.
    """

    kind: str
    decode: WorkerInfo
    num_cached_tokens: int = 0
    #: for :data:`REMOTE_PREFILL`: the prefill worker the policy chose (None: the router
    #: takes the least-loaded one when the decode worker has reserved blocks)
    prefill: WorkerInfo | None = None


class ClusterView(Protocol):
    """The router's picture of the workers, as policies read it."""

    def accepting(self, role: str) -> list[WorkerInfo]:
        """Alive, not draining workers of ``role``."""
        ...

    def num_cached_tokens(self, worker: WorkerInfo, prompt_token_ids: list[int]) -> int:
        """Prompt tokens ``worker`` is believed to hold in its prefix cache."""
        ...


class RoutingPolicy(Protocol):
    """Chooses each request's route."""

    def route(self, request: RouteRequest, workers: ClusterView) -> Route | None:
        """The route for ``request``, or None when no decode worker accepts requests."""
        ...


@dataclass(frozen=True)
class ThresholdPolicy:
    """The length-threshold rule (see the module docstring).

    Args:
        prefill_threshold: uncached prompt tokens from which a prefill worker is used.

    Raises:
        ValueError: ``prefill_threshold < 1``.
    """

    prefill_threshold: int = 512

    def __post_init__(self) -> None:
        if self.prefill_threshold < 1:
            raise ValueError(f"prefill_threshold must be >= 1, got {self.prefill_threshold}")

    def route(self, request: RouteRequest, workers: ClusterView) -> Route | None:
        """``local`` below the threshold of uncached tokens (or with prompt logprobs),
        else ``remote_prefill``, or ``fallback`` with no prefill worker; None when no
        decode worker accepts."""
        decode, cached = choose_decode(request.prompt_token_ids, workers)
        if decode is None:
            return None
        if request.wants_prompt_logprobs or \
                self.counted_tokens(request, cached) < self.prefill_threshold:
            return Route(LOCAL, decode, cached)
        if workers.accepting("prefill") and decode.info.kv_address:
            return Route(REMOTE_PREFILL, decode, cached)
        return Route(FALLBACK, decode, cached)

    def counted_tokens(self, request: RouteRequest, num_cached: int) -> int:
        """The prompt tokens compared with the threshold: those not cached on D."""
        return len(request.prompt_token_ids) - num_cached


@dataclass(frozen=True)
class LengthPolicy(ThresholdPolicy):
    """The rule of a plain disaggregation proxy: a prompt of at least
    ``prefill_threshold`` tokens is prefilled by a prefill worker whatever the decode
    worker holds cached (so a chat's long history is prefilled again every turn). The
    router's rule before it counted cached tokens; kept as a baseline.

    Raises:
        ValueError: ``prefill_threshold < 1``.
    """

    def counted_tokens(self, request: RouteRequest, num_cached: int) -> int:
        """The whole prompt."""
        return len(request.prompt_token_ids)


def choose_decode(prompt_token_ids: list[int], workers: ClusterView,
                  ) -> tuple[WorkerInfo | None, int]:
    """The least-loaded accepting decode worker, ties going to the longest cached prefix,
    and the prompt tokens it is believed to hold (``(None, 0)`` when none accepts)."""
    best, best_key = None, None
    for worker in workers.accepting("decode"):
        cached = workers.num_cached_tokens(worker, prompt_token_ids)
        key = (worker.load_score, -cached)
        if best_key is None or key < best_key:
            best, best_key = worker, key
    return best, (0 if best_key is None else -best_key[1])


@dataclass(frozen=True)
class PathEstimate:
    """One path's predicted cost for a prompt (seconds).

    Attributes:
        ttft_s: until the prompt's first token: the worker's queued prefill tokens plus
            this prompt's, at its measured rate (plus, remote, the measured handshake
            overhead and pushing the KV at the measured link rate, an upper bound since
            layers are pushed while later ones are prefilled).
        stall_s: what this prefill, ``T`` seconds on its worker, adds to others' waits:
            each request the worker holds waits ``T`` (on a decode worker), and the
            prompts expected to arrive at it during ``T`` (its measured arrival rate
            ``lam`` times ``T``) wait ``T / 2`` on average: ``lam * T**2 / 2``. Without
            the arrivals, a long prompt kept on an idle-looking decode worker held up the
            short ones arriving behind it (short P99 TTFT 4.5x the threshold policy's,
            ``bench/routing_compare.py``, 2026-12-02g).
        worker: who prefills.
    """

    ttft_s: float
    stall_s: float
    worker: WorkerInfo

    @property
    def cost_s(self) -> float:
        """What the policy minimizes: the request's wait plus the others' added waits."""
        return self.ttft_s + self.stall_s


def arrivals_stall_s(worker: WorkerInfo, prefill_s: float) -> float:
    """Summed expected wait of the prompts arriving at ``worker`` during a prefill of
    ``prefill_s`` seconds (Poisson arrivals at its measured rate, each waiting for the rest
    of the prefill: half of it on average)."""
    return worker.arrival_rate() * prefill_s * prefill_s / 2


def local_estimate(decode: WorkerInfo, num_uncached: int) -> PathEstimate | None:
    """The decode worker prefills ``num_uncached`` tokens itself; None while its prefill
    rate is unknown. Every request it holds (the router's count, which is ahead of its
    heartbeat) waits for the prefill."""
    rate = decode.prefill_tokens_per_s
    if rate <= 0:
        return None
    prefill_s = num_uncached / rate
    return PathEstimate(decode.num_prefill_tokens_queued / rate + prefill_s,
                        decode.load_score * prefill_s + arrivals_stall_s(decode, prefill_s),
                        decode)


def remote_estimate(prefill: WorkerInfo, num_tokens: int) -> PathEstimate | None:
    """``prefill`` prefills all ``num_tokens`` and pushes their KV; None while its prefill
    rate is unknown (an unknown link rate counts as free until the first transfer)."""
    rate = prefill.prefill_tokens_per_s
    if rate <= 0:
        return None
    transfer_s = 0.0
    if prefill.kv_bytes_per_s > 0:
        transfer_s = num_tokens * prefill.kv_bytes_per_token / prefill.kv_bytes_per_s
    prefill_s = num_tokens / rate
    return PathEstimate(prefill.num_prefill_tokens_queued / rate + prefill_s + transfer_s
                        + prefill.remote_overhead_s, arrivals_stall_s(prefill, prefill_s),
                        prefill)


@dataclass(frozen=True)
class PredictedTTFTPolicy(ThresholdPolicy):
    """Route each prompt by predicted cost instead of a fixed length.

    The least-loaded decode worker D (as :func:`choose_decode`) runs the request either
    way. Local: D prefills the prompt's tokens it does not hold cached, behind its queued
    prefill tokens, at its measured rate, and the requests it holds wait that long, as do
    the prompts expected to arrive meanwhile. Remote: the prefill worker with the cheapest
    estimate prefills the whole prompt behind its own queue, at its rate, and pushes the
    KV; the prompts expected to arrive there meanwhile wait. The cheaper
    :attr:`PathEstimate.cost_s` wins,
    local on a tie. Rates and queues come from the workers' heartbeats (moving averages of
    measured steps) and the router's own count of what it sent since; a long follow-up
    turn whose history D holds stays local because only uncached tokens count.

    Prompts with fewer uncached tokens than ``prefill_threshold`` stay local: the cost
    only decides whether a long prompt goes remote or stays on D. Measured, letting the
    cost send short prompts to an idle-looking prefill worker doubled their P99 TTFT
    (``bench/routing_compare.py``: a short prompt gains little from a faster prefill and
    loses much when a long one lands on the prefill worker's queue ahead of its KV push).
    While D's or every prefill worker's rate is unknown (no prefill measured yet), and for
    requests that must stay local (prompt logprobs) or cannot go remote (no prefill
    worker, D takes no pushed KV), it routes as :class:`ThresholdPolicy` at
    ``prefill_threshold``.

    Raises:
        ValueError: ``prefill_threshold < 1``.
    """

    def route(self, request: RouteRequest, workers: ClusterView) -> Route | None:
        """The cheaper of the local and remote paths (see the class docstring)."""
        fallback = super().route(request, workers)
        if fallback is None or fallback.kind == LOCAL or not fallback.decode.info.kv_address:
            return fallback
        decode, cached = fallback.decode, fallback.num_cached_tokens
        num_tokens = len(request.prompt_token_ids)
        local = local_estimate(decode, num_tokens - cached)
        remotes = [e for p in workers.accepting("prefill")
                   if (e := remote_estimate(p, num_tokens)) is not None]
        if local is None or not remotes:
            return fallback
        remote = min(remotes, key=lambda e: e.cost_s)
        if local.cost_s <= remote.cost_s:
            return Route(LOCAL, decode, cached)
        return Route(REMOTE_PREFILL, decode, cached, prefill=remote.worker)


#: ``--routing`` choices -> policy class (each takes ``prefill_threshold``)
POLICIES: dict[str, type] = {"threshold": ThresholdPolicy, "predicted": PredictedTTFTPolicy,
                             "length": LengthPolicy}
