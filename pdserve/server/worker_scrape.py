"""The workers' own Prometheus series on the API server's ``/metrics`` (``pdserve serve``).

A worker that serves ``/metrics`` (:mod:`pdserve.worker_metrics`) names it in its
registration (``RegisterWorker.metrics_address``). On each scrape of the API server, every
alive worker's endpoint is fetched at once; each of its samples gets a ``worker`` label (the
id the router knows it by), and its families are merged with the API server's own, so a
family both export (``pdserve:prompt_tokens``, ``pdserve:num_requests_running``, ...)
appears once: the server's samples (no ``role`` label) beside each worker's (``role``,
``worker_id``, ``worker``), as the dashboard already tells them apart.

Pull on scrape rather than workers pushing their series: the workers already render them
(the same collector Prometheus scrapes in compose and Kubernetes), nothing moves while no
one scrapes, the values are as fresh as the scrape, and the router's control socket and
event loop carry no bulk text (pushed with each heartbeat, every worker would send its
series to every router once a second). The price is one HTTP request per worker per scrape,
sent concurrently and bounded: a worker that does not answer within
:data:`WORKER_SCRAPE_TIMEOUT_S`, answers an error, more than :data:`MAX_WORKER_METRICS_BYTES`
or text that does not parse adds nothing, is counted in
``pdserve:worker_metrics_scrape_failures_total{worker}``, and the scrape goes on. One
fetch serves the scrapes of the next :data:`WORKER_SCRAPE_MIN_INTERVAL_S` (tests poll
``/metrics`` many times a second; Prometheus every few seconds).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Iterator

import httpx
from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

#: Longest wait for one worker's ``/metrics`` (connect, send and read, in all), seconds.
WORKER_SCRAPE_TIMEOUT_S = 1.0
#: One fetch of the workers serves the scrapes of this many seconds after it.
WORKER_SCRAPE_MIN_INTERVAL_S = 0.25
#: A worker's answer larger than this is dropped (a worker exports a few KiB).
MAX_WORKER_METRICS_BYTES = 1 << 20
#: The label naming the worker a merged sample came from.
WORKER_LABEL = "worker"
#: Family types whose ``<name>_created`` samples the text format exports as a gauge.
_HAS_CREATED = ("counter", "histogram", "summary")


class WorkerScrapeError(Exception):
    """One worker's ``/metrics`` could not be read (status, size or format)."""


async def fetch_worker_metrics(client: httpx.AsyncClient, url: str,
                               timeout_s: float = WORKER_SCRAPE_TIMEOUT_S) -> list[Metric]:
    """The metric families one worker serves at ``url``.

    Raises:
        WorkerScrapeError: no answer within ``timeout_s`` seconds, a status other than 200,
            more than :data:`MAX_WORKER_METRICS_BYTES`, or text that does not parse.
    """
    try:
        return await asyncio.wait_for(_read_families(client, url), timeout_s)
    except (asyncio.TimeoutError, httpx.HTTPError) as exc:
        raise WorkerScrapeError(f"{url}: {type(exc).__name__} {exc}".rstrip()) from None


async def _read_families(client: httpx.AsyncClient, url: str) -> list[Metric]:
    body = bytearray()
    async with client.stream("GET", url) as resp:
        if resp.status_code != 200:
            raise WorkerScrapeError(f"{url}: HTTP {resp.status_code}")
        async for chunk in resp.aiter_bytes():
            body += chunk
            if len(body) > MAX_WORKER_METRICS_BYTES:
                raise WorkerScrapeError(f"{url}: more than {MAX_WORKER_METRICS_BYTES} bytes")
    try:
        return list(text_string_to_metric_families(body.decode()))
    except (ValueError, UnicodeDecodeError) as exc:
        raise WorkerScrapeError(f"{url}: not the Prometheus text format ({exc})") from None


async def scrape_workers(client: httpx.AsyncClient, targets: dict[str, str],
                         timeout_s: float = WORKER_SCRAPE_TIMEOUT_S,
                         ) -> tuple[dict[str, list[Metric]], list[str]]:
    """Fetch every worker's families at once.

    Args:
        client: the HTTP client to fetch with.
        targets: worker id -> its ``/metrics`` URL.
        timeout_s: the wait for each (they run concurrently, so also about the total).

    Returns:
        ``(families by worker id, ids of the workers that failed)``.
    """
    ids = list(targets)
    results = await asyncio.gather(
        *(fetch_worker_metrics(client, targets[wid], timeout_s) for wid in ids),
        return_exceptions=True)
    families, failed = {}, []
    for wid, result in zip(ids, results):
        if isinstance(result, WorkerScrapeError):
            logger.debug("worker %s metrics: %s", wid, result)
            failed.append(wid)
        elif isinstance(result, BaseException):
            raise result
        else:
            families[wid] = result
    return families, failed


