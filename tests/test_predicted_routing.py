"""Routing by predicted time to first token (``--routing predicted``): the rates the
engine measures of its own steps, and the decisions a live disaggregated server makes
from them (the policy's arithmetic is tested by hand in test_router_parts.py)."""

from __future__ import annotations

import time

import threading

import httpx
import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import Request
from pdserve.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from pdserve.engine.step_stats import PrefillStats
from server_utils import ServerProcess, metrics
from test_disaggregated_e2e import MODEL, long_prompt


def observe_step(stats: PrefillStats, num_prefill: int, num_decodes: int,
                 step_s: float) -> None:
    """Feed ``stats`` one step: ``num_decodes`` one-token rows, then a prefill chunk of
    ``num_prefill`` tokens (none if 0), that took ``step_s`` seconds."""
    import torch

    def req(n: int) -> Request:
        return Request("r", list(range(n)), SamplingParams(), 4, (0,), torch.device("cpu"))
    scheduled = [ScheduledRequest(req(10), 1) for _ in range(num_decodes)]
    if num_prefill:
        scheduled.append(ScheduledRequest(req(400), num_prefill))
    idle = Scheduler(BlockManager(8, 16, False), max_num_seqs=4, max_num_batched_tokens=64)
    stats.observe(SchedulerOutput(scheduled, num_decodes=num_decodes,
                                  num_prefill_tokens=num_prefill), idle, step_s)


def test_prefill_rate_is_the_marginal_rate_beyond_a_decode_step():
    """Steps of 10 ms plus 0.5 ms per prefill token riding along 30 decode rows: 2,000
    tokens/s, however small the prefill (a step-time ratio would say 6 tokens / 13 ms =
    460 tokens/s)."""
    stats = PrefillStats()

    def step(num_prefill: int) -> None:
        observe_step(stats, num_prefill, 30, 0.010 + 0.0005 * num_prefill)

    step(300)  # the first step is not measured (one-time costs)
    assert stats.prefill_tokens_per_s == 0
    step(6)  # no decode-only step yet: the whole step counts as prefill
    assert stats.prefill_tokens_per_s == pytest.approx(6 / 0.013)
    for _ in range(3):
        step(0)
    assert stats.step_base_s == pytest.approx(0.010)
    assert stats.prefill_tokens_per_s == pytest.approx(2000)
    for n in (1, 40, 300):
        step(n)
        assert stats.prefill_tokens_per_s == pytest.approx(2000)


def test_a_prefill_is_charged_at_least_its_share_of_the_step_rows():
    """A step costs about the same for 1 row as for 45 (the weights are read once), so the
    margin over a one-row decode step says little about a long prompt (a rate 5x the real
    one sent a 1,500-token prompt to a busy decode worker): a prefill-only step counts
    whole, a prefill beside decode rows at least its share of the rows."""
    alone = PrefillStats()
    for _ in range(4):  # the first is not measured; then one-row decode steps of 20 ms
        observe_step(alone, 0, 1, 0.020)
    observe_step(alone, 45, 0, 0.022)  # 2 ms over the base, but it ran nothing else
    assert alone.prefill_tokens_per_s == pytest.approx(45 / 0.022)
    beside = PrefillStats()
    for _ in range(4):
        observe_step(beside, 0, 15, 0.020)
    observe_step(beside, 15, 15, 0.022)  # 2 ms over the base; half the rows were its
    assert beside.prefill_tokens_per_s == pytest.approx(15 / 0.011)


def test_engine_measures_its_prefill_rate_and_backlog(tiny_llama_checkpoint):
    path, _ = tiny_llama_checkpoint
    engine = LLM(str(path), dtype="float32", load_progress=False, block_size=16,
                 max_num_batched_tokens=64).engine
    stats = engine.prefill_stats
    assert (stats.prefill_tokens_per_s, stats.num_prefill_tokens_queued) == (0.0, 0)
    engine.add_request("a", list(range(1, 201)), SamplingParams(max_tokens=2))
    engine.add_request("b", list(range(1, 31)), SamplingParams(max_tokens=2))
    engine.step()  # one 64-token chunk of "a"; "b" waits
    assert stats.num_prefill_tokens_queued == (200 - 64) + 30
    engine.step()
    assert stats.prefill_tokens_per_s > 0
    while engine.has_unfinished_requests:
        engine.step()
    assert stats.num_prefill_tokens_queued == 0 and stats.step_base_s > 0


def route_counts(server) -> dict[str, float]:
    return {kind: metrics(server).get(f"pdserve:route_decisions_total{{route={kind}}}", 0.0)
            for kind in ("local", "remote_prefill", "fallback")}


def complete(server, prompt: str, max_tokens: int = 4, **extra) -> str:
    resp = httpx.post(f"{server.base_url}/completions", timeout=300, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        **extra})
    resp.raise_for_status()
    return resp.json()["choices"][0]["text"]


def wait_routes(server, kind: str, count: float, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while route_counts(server)[kind] < count:
        assert time.monotonic() < deadline, route_counts(server)
        time.sleep(0.02)


@pytest.mark.slow
def test_predicted_routing_sends_long_prompts_away_from_a_busy_decode_worker_and_short_ones_away_from_a_busy_prefill_worker():
    """With ``--prefill-threshold 64`` the threshold policy would send all of these to the
    prefill worker. Once rates are known: a ~1,850-token prompt arriving while two requests
    decode on D costs D's running requests three times its prefill, so it goes remote;
    a 100-token prompt arriving while P still has those tokens queued is cheaper on D (its
    prefill, plus two short stalls) than behind them: it stays local."""
    server = ServerProcess("--routing", "predicted", "--prefill-threshold", "64",
                           colocated=False)
    try:
        # rates unknown (and each worker's first step unmeasured): the threshold decides
        complete(server, "Say hello.")  # local: D's decode-only steps...
        complete(server, long_prompt(3, min_words=30))  # ...and a local prefill
        for seed in (4, 7):  # P's first two prefills
            complete(server, long_prompt(seed, min_words=250))
        assert route_counts(server) == {"local": 2.0, "remote_prefill": 2.0, "fallback": 0}
        time.sleep(2.5)  # heartbeats carry both workers' rates now
        busy = [threading.Thread(target=complete, args=(server, f"Count to {i}."),
                                 kwargs={"max_tokens": 400, "ignore_eos": True})
                for i in (3, 4)]
        for t in busy:
            t.start()
        time.sleep(3.0)  # both decode on D (wherever prefilled), and its heartbeat says so
        before = route_counts(server)
        # ~1,850 tokens (the server's max_model_len is 2,048): P must still be prefilling them
        # when the next prompt is routed, and P's prefill got ~10 % faster (fourteenth session)
        long = threading.Thread(target=complete, args=(server, long_prompt(5, 1600)))
        long.start()
        wait_routes(server, "remote_prefill", before["remote_prefill"] + 1)  # D is busy
        complete(server, long_prompt(6, min_words=70))  # P is busy: this one stays on D
        after = route_counts(server)
        assert (after["local"] - before["local"], after["remote_prefill"]
                - before["remote_prefill"], after["fallback"]) == (1, 1, 0)
        for t in (*busy, long):
            t.join()
    finally:
        server.stop()
