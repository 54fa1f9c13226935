"""Routing policies: where a new request's prompt is prefilled and which decode worker runs it.

A policy is a pure decision over the router's view of the cluster (:class:`ClusterView`):
no sockets, no state of its own, so it is tested with a registry built in memory. The
router asks it once per request (:meth:`RoutingPolicy.route`) and carries the request out.

:class:`ThresholdPolicy` is the length-threshold rule (the default): the least-loaded
accepting decode worker (ties to the one holding the longest cached prefix of the prompt)
runs the request; its prompt is prefilled by a prefill worker when at least
``prefill_threshold`` of its tokens are not cached there, else by the decode worker itself.
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
                len(request.prompt_token_ids) - cached < self.prefill_threshold:
            return Route(LOCAL, decode, cached)
        if workers.accepting("prefill") and decode.info.kv_address:
            return Route(REMOTE_PREFILL, decode, cached)
        return Route(FALLBACK, decode, cached)


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
