"""A burst of concurrent requests against ``pdserve serve`` (1 prefill + 1 decode worker):
does the router's event loop keep up, and does it drop a healthy worker?

All ``--num-requests`` (256) requests are sent at once; 20 % are long prompts (1,500-2,000
random token ids, so they go to the prefill worker at the default --prefill-threshold 512),
80 % short (64-192). Reports, from the server's /metrics and its log:

- the router loop's lag (``pdserve:router_loop_lag_seconds`` during the burst): p50 and p99
  interpolated within histogram buckets, and the bucket holding the largest sample;
- whether a worker was dropped: the fewest workers up seen while polling /metrics, the
  server's "dropping it" log lines, ``pdserve:request_retries_total`` and
  ``pdserve:request_migrations_total``, route decisions by route (``fallback``: a long
  prompt with no prefill worker alive);
- long prompts prefilled a second time on the decode worker (the router's "recomputing the
  prefill" log lines; KV-transfer failures by reason);
- every request's HTTP status and finish reason.

    python bench/router_burst.py [--num-requests 256] [--out bench/results/...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from server_utils import free_port, stop_process, wait_health  # noqa: E402

LAG = "pdserve:router_loop_lag_seconds"


def cpu_tag() -> tuple[str, str]:
    """(the CPU's model name, a short tag for folder names, e.g. ``epyc-avx2``)."""
    text = Path("/proc/cpuinfo").read_text()
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines()
                  if line.startswith("model name")), "unknown")
    isa = "avx512" if " avx512f" in text else "avx2" if " avx2" in text else "base"
    word = model.replace("AMD ", "").replace("Intel(R) ", "").split()[0].lower()
    return model, f"{word}-{isa}"


def workload(n: int, long_fraction: float, seed: int = 0) -> list[tuple[list[int], bool]]:
    """(prompt token ids, is_long) per request; exactly ``round(n * long_fraction)`` long."""
    rng = random.Random(seed)
    num_long = round(n * long_fraction)
    kinds = [True] * num_long + [False] * (n - num_long)
    rng.shuffle(kinds)
    return [([rng.randrange(1000, 49000) for _ in range(
        rng.randint(1500, 2000) if is_long else rng.randint(64, 192))], is_long)
        for is_long in kinds]


def scrape(base: str) -> dict[str, float]:
    """Flat ``{name{labels}: value}`` of /metrics (model_name dropped)."""
    out = {}
    for fam in text_string_to_metric_families(httpx.get(f"{base}/metrics", timeout=30).text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                              if k != "model_name")
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def lag_buckets(before: dict, after: dict) -> list[tuple[float, float]]:
    """(upper bound s, samples in the burst at or below it), cumulative, ascending."""
    out = []
    for key, value in after.items():
        if key.startswith(f"{LAG}_bucket{{"):
            le = key.split("le=", 1)[1].rstrip("}")
            out.append((float(le), value - before.get(key, 0.0)))
    return sorted(out)


def quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """The ``q`` quantile, linear within its bucket (Prometheus' histogram_quantile)."""
    total = buckets[-1][1]
    if total <= 0:
        return float("nan")
    rank, lower, below = q * total, 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if upper == float("inf"):
                return lower
            return lower + (upper - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = upper, count
    return lower


def max_bucket(buckets: list[tuple[float, float]]) -> list[float]:
    """[lower, upper] seconds of the bucket holding the largest sample."""
    lower, below = 0.0, 0.0
    result = [0.0, 0.0]
    for upper, count in buckets:
        if count > below:
            result = [lower, upper]
        lower, below = upper, count
    return result


async def one(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int):
    """(HTTP status, finish reason or error text, completion tokens, seconds)."""
    start = time.monotonic()
    try:
        r = await client.post(url, json={"model": "m", "prompt": prompt, "max_tokens":
                                         max_tokens, "temperature": 0, "ignore_eos": True})
    except httpx.HTTPError as exc:
        return 0, type(exc).__name__, 0, time.monotonic() - start
    elapsed = time.monotonic() - start
    if r.status_code != 200:
        return r.status_code, r.text[:200], 0, elapsed
    body = r.json()
    return 200, body["choices"][0]["finish_reason"], body["usage"]["completion_tokens"], elapsed


async def watch_workers(base: str, stop: asyncio.Event, seen: dict) -> None:
    """Poll /metrics; keep the fewest workers up per role."""
    async with httpx.AsyncClient(timeout=30) as client:
        while not stop.is_set():
            try:
                text = (await client.get(f"{base}/metrics")).text
            except httpx.HTTPError:
                text = ""
            for role in ("prefill", "decode"):
                up = sum(1 for line in text.splitlines()
                         if line.startswith("pdserve:worker_up{") and f'role="{role}"' in line
                         and line.rstrip().endswith(" 1.0"))
                seen[role] = min(seen.get(role, up), up)
            await asyncio.sleep(0.5)


async def burst(base: str, reqs, max_tokens: int) -> tuple[list, dict]:
    stop, seen = asyncio.Event(), {}
    watcher = asyncio.create_task(watch_workers(base, stop, seen))
    limits = httpx.Limits(max_connections=len(reqs) + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        results = await asyncio.gather(*(one(client, f"{base}/v1/completions", p, max_tokens)
                                         for p, _ in reqs))
    stop.set()
    await watcher
    return results, seen


def count_lines(text: str, needle: str) -> int:
    """Lines of ``text`` that end with ``needle``."""
    return sum(line.rstrip().endswith(needle) for line in text.splitlines())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--long-fraction", type=float, default=0.2)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--num-kv-blocks", type=int, default=6144)
    ap.add_argument("--out", default=None, help="results folder (default: "
                    "bench/results/router-burst-<date>-<cpu>)")
    args = ap.parse_args()
    model, tag = cpu_tag()
    out = Path(args.out or Path(__file__).parent / "results"
               / f"router-burst-{time.strftime('%Y-%m-%d')}-{tag}")
    out.mkdir(parents=True, exist_ok=True)
    log = out / "server.log"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--port", str(port),
           "--served-model-name", "m", "--max-model-len", "4096",
           "--num-kv-blocks", str(args.num_kv_blocks), "--max-num-inflight", "1024",
           # the burst queues ~90k prompt tokens on one prefill core: measure liveness,
           # not the first-token deadline
           "--first-token-timeout", "3600"]
    with open(log, "w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
        try:
            if not wait_health(base, 200, proc, 300):
                raise SystemExit(f"server did not come up; see {log}")
            while sum(1 for k, v in scrape(base).items()
                      if k.startswith("pdserve:worker_up{") and v == 1) < 2:
                time.sleep(0.5)
            reqs = workload(args.num_requests, args.long_fraction)
            before = scrape(base)
            start = time.monotonic()
            results, min_up = asyncio.run(burst(base, reqs, args.max_tokens))
            wall_s = time.monotonic() - start
            time.sleep(2.0)  # a few more liveness ticks after the burst
            after = scrape(base)
            burst_log = log.read_text(errors="replace")  # not the shutdown's lines
        finally:
            stop_process(proc)
    buckets = lag_buckets(before, after)

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    statuses = Counter(f"{status} {reason}" for status, reason, _, _ in results)
    report = {
        "cpu": model, "num_cores": os.cpu_count(), "command": " ".join(cmd[2:]),
        "num_requests": len(reqs), "num_long": sum(is_long for _, is_long in reqs),
        "max_tokens": args.max_tokens, "wall_s": round(wall_s, 1),
        "router_loop_lag_s": {
            "num_samples": int(buckets[-1][1]) if buckets else 0,
            "p50": round(quantile(buckets, 0.5), 4), "p99": round(quantile(buckets, 0.99), 4),
            "max_bucket": max_bucket(buckets),
            "mean": round(delta(f"{LAG}_sum{{}}") / max(delta(f"{LAG}_count{{}}"), 1), 4)},
        "workers": {
            "min_up_during_burst": min_up,
            "dropped_log_lines": count_lines(burst_log, "; dropping it"),
            "missed_heartbeats_log_lines": count_lines(burst_log,
                                                       "missed its heartbeats; dropping it"),
            "request_retries": delta("pdserve:request_retries_total{}"),
            "request_migrations": delta("pdserve:request_migrations_total{}"),
            "worker_restarts": {role: delta(f"pdserve:worker_restarts_total{{role={role}}}")
                                for role in ("prefill", "decode")}},
        "routes": {route: delta(f"pdserve:route_decisions_total{{route={route}}}")
                   for route in ("local", "remote_prefill", "fallback")},
        "long_prompts_prefilled_again_on_decode": sum(
            "recomputing the prefill on" in line for line in burst_log.splitlines()),
        "kv_transfer_failures": {k.split("reason=", 1)[1].rstrip("}"): delta(k)
                                 for k in after if k.startswith(
                                     "pdserve:kv_transfer_failures_total{")},
        "statuses": dict(statuses),
        "completion_tokens_ok": all(n == args.max_tokens for s, _, n, _ in results if s == 200),
        "latency_s": {"p50": round(sorted(r[3] for r in results)[len(results) // 2], 2),
                      "max": round(max(r[3] for r in results), 2)},
    }
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
