"""Prometheus series of one worker process (``pdserve decode-worker|prefill-worker
--metrics-port N``), served by a small HTTP server on its own thread.

Every value is read from the worker when ``/metrics`` is scraped (plain counters and the
same load snapshot the heartbeats carry), so the engine loop does no metrics work at all.
Series carry ``model_name``, ``worker_id`` and ``role`` labels; names and suffixes follow
the API server's (``pdserve:num_requests_running``, ``pdserve:prompt_tokens_total``, ...),
so a dashboard tells the two apart by the ``role`` label, which only workers set.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from pdserve.messages import Heartbeat

#: ``--metrics-host`` values that bind every interface (not an address to connect to).
WILDCARD_HOSTS = ("", "0.0.0.0", "::")
MAX_METRICS_CONNECTIONS = 16  # served at once; more are closed unanswered
METRICS_IDLE_TIMEOUT_S = 5.0  # a connection silent this long (one read) is closed


@dataclass(frozen=True)
class KVTransferTotals:
    """Cumulative KV-transfer counters of one worker (zero where a role does not transfer).

    Attributes:
        num_bytes_sent: payload + scale bytes pushed to decode workers.
        num_bytes_received: payload + scale bytes received from prefill workers.
        num_transfers_sent: requests whose KV was pushed successfully.
        num_transfers_failed: pushes that failed.
        num_refused_connections: connections to this worker's KV port refused for want of
            the cluster's key (CURVE; see :mod:`pdserve.security`).
        num_dropped_kv_messages: KV messages dropped unread (no reservation for their
            request, or larger than it).
    """

    num_bytes_sent: int = 0
    num_bytes_received: int = 0
    num_transfers_sent: int = 0
    num_transfers_failed: int = 0
    num_refused_connections: int = 0
    num_dropped_kv_messages: int = 0


class WorkerCollector:
    """A prometheus_client collector over an :class:`~pdserve.worker_base.EngineWorker`."""

    def __init__(self, worker) -> None:
        self.worker = worker
        self.label_names = ["model_name", "worker_id", "role"]
        self.label_values = [worker.model_name, worker.worker_id, worker.role]

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=self.label_names)
        g.add_metric(self.label_values, value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=self.label_names)
        c.add_metric(self.label_values, value)
        return c

    def collect(self) -> Iterator[Metric]:
        """One family per series, read from the worker now (called on each scrape)."""
        load = self.worker.load()
        kv = self.worker.kv_transfer_totals()
        yield from self._engine_series(load)
        yield from self._kv_transfer_series(kv)
        yield from self._spec_decode_series(load)
        yield from self._structured_output_series()

    def _engine_series(self, load: Heartbeat) -> Iterator[Metric]:
        """Registration, the scheduler's queues, the KV cache, token counts and the prefix
        cache: the series the API server also has."""
        w = self.worker
        yield self._gauge("pdserve:worker_registered", "1 once the router acknowledged this "
                          "worker's registration.", float(w.is_registered))
        yield self._gauge("pdserve:num_requests_running", "Requests in model execution "
                          "batches.", load.num_running)
        yield self._gauge("pdserve:num_requests_waiting", "Requests waiting to be processed.",
                          load.num_waiting)
        yield self._gauge("pdserve:kv_cache_usage_perc", "KV-cache usage. 1 means 100 "
                          "percent usage.", load.kv_cache_usage)
        yield self._gauge("pdserve:num_free_kv_blocks", "Free KV-cache blocks.",
                          load.num_free_blocks)
        yield self._counter("pdserve:prompt_tokens", "Prompt tokens this worker prefilled "
                            "(cache hits and KV received from a prefill worker excluded).",
                            w.engine.prefill_stats.num_prefill_tokens_computed)
        yield self._counter("pdserve:generation_tokens", "Number of generation tokens "
                            "processed.", w.engine.num_generation_tokens)
        yield self._counter("pdserve:num_preemptions", "Cumulative number of preemptions.",
                            load.num_preemptions)
        yield self._counter("pdserve:prefix_cache_queries", "Prompt tokens looked up in the "
                            "prefix cache.", load.num_prefix_queried_tokens)
        yield self._counter("pdserve:prefix_cache_hits", "Prompt tokens found in the prefix "
                            "cache.", load.num_prefix_hit_tokens)
        yield self._counter("pdserve:worker_requests_finished", "Requests this worker "
                            "finished (prefills, for a prefill worker).",
                            load.num_requests_served)

    def _kv_transfer_series(self, kv: KVTransferTotals) -> Iterator[Metric]:
        """Bytes and transfers pushed or received, failures, refused connections and
        dropped messages (zero where the role does not transfer)."""
        yield self._counter("pdserve:kv_transfer_bytes_sent", "KV bytes pushed to decode "
                            "workers.", kv.num_bytes_sent)
        yield self._counter("pdserve:kv_transfer_bytes_received", "KV bytes received from "
                            "prefill workers.", kv.num_bytes_received)
        yield self._counter("pdserve:kv_transfers_sent", "Requests whose KV was pushed.",
                            kv.num_transfers_sent)
        yield self._counter("pdserve:kv_transfers_failed", "KV pushes that failed.",
                            kv.num_transfers_failed)
        yield self._counter("pdserve:refused_connections", "Connections to this worker's "
                            "KV port refused: no or the wrong cluster key.",
                            kv.num_refused_connections)
        yield self._counter("pdserve:kv_messages_dropped", "KV messages dropped unread: no "
                            "blocks reserved for their request, or larger than that.",
                            kv.num_dropped_kv_messages)

    def _spec_decode_series(self, load: Heartbeat) -> Iterator[Metric]:
        """Drafts and draft tokens verified and accepted, the accepted ones also by draft
        position (one ``position`` label per position)."""
        yield self._counter("pdserve:spec_decode_num_drafts", "Speculative drafts verified.",
                            load.num_spec_drafts)
        yield self._counter("pdserve:spec_decode_num_draft_tokens", "Draft tokens verified.",
                            load.num_spec_draft_tokens)
        yield self._counter("pdserve:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                            load.num_spec_accepted_tokens)
        per_pos = CounterMetricFamily(
            "pdserve:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by draft position (0 = first draft token).",
            labels=self.label_names + ["position"])
        for pos, count in enumerate(load.num_spec_accepted_tokens_per_pos):
            per_pos.add_metric(self.label_values + [str(pos)], count)
        yield per_pos

    def _structured_output_series(self) -> Iterator[Metric]:
        """Time and steps spent on grammar masks, and constrained requests by kind."""
        grammar = self.worker.engine.structured_output
        yield self._counter("pdserve:grammar_mask_seconds", "Time spent filling grammar "
                            "token masks (structured outputs), in seconds.", grammar.mask_s)
        yield self._counter("pdserve:grammar_mask_steps", "Engine steps that filled grammar "
                            "token masks.", grammar.num_mask_steps)
        by_kind = CounterMetricFamily(
            "pdserve:structured_output_requests",
            "Constrained requests admitted, by kind (json, regex, choice, ...).",
            labels=self.label_names + ["kind"])
        for kind, count in sorted(grammar.num_requests_by_kind.items()):
            by_kind.add_metric(self.label_values + [kind], count)
        yield by_kind


class _QuietHandler(WSGIRequestHandler):
    timeout = METRICS_IDLE_TIMEOUT_S  # socketserver sets it on each connection

    def log_message(self, format, *args) -> None:  # noqa: A002 (the base class's name)
        pass


class BoundedMetricsHTTPServer(ThreadingMixIn, WSGIServer):
    """prometheus-client's exposition (``make_wsgi_app``) on a thread-per-connection WSGI
    server that holds at most ``MAX_METRICS_CONNECTIONS`` connections, each closed after
    ``METRICS_IDLE_TIMEOUT_S`` without data (prometheus-client's own ``start_http_server``
    kept a thread for every idle connection: ~1,000 threads from one client).

    Args:
        registry: what ``/metrics`` (any path) exposes.
        host: address to bind (IPv4 or IPv6).
        port: TCP port (0: a free one, see ``server_port``).

    Raises:
        OSError: the address cannot be bound.
    """

    daemon_threads = True

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self.address_family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                 flags=socket.AI_PASSIVE)[0][0]
        self._slots = threading.BoundedSemaphore(MAX_METRICS_CONNECTIONS)
        super().__init__((host, port), _QuietHandler)
        self.set_app(make_wsgi_app(registry))
        self.thread = threading.Thread(target=self.serve_forever, name="metrics-http",
                                       daemon=True)
        self.thread.start()

    def process_request(self, request, client_address) -> None:
        """Serve ``request`` on a thread of its own, or close it at once when
        ``MAX_METRICS_CONNECTIONS`` are being served (socketserver's hook)."""
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # over the limit: closed unanswered
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: it will not release the slot
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        """Serve ``request`` (on its thread), then give its connection slot back."""
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def close(self) -> None:
        """Stop serving and release the port."""
        self.shutdown()
        self.server_close()
        self.thread.join(timeout=2.0)


class WorkerMetricsServer:
    """``/metrics`` of one worker on ``host:port`` (any path answers with the metrics).

    Args:
        worker: the worker to report on.
        host: address to bind.
        port: TCP port (1..65535; 0: a free one, see :attr:`port`).

    Raises:
        OSError: the port cannot be bound.
    """

    def __init__(self, worker, host: str, port: int) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(WorkerCollector(worker))
        self._httpd = BoundedMetricsHTTPServer(self.registry, host, port)
        self.port = self._httpd.server_port
        #: the address to give the router: ``host`` as bound, or this machine's name when
        #: bound to every interface (``0.0.0.0``, ``::``)
        advertised = socket.gethostname() if host in WILDCARD_HOSTS else host
        if ":" in advertised:
            advertised = f"[{advertised}]"
        self.url = f"http://{advertised}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and release the port."""
        self._httpd.close()
