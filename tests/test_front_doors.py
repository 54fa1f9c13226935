"""Several front doors sharing one pool of workers (issue 24): two ``pdserve server``
processes, each with its own router, and one prefill and one decode worker registered with
both; and ``pdserve serve --api-servers 2`` on one port."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from pdserve.engine.loader import DEFAULT_MODEL as MODEL
from pdserve.worker_links import parse_router_addresses, resolve_router_addresses
from server_utils import (
    child_pids,
    free_port,
    metrics,
    start_cli,
    stop_process,
    wait_exit,
    wait_health,
    wait_idle,
    wait_workers,
)

ENGINE = ["--max-model-len", "2048", "--num-kv-blocks", "256"]
LONG_PROMPT = " ".join(f"item {i} of the inventory list;" for i in range(60))


def test_router_list_parsing():
    assert parse_router_addresses("tcp://1.2.3.4:5, tcp://1.2.3.4:5,ipc:///x") == [
        "tcp://1.2.3.4:5", "ipc:///x"]
    for bad in ("", " ", "tcp://a:1,,tcp://b:2"):
        with pytest.raises(ValueError, match="--router"):
            parse_router_addresses(bad)


def test_resolution_keeps_literals_and_unresolvable_names():
    addresses = ["tcp://127.0.0.1:5557", "tcp://[::1]:5557", "ipc:///tmp/r",
                 "tcp://no-such-host.invalid:5557"]
    assert resolve_router_addresses(addresses) == addresses


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_a_reuse_port_server_listens_only_once_a_decode_worker_registered():
    """A member of a shared port that answered before its router had a worker would take
    its share of the connections only to 503 them: it stays bound, not listening."""
    port, router_port = free_port(), free_port()
    proc = start_cli("server", "--port", str(port), "--reuse-port", "--router-address",
                     f"tcp://127.0.0.1:{router_port}")
    try:
        deadline = time.monotonic() + 60
        while not _accepts(router_port):  # the router runs: the app's startup is under way
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        for _ in range(10):
            assert not _accepts(port) and proc.poll() is None
            time.sleep(0.2)
    finally:
        assert stop_process(proc, timeout_s=20) == 0  # a SIGTERM ends the wait


class _Door:
    """One ``pdserve server`` (API server + router) on free loopback ports."""

    def __init__(self, *extra: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.router = f"tcp://127.0.0.1:{free_port()}"
        self.proc = start_cli("server", "--port", str(self.port), "--router-address",
                              self.router, "--prefill-threshold", "64", *extra)

    def client(self) -> OpenAI:
        return OpenAI(base_url=f"{self.base}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def cluster():
    doors = [_Door(), _Door()]
    routers = ",".join(d.router for d in doors)
    workers = [start_cli("decode-worker", "--router", routers, *ENGINE),
               start_cli("prefill-worker", "--router", routers, *ENGINE)]
    try:
        for door in doors:
            assert wait_health(door.base, 200, door.proc, 240), "an API server never got ready"
            wait_workers(door, "decode", 1)
            wait_workers(door, "prefill", 1)
        yield doors, workers
    finally:
        for p in doors + workers:
            stop_process(p.proc if isinstance(p, _Door) else p)


def _complete(door: _Door, prompt: str, max_tokens: int = 8) -> str:
    out = door.client().completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                           temperature=0)
    assert out.usage.completion_tokens == max_tokens or out.choices[0].finish_reason == "stop"
    return out.choices[0].text


def test_both_doors_serve_short_and_remote_prefill(cluster):
    """Short prompts (decode worker) and long ones (prefill worker, KV pushed to the
    decode worker) through either door, concurrently; greedy text is the same through
    both; each router counts only its own requests, and the workers end idle."""
    doors, _ = cluster
    results: dict[tuple[int, int], str] = {}

    def run(i: int, j: int) -> None:
        prompt = LONG_PROMPT if j % 2 else f"Say something about the number {j}."
        results[i, j] = _complete(doors[i], prompt)

    threads = [threading.Thread(target=run, args=(i, j)) for i in (0, 1) for j in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 8
    for j in range(4):
        assert results[0, j] == results[1, j]
    num_remote = 0
    for door in doors:
        m = wait_idle(door, timeout_s=20)
        assert sum(v for k, v in m.items()
                   if k.startswith("pdserve:request_success_total")) == 4
        assert sum(v for k, v in m.items()
                   if k.startswith("pdserve:route_decisions_total")) == 4
        num_remote += m.get("pdserve:route_decisions_total{route=remote_prefill}", 0)
        assert not any(v for k, v in m.items() if k.startswith(
            ("pdserve:worker_kv_cache_usage_perc", "pdserve:worker_num_requests_running")))
    assert num_remote >= 1  # a router may find the long prompt cached on D already


def test_a_killed_door_leaves_the_other_serving_and_frees_its_requests(cluster):
    """kill -9 of one API server while it streams a long request: the other still serves,
    and the decode worker drops the dead router's request (its connection closed) instead
    of decoding it to ``max_tokens``: the workers' KV usage returns to 0."""
    doors, _ = cluster
    dead, alive = doors
    stream = dead.client().completions.create(
        model=MODEL, prompt="Count slowly:", max_tokens=1900, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    next(iter(stream))  # the request runs on the decode worker
    dead.proc.send_signal(signal.SIGKILL)
    assert wait_exit(dead.proc.pid, 10)
    assert _complete(alive, "Hello there", 4)
    assert _complete(alive, LONG_PROMPT, 4)
    # 1,900 tokens take far longer than this on 2 cores: only an abort gets there in time
    deadline = time.monotonic() + 30
    while True:
        m = metrics(alive)
        running = sum(v for k, v in m.items()
                      if k.startswith("pdserve:worker_num_requests_running"))
        usage = sum(v for k, v in m.items()
                    if k.startswith("pdserve:worker_kv_cache_usage_perc"))
        if running == 0 and usage == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert running == 0 and usage == 0, m
    assert metrics(alive)["pdserve:worker_up{role=decode,worker_id=" + _decode_id(m) + "}"] == 1


def _decode_id(m: dict[str, float]) -> str:
    key = next(k for k in m if k.startswith("pdserve:worker_up{role=decode"))
    return key.split("worker_id=")[1].rstrip("}")


@pytest.mark.slow
def test_serve_api_servers_shares_one_port():
    """``serve --api-servers 2``: one port, two API server processes; killing the extra
    one leaves the port serving, and the supervisor starts it again."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start_cli("serve", "--port", str(port), "--api-servers", "2",
                     "--prefill-threshold", "64", *ENGINE)
    try:
        assert wait_health(base, 200, proc, 240)
        apis = [pid for pid in child_pids(proc.pid)
                if b"\0server\0" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(apis) == 1
        # a killed API server resets the connections it held or had queued: clients retry
        # (the OpenAI SDK does by default)
        client = OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=2)
        for prompt in ("Hi", LONG_PROMPT) * 3:  # fresh connections spread over both
            with httpx.Client() as http:
                resp = http.post(f"{base}/v1/completions", json={
                    "model": MODEL, "prompt": prompt, "max_tokens": 4}, timeout=120)
                assert resp.status_code == 200, resp.text
        os.kill(apis[0], signal.SIGKILL)
        assert wait_exit(apis[0], 10)  # its listening socket leaves the port's group
        for _ in range(6):
            assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=4)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            again = [pid for pid in child_pids(proc.pid) if pid != apis[0]
                     and b"\0server\0" in Path(f"/proc/{pid}/cmdline").read_bytes()]
            if again:
                break
            time.sleep(0.5)
        assert again, "the extra API server was not started again"
    finally:
        stop_process(proc)
