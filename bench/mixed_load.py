"""Mixed load, colocated vs disaggregated at equal total CPU: the seed article's 95/5 mix.

Poisson arrivals; 95 % short prompts (64-256 tokens, 64-128 output tokens), 5 % long
(1,500-3,000 tokens, 64 output tokens). Two topologies, each started fresh on loopback:

- colocated: one decode worker on both cores (2 torch threads), prefilling everything;
- disaggregated: a prefill worker pinned to core 0 and a decode worker pinned to core 1
  (1 torch thread each), long prompts (>= --prefill-threshold) prefilled remotely.

Prints P50/P99 TTFT of the short requests, P50/P99 TTFT of the long ones, and output
throughput for both, and the ratios (target: P99 TTFT(short) disaggregated <= 1/3 of
colocated; throughput >= 0.9x).

    python bench/mixed_load.py [--num-requests 60] [--rate 0.5]

The cluster helpers (:func:`start_cluster`, :func:`run_requests`, :func:`route_counts`)
are shared with ``bench/routing_compare.py`` (threshold vs predicted routing).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from server_utils import free_port, stop_process, wait_health  # noqa: E402

ENGINE = ["--max-model-len", "4096", "--num-kv-blocks", "2048"]


def pct(values: list[float], q: float) -> float:
    """The ``q``-th percentile of ``values`` (nearest rank; NaN when empty)."""
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))] if s else float("nan")


def workload(n: int, rate: float, seed: int = 0) -> list[tuple[float, list[int], int, bool]]:
    """(arrival offset s, prompt ids, max_tokens, is_long) per request."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        is_long = rng.random() < 0.05
        plen = rng.randint(1500, 3000) if is_long else rng.randint(64, 256)
        olen = 64 if is_long else rng.randint(64, 128)
        out.append((t, [rng.randrange(1000, 49000) for _ in range(plen)], olen, is_long))
    if not any(r[3] for r in out):  # make sure the mix has its long prompts
        for i in range(0, n, 20):
            t0, _, _, _ = out[i]
            out[i] = (t0, [rng.randrange(1000, 49000) for _ in range(rng.randint(1500, 3000))],
                      64, True)
    return out


