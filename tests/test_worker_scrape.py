"""The API server's merge of the workers' own /metrics (pdserve/server/worker_scrape.py),
against real HTTP endpoints on loopback: a worker exporting a real prometheus_client
registry, one that accepts the connection and never answers, a closed port, one answering
an error and one answering too much."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from pdserve.server.worker_scrape import (
    MAX_WORKER_METRICS_BYTES,
    WORKER_LABEL,
    WorkerMetricsScraper,
    render_merged,
    scrape_workers,
)
from server_utils import free_port

TIMEOUT_S = 0.5


def worker_registry(worker_id: str, prompt_tokens: float) -> CollectorRegistry:
    """Series named and labelled as a worker's (pdserve/worker_metrics.py)."""
    reg = CollectorRegistry()
    labels = ("model_name", "worker_id", "role")
    c = Counter("pdserve:prompt_tokens", "Prompt tokens this worker prefilled.", labels,
                registry=reg)
    c.labels("m", worker_id, "decode").inc(prompt_tokens)
    Gauge("pdserve:num_free_kv_blocks", "Free KV-cache blocks.", labels,
          registry=reg).labels("m", worker_id, "decode").set(7)
    # a name the server exports as a counter, exported here as a gauge
    Gauge("pdserve:route_decisions", "conflicting type", labels,
          registry=reg).labels("m", worker_id, "decode").set(1)
    return reg


def server_registry() -> CollectorRegistry:
    reg = CollectorRegistry()
    Counter("pdserve:prompt_tokens", "Number of prefill tokens processed.", ("model_name",),
            registry=reg).labels("m").inc(100)
    Counter("pdserve:route_decisions", "Routing decisions.", ("model_name", "route"),
            registry=reg).labels("m", "local").inc(3)
    return reg


class _Answer(BaseHTTPRequestHandler):
    status, body = 200, b""

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(self.status)
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):  # quiet
        pass


def answering(status: int, body: bytes) -> ThreadingHTTPServer:
    handler = type("Handler", (_Answer,), {"status": status, "body": body})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


@pytest.fixture
def endpoints():
    """worker id -> URL: two real workers and four broken ones."""
    good = {}
    servers = []
    for wid, n in (("decode-0", 11), ("prefill-0", 29)):
        httpd, _ = start_http_server(0, addr="127.0.0.1", registry=worker_registry(wid, n))
        servers.append(httpd)
        good[wid] = f"http://127.0.0.1:{httpd.server_port}/metrics"
    silent = socket.socket()  # accepts (backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    error = answering(500, b"boom")
    huge = answering(200, b"# " + b"x" * (MAX_WORKER_METRICS_BYTES + 10) + b"\n")
    garbage = answering(200, b"pdserve:x{unclosed 1\n")
    servers += [error, huge, garbage]
    urls = dict(good)
    urls.update({
        "hung": f"http://127.0.0.1:{silent.getsockname()[1]}/metrics",
        "dead": f"http://127.0.0.1:{free_port()}/metrics",
        "error": f"http://127.0.0.1:{error.server_port}/metrics",
        "huge": f"http://127.0.0.1:{huge.server_port}/metrics",
        "garbage": f"http://127.0.0.1:{garbage.server_port}/metrics",
    })
    yield urls
    silent.close()
    for httpd in servers:
        httpd.shutdown()
        httpd.server_close()


def scrape(targets: dict[str, str]):
    async def run():
        async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
            return await scrape_workers(client, targets, TIMEOUT_S)
    return asyncio.run(run())


def test_broken_workers_fail_alone_within_the_timeout(endpoints):
    start = time.monotonic()
    families, failed = scrape(endpoints)
    elapsed = time.monotonic() - start
    assert sorted(families) == ["decode-0", "prefill-0"]
    assert sorted(failed) == ["dead", "error", "garbage", "huge", "hung"]
    # concurrent: the hung worker costs one timeout, not one per worker (a hang guard with
    # a wide margin, not a speed claim)
    assert elapsed < 10 * TIMEOUT_S


def test_merged_text_has_each_family_once_with_the_worker_label(endpoints):
    good = {w: u for w, u in endpoints.items() if w in ("decode-0", "prefill-0")}
    families, failed = scrape(good)
    assert failed == []
    text = render_merged(server_registry().collect(), families).decode()
    type_lines = [line for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(type_lines) == len(set(type_lines))  # one name, one family
    samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples[(s.name, s.labels.get(WORKER_LABEL), s.labels.get("route"))] = s
    # the server's own sample keeps its labels; each worker's gets worker=<id>
    assert samples[("pdserve:prompt_tokens_total", None, None)].value == 100
    for wid, n in (("decode-0", 11), ("prefill-0", 29)):
        s = samples[("pdserve:prompt_tokens_total", wid, None)]
        assert s.value == n and s.labels["worker_id"] == wid
        assert samples[("pdserve:num_free_kv_blocks", wid, None)].value == 7
    # a worker family whose type conflicts with the server's is left out, the server's kept
    assert samples[("pdserve:route_decisions_total", None, "local")].value == 3
    assert not any(name.startswith("pdserve:route_decisions") and wid is not None
                   for name, wid, _ in samples)


def test_scrapes_within_the_interval_share_one_fetch_and_failures_count_once(endpoints):
    targets = {w: endpoints[w] for w in ("decode-0", "hung")}
    failures = []
    scraper = WorkerMetricsScraper(failures.append, timeout_s=TIMEOUT_S, min_interval_s=60)

    async def run():
        try:
            together = await asyncio.gather(*(scraper.families(targets) for _ in range(5)))
            later = await scraper.families(targets)
            changed = await scraper.families({"prefill-0": endpoints["prefill-0"]})
            return together, later, changed
        finally:
            await scraper.aclose()

    together, later, changed = asyncio.run(run())
    assert all(sorted(f) == ["decode-0"] for f in together) and later is together[0]
    assert failures == ["hung"]  # one fetch for the six scrapes
    assert sorted(changed) == ["prefill-0"]  # other workers: fetched anew
