"""The engine's greedy tokens equal transformers' on tiny random Llama/Qwen2/Qwen3 models."""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from pdserve.engine import LLM, SamplingParams

PROMPT_LENS = [1, 5, 17, 33, 64, 100, 211, 300]
NUM_NEW_TOKENS = 32


def make_prompts(lens: list[int], seed: int = 1, vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lens]


def hf_greedy(model, prompt: list[int], num_new: int) -> list[int]:
    """transformers generate(), one prompt at a time (no padding to perturb the reference)."""
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_new,
                             min_new_tokens=num_new, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def reference(tiny_model):
    arch, path, model = tiny_model
    prompts = make_prompts(PROMPT_LENS)
    return arch, path, prompts, [hf_greedy(model, p, NUM_NEW_TOKENS) for p in prompts]


GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)


def run_engine(path, prompts, **config) -> tuple[LLM, list[list[int]]]:
    llm = LLM(str(path), dtype="float32", load_progress=False, **config)
    outs = llm.generate(prompts, GREEDY, detokenize=False)
    return llm, [o.outputs[0].token_ids for o in outs]


def test_batched_greedy_matches_transformers(reference):
    _, path, prompts, expected = reference
    llm, got = run_engine(path, prompts, block_size=16)
    assert got == expected
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.parametrize("chunk", [64, 160])
def test_chunked_prefill_matches_transformers(reference, chunk):
    """Chunks of up to 64 rows after a context attend per KV head with a mask; longer ones
    as a context pass plus a causal pass merged (pdserve/engine/kernels/chunk_attention.py)."""
    _, path, prompts, expected = reference
    llm, got = run_engine(path, prompts, block_size=8, max_num_batched_tokens=chunk)
    assert max(PROMPT_LENS) > chunk  # the longest prompt really is split over steps
    assert got == expected


def test_prefix_cache_hits_and_matches_transformers(tiny_model):
    arch, path, model = tiny_model
    shared = make_prompts([120], seed=7)[0]
    suffixes = make_prompts([3, 9, 20, 40], seed=8)
    prompts = [shared + s for s in suffixes]
    expected = [hf_greedy(model, p, NUM_NEW_TOKENS) for p in prompts]
    llm = LLM(str(path), dtype="float32", load_progress=False, block_size=16)
    llm.generate([shared], GREEDY, detokenize=False)  # warm the prefix cache
    outs = llm.generate(prompts, GREEDY, detokenize=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.block_manager.num_prefix_hit_tokens >= 4 * 112
    assert all(o.num_cached_tokens == 112 for o in outs)  # 7 full blocks of 16


def test_preemption_finishes_with_same_tokens(reference):
    _, path, prompts, expected = reference
    small = [p for p in prompts if len(p) <= 64]
    want = [e for p, e in zip(prompts, expected) if len(p) <= 64]
    # 5 requests need ~25 blocks of 16 at their longest; give the pool 12.
    llm, got = run_engine(path, small, block_size=16, num_kv_blocks=12, max_model_len=192,
                          enable_prefix_caching=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == want
    assert llm.engine.num_free_blocks == 12


def test_abort_mid_generation_returns_every_block(reference):
    _, path, prompts, _ = reference
    llm = LLM(str(path), dtype="float32", load_progress=False, block_size=16,
              max_num_batched_tokens=128)
    engine = llm.engine
    initial = engine.num_free_blocks
    params = SamplingParams(temperature=0.8, max_tokens=64, ignore_eos=True, seed=3)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    for _ in range(6):  # some decoding, some still prefilling or waiting
        engine.step()
    assert engine.num_free_blocks < initial
    for i in range(len(prompts)):
        assert engine.abort_request(f"r{i}")
    assert engine.num_free_blocks == initial
    assert not engine.has_unfinished_requests
    assert engine.step() == []


def test_prompt_logprobs_match_transformers_across_chunks_and_a_warm_prefix_cache(tiny_model):
    """Prompt logprobs (OpenAI echo + logprobs) equal transformers' log-softmax at every
    prompt position, when the prompt is split over prefill chunks and when the prefix
    cache already holds it (such a request skips the cache rather than lose positions)."""
    arch, path, model = tiny_model
    prompt = make_prompts([150], seed=21)[0]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    want = ref[:-1].gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
    llm = LLM(str(path), dtype="float32", load_progress=False, block_size=16,
              max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    llm.generate([prompt], GREEDY, detokenize=False)  # the prompt is now in the prefix cache
    for out in llm.generate([prompt, prompt], params, detokenize=False):
        lps = out.prompt_logprobs
        assert [lp.token_id for lp in lps] == prompt[1:]
        got = torch.tensor([lp.logprob for lp in lps])
        torch.testing.assert_close(got, want, atol=2e-4, rtol=0)
        top = ref[:-1].topk(3, dim=-1).indices
        agree = sum(lp.top_token_ids == t.tolist() for lp, t in zip(lps, top))
        assert agree >= len(lps) - 2  # ties in fp32 may swap neighbours
        assert all(lp.rank == int((r > r[t]).sum()) + 1
                   for lp, r, t in zip(lps[:5], ref[:5], prompt[1:6]))
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks
    plain = llm.generate([prompt], GREEDY, detokenize=False)[0]
    assert plain.prompt_logprobs is None


@pytest.mark.parametrize("dropped", ["mlp.down_proj.weight", "self_attn.v_proj.weight",
                                     "mlp.up_proj.weight"])
def test_a_checkpoint_without_a_weight_is_refused_and_init_is_restored(tiny_llama_checkpoint,
                                                                       tmp_path, dropped):
    """Models are built without random init (the loader writes every weight), so a
    checkpoint lacking one weight, also one shard of a fused layer (v of qkv, up of
    gate_up), must be refused, not served with uninitialized memory; and ``nn.Linear``
    initializes again after the build, also after a failed one."""
    from safetensors.torch import load_file, save_file

    path, _ = tiny_llama_checkpoint
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    tensors = load_file(path / "model.safetensors")
    del tensors[f"model.layers.1.{dropped}"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing parameters.*layers\.1\.(mlp|self_attn)\."):
        LLM(str(tmp_path), dtype="float32", load_progress=False)
    torch.manual_seed(0)
    weight = torch.nn.Linear(64, 64).weight
    assert weight.abs().max() <= 1 / 8 and weight.std() > 0.03  # kaiming-uniform bounds
