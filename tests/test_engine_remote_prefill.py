"""Engine-level remote prefill: one engine prefills and exports KV, another decodes from it."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.llm_engine import KVCapacityError

from test_engine_equivalence import NUM_NEW_TOKENS, make_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)


def run_to_end(engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests:
        for d in engine.step():
            tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
    return tokens


@pytest.fixture(scope="module")
def engines(tiny_model):
    """(prefill engine, decode engine, colocated LLM) on the same tiny checkpoint."""
    _, path, _ = tiny_model
    kw = dict(dtype="float32", load_progress=False, block_size=16, max_num_batched_tokens=64)
    return LLM(str(path), **kw).engine, LLM(str(path), **kw).engine, LLM(str(path), **kw)


def test_decode_from_transferred_kv_equals_colocated(engines):
    prefill, decode, colocated = engines
    prompts = make_prompts([40, 100, 211], seed=3)
    expected = [o.outputs[0].token_ids
                for o in colocated.generate(prompts, GREEDY, detokenize=False)]
    initial_free = decode.num_free_blocks
    for i, p in enumerate(prompts):
        prefill.add_request(f"r{i}", p, GREEDY, export_kv=True)
        assert decode.reserve_remote_prefill(f"r{i}", p, GREEDY) == 0
    first = run_to_end(prefill)
    assert prefill.num_free_blocks == prefill.block_manager.num_blocks  # P keeps nothing
    for i in range(len(prompts)):
        kv = prefill.pop_exported_kv(f"r{i}")
        assert decode.complete_remote_prefill(f"r{i}", first[f"r{i}"][0], kv)
    rest = run_to_end(decode)
    got = [first[f"r{i}"] + rest[f"r{i}"] for i in range(len(prompts))]
    assert got == expected
    assert decode.num_free_blocks == initial_free


def test_resume_locally_continues_after_the_streamed_first_token(engines):
    prefill, decode, colocated = engines
    prompt = make_prompts([77], seed=4)[0]
    expected = colocated.generate([prompt], GREEDY, detokenize=False)[0].outputs[0]
    decode.reserve_remote_prefill("lost", prompt, GREEDY)
    assert decode.resume_locally("lost", [expected.token_ids[0]])
    rest = run_to_end(decode)["lost"]
    assert [expected.token_ids[0]] + rest == expected.token_ids


def test_seeded_sampling_continues_its_random_stream_on_another_worker(engines):
    """A seeded, sampled request gives the same tokens whether one engine runs it, a prefill
    worker samples its first token and a decode worker the rest, the decode worker
    recomputes after that first token, or a second engine takes over after 5 tokens
    (a migration): each continuation skips the draws of the tokens sampled before it."""
    prefill, decode, colocated = engines
    prompt = make_prompts([60], seed=8)[0]
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=NUM_NEW_TOKENS,
                            ignore_eos=True)
    expected = colocated.generate([prompt], seeded, detokenize=False)[0].outputs[0].token_ids
    unseeded = SamplingParams(temperature=1.0, seed=99, max_tokens=NUM_NEW_TOKENS,
                              ignore_eos=True)
    assert colocated.generate([prompt], unseeded, detokenize=False)[0].outputs[0] \
        .token_ids != expected  # the seed matters, so equality below means something
    prefill.add_request("remote", prompt, seeded, export_kv=True)
    decode.reserve_remote_prefill("remote", prompt, seeded)
    first = run_to_end(prefill)["remote"]
    assert first == expected[:1]
    assert decode.complete_remote_prefill("remote", first[0], prefill.pop_exported_kv("remote"))
    assert first + run_to_end(decode)["remote"] == expected
    decode.reserve_remote_prefill("resumed", prompt, seeded)
    assert decode.resume_locally("resumed", expected[:1])
    assert expected[:1] + run_to_end(decode)["resumed"] == expected
    decode.add_request("migrated", prompt, seeded, output_token_ids=expected[:5])
    assert expected[:5] + run_to_end(decode)["migrated"] == expected


def test_abort_of_a_parked_request_frees_its_reservation(engines):
    _, decode, _ = engines
    initial = decode.num_free_blocks
    decode.reserve_remote_prefill("parked", make_prompts([150], seed=5)[0], GREEDY)
    assert decode.num_free_blocks < initial
    assert decode.abort_request("parked")
    assert decode.num_free_blocks == initial


def test_reservation_beyond_free_blocks_is_refused(tiny_model):
    _, path, _ = tiny_model
    engine = LLM(str(path), dtype="float32", load_progress=False, block_size=16,
                 num_kv_blocks=20, max_model_len=300).engine
    engine.reserve_remote_prefill("a", make_prompts([250], seed=6)[0], GREEDY)
    with pytest.raises(KVCapacityError):
        engine.reserve_remote_prefill("b", make_prompts([250], seed=7)[0], GREEDY)
    assert "b" not in engine.requests


def test_layer_streamed_kv_equals_the_whole_copy(tiny_model):
    """``kv_layer_sink``: every layer of each exported prompt arrives once, in order, during
    the step that completes the (chunked: 64-token budget) prefill, and equals the copy taken
    after the step, bit for bit."""
    _, path, _ = tiny_model
    kw = dict(dtype="float32", load_progress=False, block_size=16, max_num_batched_tokens=64)
    whole, streaming = LLM(str(path), **kw).engine, LLM(str(path), **kw).engine
    prompts = make_prompts([40, 100, 211], seed=4)
    received: dict[str, list] = {}
    step_of_layer: dict[str, set[int]] = {}
    steps = 0
    streaming.kv_layer_sink = lambda rid, layer, kv, scales, n: (
        received.setdefault(rid, []).append((layer, kv, n)),
        step_of_layer.setdefault(rid, set()).add(steps))
    for engine in (whole, streaming):
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, GREEDY, export_kv=True)
    run_to_end(whole)
    while streaming.has_unfinished_requests:
        steps += 1
        streaming.step()
    num_layers = streaming.arch.num_layers
    for i, p in enumerate(prompts):
        rid = f"r{i}"
        assert streaming.pop_exported_kv(rid) is None  # streamed instead
        layers = received[rid]
        assert [layer for layer, _, _ in layers] == list(range(num_layers))
        assert all(n == len(p) for _, _, n in layers)
        assert len(step_of_layer[rid]) == 1  # all in one step: the prefill's last chunk
        expected = whole.pop_exported_kv(rid)
        assert torch.equal(torch.cat([kv for _, kv, _ in layers]), expected)
    assert steps > 3  # the 351 prompt tokens really took several chunked steps
    assert streaming.num_free_blocks == streaming.block_manager.num_blocks
