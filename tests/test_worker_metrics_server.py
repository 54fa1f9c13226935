"""The workers' /metrics HTTP server (pdserve/worker_metrics.py) on a real socket: idle
connections are bounded in number and in time, so one client cannot hold a thread per
connection (prometheus-client's ``start_http_server`` kept ~1,000 for one client)."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter

from pdserve import worker_metrics
from pdserve.worker_metrics import MAX_METRICS_CONNECTIONS, BoundedMetricsHTTPServer


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setattr(worker_metrics._QuietHandler, "timeout", 1.0)  # idle limit, seconds
    registry = CollectorRegistry()
    Counter("pdserve:probe", "A counter to find.", registry=registry).inc(3)
    srv = BoundedMetricsHTTPServer(registry, "127.0.0.1", 0)
    yield srv
    srv.close()


def scrape(srv) -> httpx.Response:
    return httpx.get(f"http://127.0.0.1:{srv.server_port}/metrics", timeout=5.0)


def test_idle_connections_are_bounded_then_closed_and_scrapes_go_on(server):
    assert "pdserve:probe_total 3.0" in scrape(server).text
    threads_before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", server.server_port), timeout=5.0)
            for _ in range(4 * MAX_METRICS_CONNECTIONS)]
    try:
        time.sleep(0.3)
        assert threading.active_count() - threads_before <= MAX_METRICS_CONNECTIONS
        # over the limit: closed by the server at once (EOF), not held
        closed_at_once = 0
        for sock in idle[MAX_METRICS_CONNECTIONS:]:
            try:
                closed_at_once += sock.recv(1) == b""
            except ConnectionResetError:
                closed_at_once += 1
        assert closed_at_once == 3 * MAX_METRICS_CONNECTIONS
        # the held ones are closed after the idle limit, and a scrape answers again
        for sock in idle[:MAX_METRICS_CONNECTIONS]:
            assert sock.recv(1) == b""
        assert "pdserve:probe_total 3.0" in scrape(server).text
        deadline = time.monotonic() + 5.0
        while threading.active_count() > threads_before:
            assert time.monotonic() < deadline, "connection threads outlived their sockets"
            time.sleep(0.05)
    finally:
        for sock in idle:
            sock.close()


def test_a_slow_request_is_dropped_at_the_idle_limit(server):
    sock = socket.create_connection(("127.0.0.1", server.server_port), timeout=5.0)
    with sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # headers never finished
        start = time.monotonic()
        assert sock.recv(1024) == b""
        assert time.monotonic() - start < 4.0
    assert scrape(server).status_code == 200
