"""The engine with the Triton attention backend (kernels in Triton's interpreter on CPU)
gives transformers' greedy tokens on a tiny Llama: batched, chunked prefill, prefix cache."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.attention.base import default_backend_name, get_backend
from test_engine_equivalence import hf_greedy, make_prompts

NUM_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)


def generate(path, prompts, **config) -> tuple[LLM, list[list[int]]]:
    llm = LLM(str(path), dtype="float32", load_progress=False, attention_backend="triton",
              **config)
    outs = llm.generate(prompts, GREEDY, detokenize=False)
    return llm, [o.outputs[0].token_ids for o in outs]


def test_triton_is_the_default_on_cuda_only():
    assert default_backend_name(torch.device("cuda")) == "triton"
    assert default_backend_name(torch.device("cpu")) == "torch"
    assert get_backend("triton", torch.device("cpu")).name == "triton"  # interpreter here


@pytest.mark.slow
def test_batched_greedy_matches_transformers(tiny_llama_checkpoint):
    path, model = tiny_llama_checkpoint
    prompts = make_prompts([1, 7, 23, 40])
    expected = [hf_greedy(model, p, NUM_NEW) for p in prompts]
    llm, got = generate(path, prompts, block_size=16)
    assert got == expected
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.slow
def test_chunked_prefill_and_prefix_cache_match_transformers(tiny_llama_checkpoint):
    path, model = tiny_llama_checkpoint
    shared = make_prompts([21], seed=7)[0]
    prompts = [shared + s for s in make_prompts([3, 11], seed=8)]
    expected = [hf_greedy(model, p, NUM_NEW) for p in prompts]
    llm = LLM(str(path), dtype="float32", load_progress=False, attention_backend="triton",
              block_size=4, max_num_batched_tokens=8)
    llm.generate([shared], GREEDY, detokenize=False)  # warm the prefix cache
    outs = llm.generate(prompts, GREEDY, detokenize=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.num_cached_tokens == 20 for o in outs)  # 5 full blocks of 4, chunks of 8