def launch(kind: str, router: str, cpus: str, threads: int, secret: str) -> subprocess.Popen:
    """A worker of ``kind`` pinned to ``cpus`` with ``threads`` torch threads."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1",
               PDSERVE_CLUSTER_SECRET=secret)
    cmd = ["taskset", "-c", cpus, sys.executable, "-m", "pdserve.cli", kind, "--router", router,
           *ENGINE]
    if kind == "prefill-worker":
        cmd += ["--kv-transfer-dtype", "fp8"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)


async def one(http, url, ids, max_tokens, delay):
    """One streamed completion sent after ``delay`` s: (TTFT s or None, output chunks)."""
    await asyncio.sleep(delay)
    body = {"model": "SmolLM2-135M-Instruct", "prompt": ids, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    ttft, n = None, 0
    async with http.stream("POST", url, json=body) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    ttft = ttft or time.perf_counter() - start
                    n += 1
    return ttft, n


@dataclass
class Cluster:
    """A running server + workers on loopback: ``base`` URL and the processes to stop."""

    base: str
    procs: list[subprocess.Popen]

    def stop(self) -> None:
        """Workers first, then the server."""
        for proc in self.procs[1:] + self.procs[:1]:
            stop_process(proc, 10)


def start_cluster(disaggregated: bool, threshold: int, routing: str = "threshold") -> Cluster:
    """Server (``--routing routing``) + one decode worker on both cores (colocated), or a
    prefill worker on core 0 and a decode worker on core 1; returns once every worker is up."""
    port, rport = free_port(), free_port()
    router, secret = f"tcp://127.0.0.1:{rport}", secrets.token_hex(16)
    server = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "server", "--port", str(port), "--router-address",
         router, "--prefill-threshold", str(threshold), "--routing", routing,
         "--max-model-len", "4096"],
        env=dict(os.environ, PDSERVE_CLUSTER_SECRET=secret), stdout=subprocess.DEVNULL)
    workers = ([launch("prefill-worker", router, "0", 1, secret),
                launch("decode-worker", router, "1", 1, secret)]
               if disaggregated else [launch("decode-worker", router, "0,1", 2, secret)])
    cluster = Cluster(f"http://127.0.0.1:{port}", [server, *workers])
    try:
        if not wait_health(cluster.base, 200, server, 300):
            raise RuntimeError("server did not become healthy")
        deadline = time.monotonic() + 120
        while num_workers_up(cluster.base) < len(workers):
            if time.monotonic() > deadline:
                raise RuntimeError("workers did not register")
            time.sleep(0.5)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def num_workers_up(base: str) -> int:
    """Workers the router sees alive (``pdserve:worker_up``)."""
    return int(sum(v for k, v in scrape(base).items() if k.startswith("pdserve:worker_up{")))


def scrape(base: str) -> dict[str, float]:
    """Flat ``{name{labels}: value}`` of ``base``/metrics (model_name label dropped)."""
    out = {}
    for fam in text_string_to_metric_families(httpx.get(f"{base}/metrics", timeout=10).text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                              if k != "model_name")
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def route_counts(base: str) -> dict[str, int]:
    """``pdserve:route_decisions_total`` by route kind (local, remote_prefill, fallback)."""
    prefix = "pdserve:route_decisions_total{route="
    return {k[len(prefix):-1]: int(v) for k, v in scrape(base).items() if k.startswith(prefix)}


async def run_requests(base: str, reqs) -> tuple[list[tuple[float | None, int]], float]:
    """Send ``reqs`` (as :func:`workload` makes them) at their arrival offsets; returns
    (TTFT s, output tokens) per request and the wall time of the whole run."""
    url = f"{base}/v1/completions"
    async with httpx.AsyncClient(timeout=900) as http:
        t0 = time.perf_counter()
        res = await asyncio.gather(*(one(http, url, ids, mt, at) for at, ids, mt, _ in reqs))
        return res, time.perf_counter() - t0


def summarize(name: str, reqs, res, elapsed: float) -> dict:
    """TTFT percentiles of the short and the long requests and output throughput."""
    short = [r[0] for r, q in zip(res, reqs) if not q[3] and r[0] is not None]
    long_ = [r[0] for r, q in zip(res, reqs) if q[3] and r[0] is not None]
    return {"name": name, "num_requests": len(reqs), "num_long": sum(q[3] for q in reqs),
            "num_failed": sum(r[0] is None for r in res),
            "ttft_short_p50": pct(short, 50), "ttft_short_p99": pct(short, 99),
            "ttft_long_p50": pct(long_, 50), "ttft_long_p99": pct(long_, 99),
            "tok_s": sum(r[1] for r in res) / elapsed, "elapsed_s": elapsed}


def run_topology(name: str, disaggregated: bool, reqs, threshold: int) -> dict:
    """Start a fresh cluster, run ``reqs`` against it and print its summary."""
    cluster = start_cluster(disaggregated, threshold)
    try:
        res, elapsed = asyncio.run(run_requests(cluster.base, reqs))
    finally:
        cluster.stop()
    out = summarize(name, reqs, res, elapsed)
    print(f"{name:14s} TTFT short p50 {out['ttft_short_p50']:.2f}s p99 {out['ttft_short_p99']:.2f}s"
          f" | long p50 {out['ttft_long_p50']:.2f}s | {out['tok_s']:.1f} out tok/s", flush=True)
    return out


def main() -> None:
    """Run the mix on both topologies and print the ratios against the targets."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=60)
    p.add_argument("--rate", type=float, default=0.5, help="requests per second (Poisson)")
    p.add_argument("--prefill-threshold", type=int, default=512)
    args = p.parse_args()
    reqs = workload(args.num_requests, args.rate)
    print(f"{len(reqs)} requests, {sum(r[3] for r in reqs)} long, rate {args.rate}/s")
    colo = run_topology("colocated", False, reqs, args.prefill_threshold)
    dis = run_topology("disaggregated", True, reqs, args.prefill_threshold)
    print(f"P99 TTFT(short) disaggregated / colocated = "
          f"{dis['ttft_short_p99'] / colo['ttft_short_p99']:.2f} (target <= 0.33)")
    print(f"throughput disaggregated / colocated = {dis['tok_s'] / colo['tok_s']:.2f} "
          f"(target >= 0.9)")


if __name__ == "__main__":
    main()
