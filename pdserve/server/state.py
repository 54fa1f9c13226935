"""What the API server's handlers share: router, tokenizer, metrics, limits."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cached_property

from pdserve.router.router import Router
from pdserve.server.metrics import ServerMetrics
from pdserve.server.worker_scrape import WorkerMetricsScraper


@dataclass
class ServerState:
    """Shared by all handlers of one app.

    Attributes:
        router: places requests on workers.
        tokenizer: the served model's transformers tokenizer.
        model_name: the served model name clients must send.
        default_max_model_len: longest prompt + output accepted before any worker registers;
            afterwards the smallest ``max_model_len`` of the alive workers.
        metrics: the Prometheus series.
        api_key: bearer token required on /v1 routes, or None.
        max_n: most choices per request.
        tool_parser: name of the tool-call parser (``pdserve.server.tools.parsers``).
        draining: set on SIGTERM: new requests get 503 with ``Retry-After``, in-flight ones
            finish (see :func:`pdserve.launcher.DrainingServer`).
        scrape_worker_metrics: ``/metrics`` adds the series of every worker that registered
            its own endpoint (:mod:`pdserve.server.worker_scrape`).
        worker_scraper: what fetches them, made on the first scrape that needs it.
        num_workers_expected: workers ``serve`` started: ``/health`` answers 503 until
            that many have registered (then a long prompt finds its prefill worker).
        listen_when_ready: the socket shares its port (``--reuse-port``): start listening
            only once a decode worker accepts on this router (see
            :func:`pdserve.front_doors.wait_for_decode_worker`).
    """

    router: Router
    tokenizer: object
    model_name: str
    default_max_model_len: int
    metrics: ServerMetrics
    api_key: str | None = None
    max_n: int = 16
    tool_parser: str = "hermes"
    draining: bool = False
    scrape_worker_metrics: bool = False
    worker_scraper: WorkerMetricsScraper | None = None
    num_workers_expected: int = 0
    listen_when_ready: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    system_fingerprint: str = "pdserve-0.1.0"

    @property
    def max_model_len(self) -> int:
        """Longest prompt + output accepted now: the smallest ``max_model_len`` of the
        alive workers, or ``default_max_model_len`` while none is alive."""
        workers = self.router.alive_workers()
        if workers:
            return min(w.info.max_model_len for w in workers)
        return self.default_max_model_len

    @cached_property
    def max_token_chars(self) -> int:
        """Most characters one token of the vocabulary stands for (its longest piece, in
        the tokenizer's own spelling: a byte-level piece has a character per byte); times
        4 when the tokenizer normalizes text (a normalizer may join characters). A text of
        ``c`` characters is at least ``c / max_token_chars`` tokens."""
        longest = max(map(len, self.tokenizer.get_vocab()), default=1)
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        return longest * (1 if backend is not None and backend.normalizer is None else 4)
