"""A worker's prompt-token counter (``PrefillStats.num_prefill_tokens_computed``, exported as
``pdserve:prompt_tokens_total``) counts exactly the tokens its model ran for prompts:
prefix-cache hits and KV received from a prefill worker are not counted, a recompute after
a failed transfer is, and so is the one token a fully cached prompt still computes (it
rides the decode path)."""

from __future__ import annotations

import pytest

from pdserve.engine import LLM, SamplingParams

BLOCK_SIZE = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(tiny_llama_checkpoint):
    """(prefill engine, decode engine), both with prefix caching."""
    path, _ = tiny_llama_checkpoint
    kw = dict(dtype="float32", load_progress=False, block_size=BLOCK_SIZE,
              max_num_batched_tokens=64)
    return LLM(str(path), **kw).engine, LLM(str(path), **kw).engine


def run_to_end(engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests:
        for d in engine.step():
            tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
    return tokens


def counted(engine) -> int:
    return engine.prefill_stats.num_prefill_tokens_computed


def test_local_prompts_count_their_uncached_tokens(engines):
    _, engine = engines
    prompt = [(7 * i) % 50 + 1 for i in range(2 * BLOCK_SIZE + 1)]  # 33: 2 full blocks + 1
    start = counted(engine)
    engine.add_request("first", prompt, GREEDY)
    run_to_end(engine)
    assert counted(engine) - start == len(prompt)
    start = counted(engine)
    engine.add_request("again", prompt, GREEDY)  # 32 cached: one token left to compute
    run_to_end(engine)
    assert counted(engine) - start == 1
    start = counted(engine)
    engine.add_request("longer", prompt + [3, 4, 5], GREEDY)
    run_to_end(engine)
    assert counted(engine) - start == len(prompt) + 3 - 2 * BLOCK_SIZE


def test_received_kv_counts_nothing_and_a_recompute_counts_all(engines):
    prefill, decode = engines
    prompt = [(11 * i) % 60 + 2 for i in range(50)]
    p_start, d_start = counted(prefill), counted(decode)
    prefill.add_request("r", prompt, GREEDY, export_kv=True)
    decode.reserve_remote_prefill("r", prompt, GREEDY)
    first = run_to_end(prefill)["r"]
    assert decode.complete_remote_prefill("r", first[0], prefill.pop_exported_kv("r"))
    run_to_end(decode)
    assert counted(prefill) - p_start == len(prompt)
    assert counted(decode) == d_start
    other = [(13 * i) % 70 + 3 for i in range(40)]
    decode.reserve_remote_prefill("lost", other, GREEDY)  # its KV never comes
    assert decode.resume_locally("lost", [first[0]])
    run_to_end(decode)
    assert counted(decode) - d_start == len(other) + 1  # the prompt and the streamed token