class WorkerMetricsScraper:
    """The API server's fetcher of its workers' families: one HTTP client (made in the
    serving loop on first use), and at most one fetch of each set of workers per
    ``min_interval_s``, shared by the scrapes that come meanwhile (a scraper polling
    ``/metrics`` in a tight loop must not keep the workers busy rendering).

    Args:
        on_failure: called with the id of each worker whose fetch failed.
        timeout_s: the wait for each worker.
        min_interval_s: how long one fetch serves later scrapes.
    """

    def __init__(self, on_failure: Callable[[str], None],
                 timeout_s: float = WORKER_SCRAPE_TIMEOUT_S,
                 min_interval_s: float = WORKER_SCRAPE_MIN_INTERVAL_S) -> None:
        self.on_failure = on_failure
        self.timeout_s = timeout_s
        self.min_interval_s = min_interval_s
        self._client: httpx.AsyncClient | None = None
        self._last: tuple[float, dict[str, str], dict[str, list[Metric]]] | None = None
        self._inflight: asyncio.Future | None = None

    async def families(self, targets: dict[str, str]) -> dict[str, list[Metric]]:
        """worker id -> its families, for the workers of ``targets`` (id -> URL) that
        answered (from a fetch at most ``min_interval_s`` old)."""
        last = self._last
        if last is not None and last[1] == targets and \
                time.monotonic() - last[0] < self.min_interval_s:
            return last[2]
        if self._inflight is None or self._inflight.done():
            self._inflight = asyncio.ensure_future(self._fetch(dict(targets)))
        return await asyncio.shield(self._inflight)

    async def _fetch(self, targets: dict[str, str]) -> dict[str, list[Metric]]:
        if not targets:
            return {}
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout_s, trust_env=False)
        families, failed = await scrape_workers(self._client, targets, self.timeout_s)
        for worker_id in failed:
            self.on_failure(worker_id)
        self._last = (time.monotonic(), targets, families)
        return families

    async def aclose(self) -> None:
        """Close the HTTP client (the app's shutdown)."""
        if self._client is not None:
            await self._client.aclose()
            self._client = None


class MergedFamilies:
    """A collector (anything with ``collect()``, as ``generate_latest`` takes) of the API
    server's families with the workers' merged in (see the module docstring).

    A worker family whose name the server exports with another type is left out (one
    name, one type); so is a worker sample that already has a ``worker`` label.

    Args:
        own: the API server's families.
        workers: worker id -> its families.
    """

    def __init__(self, own: Iterable[Metric], workers: dict[str, list[Metric]]) -> None:
        self.families: dict[str, Metric] = {}
        for family in own:
            self.families[family.name] = family
        for worker_id in sorted(workers):
            families = workers[worker_id]
            # the text format writes a counter's or histogram's ``_created`` samples as a
            # gauge family of their own, which the server's family writes again: leave
            # the worker's out (creation times of another process mean nothing here)
            created = {f"{f.name}_created" for f in [*families, *self.families.values()]
                       if f.type in _HAS_CREATED}
            for family in families:
                if family.name not in created:
                    self._add(worker_id, family)

    def _add(self, worker_id: str, family: Metric) -> None:
        merged = self.families.get(family.name)
        if merged is None:
            merged = self.families[family.name] = Metric(
                family.name, family.documentation, family.type, family.unit)
        elif merged.type != family.type:
            logger.debug("worker %s exports %s as a %s, the server as a %s; left out",
                         worker_id, family.name, family.type, merged.type)
            return
        for sample in family.samples:
            if WORKER_LABEL not in sample.labels:
                merged.samples.append(sample._replace(
                    labels={**sample.labels, WORKER_LABEL: worker_id}))

    def collect(self) -> Iterator[Metric]:
        """The merged families, the server's first in their order."""
        return iter(self.families.values())


def render_merged(own: Iterable[Metric], workers: dict[str, list[Metric]]) -> bytes:
    """The Prometheus text format of :class:`MergedFamilies` over ``own`` and ``workers``."""
    return generate_latest(MergedFamilies(own, workers))
