"""Prometheus series of the API server (``pdserve:*``), with vLLM's suffixes and meanings.

One :class:`ServerMetrics` per app, on its own ``CollectorRegistry`` (no global state).
Load gauges are filled from the workers' heartbeats when ``/metrics`` is scraped.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                      2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS_S = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                  50.0, 60.0, 120.0, 240.0, 480.0)
#: Router event-loop lag: from a millisecond (idle) to seconds (a loop starved by a burst).
_LOOP_LAG_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                       5.0, 10.0, 30.0)
#: The label every series carries; some add their own after it.
_MODEL_LABEL = ("model_name",)


class ServerMetrics:
    """All series, labelled by ``model_name``.

    Args:
        model_name: the served model name (label value).
    """

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        # NOTE: series are exported in the order they are created here.
        self._add_load_series()
        self._add_request_series()
        self._add_router_series()
        self._add_spec_decode_series()
        self._add_output_format_series()
        #: worker id -> the cumulative spec-decode counters last added from its heartbeats
        self._spec_seen: dict[str, tuple[int, int, int, list[int]]] = {}
        self._add_worker_series()

    def _add_load_series(self) -> None:
        """Load gauges of the decode workers, set by :meth:`set_load` on each scrape."""
        r, lbl = self.registry, _MODEL_LABEL
        self.num_requests_running = Gauge(
            "pdserve:num_requests_running", "Requests in model execution batches.", lbl,
            registry=r)
        self.num_requests_waiting = Gauge(
            "pdserve:num_requests_waiting", "Requests waiting to be processed.", lbl, registry=r)
        self.kv_cache_usage_perc = Gauge(
            "pdserve:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", lbl,
            registry=r)

    def _add_request_series(self) -> None:
        """Token counts, outcomes and latencies (TTFT, ITL, end to end, queueing) of
        requests, recorded by the server's generations."""
        r, lbl = self.registry, _MODEL_LABEL
        self.prompt_tokens = Counter(
            "pdserve:prompt_tokens", "Number of prefill tokens processed.", lbl, registry=r)
        self.generation_tokens = Counter(
            "pdserve:generation_tokens", "Number of generation tokens processed.", lbl,
            registry=r)
        self.request_success = Counter(
            "pdserve:request_success", "Count of successfully processed requests.",
            lbl + ("finished_reason",), registry=r)
        self.time_to_first_token = Histogram(
            "pdserve:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            lbl, buckets=_LATENCY_BUCKETS_S, registry=r)
        self.inter_token_latency = Histogram(
            "pdserve:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            lbl, buckets=_LATENCY_BUCKETS_S, registry=r)
        self.e2e_request_latency = Histogram(
            "pdserve:e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds.", lbl, buckets=_E2E_BUCKETS_S,
            registry=r)
        self.request_queue_time = Histogram(
            "pdserve:request_queue_time_seconds",
            "Histogram of time spent waiting for a worker slot, in seconds.", lbl,
            buckets=_E2E_BUCKETS_S, registry=r)

    def _add_router_series(self) -> None:
        """What the router records by series name: routing decisions, KV transfers between
        prefill and decode workers, refused connections, dropped messages, deadlines, loop
        restarts and lag, retries and migrations, and prefill times."""
        r, lbl = self.registry, _MODEL_LABEL
        self.route_decisions = Counter(
            "pdserve:route_decisions",
            "Routing decisions (local, remote_prefill, fallback), one per choice (n > 1 counts "
            "each).",
            lbl + ("route",), registry=r)
        self.kv_transfer_bytes = Counter(
            "pdserve:kv_transfer_bytes", "KV bytes pushed from prefill to decode workers.", lbl,
            registry=r)
        self.kv_transfer_seconds = Histogram(
            "pdserve:kv_transfer_seconds", "Time to push one request's KV, in seconds.", lbl,
            buckets=_LATENCY_BUCKETS_S, registry=r)
        self.kv_transfer_failures = Counter(
            "pdserve:kv_transfer_failures", "Failed KV transfers by reason.", lbl + ("reason",),
            registry=r)
        self.refused_connections = Counter(
            "pdserve:refused_connections", "Connections to the router refused: no or the "
            "wrong cluster key (reason: unknown_key, handshake_failed).", lbl + ("reason",),
            registry=r)
        self.dropped_messages = Counter(
            "pdserve:dropped_messages", "Messages the router dropped (reason: frames, "
            "malformed, impostor, unregistered, not_its_request).", lbl + ("reason",),
            registry=r)
        self.request_timeouts = Counter(
            "pdserve:request_timeouts", "Requests ended by a deadline (kind: first_token, "
            "reserve).", lbl + ("kind",), registry=r)
        for kind in ("first_token", "reserve"):  # exported at 0 before the first
            self.request_timeouts.labels(self.model_name, kind)
        self.router_loop_restarts = Counter(
            "pdserve:router_loop_restarts", "Router loops restarted after a failure.",
            lbl + ("loop",), registry=r)
        self.request_retries = Counter(
            "pdserve:request_retries", "Requests re-placed after their decode worker died.",
            lbl, registry=r)
        self.request_retries.labels(self.model_name)  # exported at 0 before the first
        self.request_migrations = Counter(
            "pdserve:request_migrations", "Migrations of requests to another decode worker "
            "after theirs died (one request may migrate several times).", lbl, registry=r)
        self.request_migrations.labels(self.model_name)  # exported at 0 before the first
        self.router_loop_lag = Histogram(
            "pdserve:router_loop_lag_seconds", "How late the router's event loop woke from "
            "its liveness timer, in seconds (the API server's loop was busy).", lbl,
            buckets=_LOOP_LAG_BUCKETS_S, registry=r)
        self.request_prefill_time = Histogram(
            "pdserve:request_prefill_time_seconds",
            "Time from a prefill worker taking a request to its first token, in seconds.", lbl,
            buckets=_LATENCY_BUCKETS_S, registry=r)

    def _add_spec_decode_series(self) -> None:
        """Speculative decoding counters, added from the decode workers' heartbeats by
        :meth:`add_spec_decode_counts`; exported at 0 before the first draft."""
        r, lbl = self.registry, _MODEL_LABEL
        self.spec_decode_num_drafts = Counter(
            "pdserve:spec_decode_num_drafts", "Speculative drafts verified (one per request "
            "per step that proposed at least one token).", lbl, registry=r)
        self.spec_decode_num_draft_tokens = Counter(
            "pdserve:spec_decode_num_draft_tokens", "Draft tokens proposed and verified.", lbl,
            registry=r)
        self.spec_decode_num_accepted_tokens = Counter(
            "pdserve:spec_decode_num_accepted_tokens", "Draft tokens accepted by verification.",
            lbl, registry=r)
        self.spec_decode_num_accepted_tokens_per_pos = Counter(
            "pdserve:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by draft position (0 = first draft token).",
            lbl + ("position",), registry=r)
        for c in (self.spec_decode_num_drafts, self.spec_decode_num_draft_tokens,
                  self.spec_decode_num_accepted_tokens):
            c.labels(self.model_name)

    def _add_output_format_series(self) -> None:
        """Requests with output constraints or tools, and the tool calls parsed from their
        outputs (the parse counters are exported at 0 before the first call)."""
        r, lbl = self.registry, _MODEL_LABEL
        self.structured_output_requests = Counter(
            "pdserve:structured_output_requests",
            "Requests with an output constraint, by kind (json, json_object, regex, choice, "
            "grammar, structural_tag).", lbl + ("kind",), registry=r)
        self.tool_requests = Counter(
            "pdserve:tool_requests", "Chat requests with tools, by tool_choice (auto, "
            "required, named).", lbl + ("tool_choice",), registry=r)
        self.tool_calls_parsed = Counter(
            "pdserve:tool_calls_parsed", "Tool calls parsed from model outputs.", lbl,
            registry=r)
        self.tool_call_parse_failures = Counter(
            "pdserve:tool_call_parse_failures", "Tool-call blocks in model outputs that did "
            "not parse (left as text).", lbl, registry=r)
        for c in (self.tool_calls_parsed, self.tool_call_parse_failures):
            c.labels(self.model_name)

    def _add_worker_series(self) -> None:
        """Per-worker gauges (labelled also by ``worker_id`` and ``role``), rebuilt from the
        alive workers by :meth:`set_worker_load` on every scrape; and the restarts of
        ``pdserve serve``'s workers by role (:meth:`observe_worker_restart`)."""
        r, wl = self.registry, _MODEL_LABEL + ("worker_id", "role")
        self.worker_restarts = Counter(
            "pdserve:worker_restarts", "Workers that exited and were started again by "
            "pdserve serve, by role.", _MODEL_LABEL + ("role",), registry=r)
        for role in ("decode", "prefill"):  # exported at 0 (a server without a supervisor
            self.worker_restarts.labels(self.model_name, role)  # restarts nothing)
        self.worker_up = Gauge("pdserve:worker_up", "1 while a worker is alive.", wl, registry=r)
        self.worker_num_requests_running = Gauge(
            "pdserve:worker_num_requests_running", "Requests running on each worker.", wl,
            registry=r)
        self.worker_kv_cache_usage_perc = Gauge(
            "pdserve:worker_kv_cache_usage_perc", "KV-cache usage of each worker.", wl,
            registry=r)
        self.worker_requests_served = Gauge(
            "pdserve:worker_requests_served", "Requests each worker reports it finished "
            "(prefills for prefill workers).", wl, registry=r)
        self.worker_metrics_scrape_failures = Counter(
            "pdserve:worker_metrics_scrape_failures", "Fetches of a worker's own /metrics "
            "that failed (no answer in time, an error status, unreadable); its series are "
            "missing from that scrape.", _MODEL_LABEL + ("worker",), registry=r)

    def set_worker_load(self, workers) -> None:
        """Per-worker gauges from the registry's alive workers (``WorkerInfo`` objects)."""
        m = self.model_name
        for g in (self.worker_up, self.worker_num_requests_running,
                  self.worker_kv_cache_usage_perc, self.worker_requests_served):
            g.clear()
        for w in workers:
            key = (m, w.worker_id, w.info.role)
            self.worker_up.labels(*key).set(1)
            if w.load is not None:
                self.worker_num_requests_running.labels(*key).set(w.load.num_running)
                self.worker_kv_cache_usage_perc.labels(*key).set(w.load.kv_cache_usage)
                self.worker_requests_served.labels(*key).set(w.load.num_requests_served)

    def observe_worker_scrape_failure(self, worker_id: str) -> None:
        """Count one failed fetch of the ``/metrics`` of worker ``worker_id``."""
        self.worker_metrics_scrape_failures.labels(self.model_name, worker_id).inc()

    def observe_worker_restart(self, role: str) -> None:
        """Count one restart of a worker of ``role`` ("decode" / "prefill")."""
        self.worker_restarts.labels(self.model_name, role).inc()

    def add_spec_decode_counts(self, workers) -> None:
        """Add what each worker's cumulative spec-decode counters grew by since last time.

        A worker whose counters went down restarted; its counts start again from zero.
        """
        m = self.model_name
        for w in workers:
            lo = w.load
            if lo is None or w.info.role != "decode":
                continue
            now = (lo.num_spec_drafts, lo.num_spec_draft_tokens, lo.num_spec_accepted_tokens,
                   list(lo.num_spec_accepted_tokens_per_pos))
            before = self._spec_seen.get(w.worker_id, (0, 0, 0, []))
            if now[0] < before[0]:
                before = (0, 0, 0, [])
            self._spec_seen[w.worker_id] = now
            for counter, new, old in ((self.spec_decode_num_drafts, now[0], before[0]),
                                      (self.spec_decode_num_draft_tokens, now[1], before[1]),
                                      (self.spec_decode_num_accepted_tokens, now[2], before[2])):
                if new > old:
                    counter.labels(m).inc(new - old)
            for pos, new in enumerate(now[3]):
                old = before[3][pos] if pos < len(before[3]) else 0
                if new > old:
                    self.spec_decode_num_accepted_tokens_per_pos.labels(m, str(pos)).inc(new - old)

    def observe_structured_output(self, kind: str) -> None:
        """Count one request constrained by a grammar of ``kind``."""
        self.structured_output_requests.labels(self.model_name, kind).inc()

    def observe_tool_request(self, tool_choice: str) -> None:
        """Count one chat request offering tools (``tool_choice`` auto/required/named)."""
        self.tool_requests.labels(self.model_name, tool_choice).inc()

    def observe_tool_parse(self, num_calls: int, num_failed: int) -> None:
        """Count the calls parsed from one choice's output and the blocks that failed."""
        if num_calls:
            self.tool_calls_parsed.labels(self.model_name).inc(num_calls)
        if num_failed:
            self.tool_call_parse_failures.labels(self.model_name).inc(num_failed)

    def set_load(self, num_running: int, num_waiting: int, kv_cache_usage: float) -> None:
        """Set the load gauges; ``/metrics`` passes the decode workers' summed running
        and waiting requests and their highest KV-cache usage (a fraction in [0, 1])."""
        m = self.model_name
        self.num_requests_running.labels(m).set(num_running)
        self.num_requests_waiting.labels(m).set(num_waiting)
        self.kv_cache_usage_perc.labels(m).set(kv_cache_usage)

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
