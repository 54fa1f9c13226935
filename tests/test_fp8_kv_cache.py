"""FP8 e4m3 KV cache (``kv_cache_dtype="fp8"``): memory, remote-prefill blocks, and quality
on SmolLM2 against the bf16 cache (greedy tokens, perplexity on the held text)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.fp8 import dequantize_blocks, quantize_blocks
from pdserve.offline.perplexity import held_text, perplexity
from test_engine_equivalence import make_prompts


def tiny_engine(path, **config) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), dtype="bfloat16", load_progress=False,
                                  **config))


def test_fp8_cache_holds_twice_the_blocks_of_bf16(tiny_llama_checkpoint):
    path, model = tiny_llama_checkpoint
    cfg = model.config
    budget = 1 << 20
    bf16 = tiny_engine(path, kv_cache_memory_bytes=budget).runner
    fp8 = tiny_engine(path, kv_cache_memory_bytes=budget, kv_cache_dtype="fp8").runner
    layers, heads = cfg.num_hidden_layers, cfg.num_key_value_heads
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    elems_per_block = 2 * layers * 16 * heads * head_dim  # K and V, block_size 16
    assert bf16.num_kv_blocks == budget // (2 * elems_per_block)
    assert fp8.num_kv_blocks == budget // (elems_per_block + 2 * layers * heads * 4)
    assert fp8.kv_cache.dtype == torch.float8_e4m3fn
    assert fp8.kv_scales.shape == (layers, 2, fp8.num_kv_blocks, heads)
    assert fp8.kv_cache_bytes == fp8.num_kv_blocks * (elems_per_block + 2 * layers * heads * 4)
    assert fp8.num_kv_blocks > 1.9 * bf16.num_kv_blocks


def test_received_blocks_are_stored_with_the_wire_quantization(tiny_llama_checkpoint):
    """A remote prefill's KV written into an FP8 cache reads back as the wire format's
    dequantized blocks (positions past the prompt zeroed first)."""
    path, _ = tiny_llama_checkpoint
    engine = tiny_engine(path, num_kv_blocks=16, max_model_len=256, kv_cache_dtype="fp8")
    runner = engine.runner
    shape = (runner.kv_cache.shape[0], 2, 3, 16, *runner.kv_cache.shape[4:])
    kv = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    runner.write_kv_blocks([5, 2, 9], kv, num_tokens=40)
    kv[:, :, 2, 8:] = 0  # tokens 40..47 of the last block are not the prompt's
    payload, scales = quantize_blocks(kv)
    want = dequantize_blocks(payload, scales, torch.bfloat16)
    assert torch.equal(runner.read_kv_blocks([5, 2, 9]), want)


def test_fp8_cache_blocks_cross_the_wire_without_requantizing(tiny_llama_checkpoint):
    """FP8 codes + scales read from one FP8 cache, encoded, decoded and written into
    another FP8 cache arrive bit for bit."""
    from pdserve.kvtransfer.wire import decode_kv, encode_kv

    path, _ = tiny_llama_checkpoint
    src = tiny_engine(path, num_kv_blocks=16, max_model_len=256, kv_cache_dtype="fp8").runner
    dst = tiny_engine(path, num_kv_blocks=16, max_model_len=256, kv_cache_dtype="fp8").runner
    shape = (src.kv_cache.shape[0], 2, 2, 16, *src.kv_cache.shape[4:])
    src.write_kv_blocks([3, 7], torch.randn(shape, generator=torch.Generator().manual_seed(1)),
                        num_tokens=29)
    codes, scales = src.read_fp8_kv_blocks([3, 7])
    enc = encode_kv("r", codes, layer_start=0, num_tokens=29, use_fp8=True, scales=scales)
    got = decode_kv(enc.header, enc.payload.tobytes(), enc.scales.tobytes())
    dst.write_kv_blocks([9, 0], got.values, num_tokens=29, scales=got.scales)
    got_codes, got_scales = dst.read_fp8_kv_blocks([9, 0])
    assert torch.equal(got_codes.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(got_scales, scales)
    with pytest.raises(ValueError, match="scales"):
        encode_kv("r", codes, layer_start=0, num_tokens=29, use_fp8=True)


@pytest.mark.slow
def test_fp8_prefill_worker_to_fp8_decode_worker_equals_colocated(tiny_llama_checkpoint):
    """Blocks exported from an FP8 cache and stored into another FP8 cache keep their codes
    (re-quantizing a dequantized block whose absmax sits on 448 reproduces it), so decoding
    from them gives the tokens of one FP8 engine doing everything."""
    from test_engine_remote_prefill import GREEDY, run_to_end

    path, _ = tiny_llama_checkpoint
    kw = dict(dtype="float32", load_progress=False, block_size=16, max_num_batched_tokens=64,
              kv_cache_dtype="fp8")
    prefill, decode, colocated = (LLM(str(path), **kw).engine, LLM(str(path), **kw).engine,
                                  LLM(str(path), **kw))
    prompts = make_prompts([40, 21], seed=3)  # partial last blocks
    expected = [o.outputs[0].token_ids
                for o in colocated.generate(prompts, GREEDY, detokenize=False)]
    for i, p in enumerate(prompts):
        prefill.add_request(f"r{i}", p, GREEDY, export_kv=True)
        decode.reserve_remote_prefill(f"r{i}", p, GREEDY)
    first = run_to_end(prefill)
    for i in range(len(prompts)):
        assert decode.complete_remote_prefill(f"r{i}", first[f"r{i}"][0],
                                              prefill.pop_exported_kv(f"r{i}"))
    rest = run_to_end(decode)
    assert [first[f"r{i}"] + rest[f"r{i}"] for i in range(len(prompts))] == expected


@pytest.mark.slow
def test_fp8_cache_perplexity_agrees_across_backends(tiny_llama_checkpoint):
    """Torch (reference) and Triton backends over an FP8 cache, chunked so later chunks read
    K/V back from it: the same perplexity up to the one FP8 rounding of a fresh prefill's
    own K/V (torch attends to them unrounded); the fp32 caches agree to fp32 precision."""
    path, _ = tiny_llama_checkpoint
    text = make_prompts([48], seed=5)[0]
    ppl = {}
    for backend in ("torch", "triton"):
        for kv_dtype in ("auto", "fp8"):
            llm = LLM(str(path), dtype="float32", load_progress=False, block_size=8,
                      max_model_len=256, kv_cache_dtype=kv_dtype, attention_backend=backend)
            ppl[backend, kv_dtype] = perplexity(llm.engine, text, chunk_size=16)
    assert ppl["triton", "auto"] == pytest.approx(ppl["torch", "auto"], rel=1e-5)
    assert ppl["triton", "fp8"] == pytest.approx(ppl["torch", "fp8"], rel=2e-3)
    assert ppl["torch", "fp8"] != ppl["torch", "auto"]  # the cache really is quantized


SMOLLM2_PROMPTS = [
    "The capital of France is", "Once upon a time, there was a",
    "The best way to learn programming is", "Water boils at", "In 1492, Columbus",
    "The theory of relativity states that", "My favourite food is", "The stock market today",
    "To make a cup of tea, first", "Photosynthesis is the process",
]


@pytest.mark.slow
def test_smollm2_fp8_cache_quality_against_bf16_cache():
    """10 prompts x 64 greedy tokens and perplexity on 512 held-text tokens, bf16 compute.

    Perplexity must stay within 2 % of the bf16 cache's (measured: 49.72 -> 50.11, +0.8 %);
    greedy continuations are reported (they part at near-ties, as any KV rounding does).
    """
    from transformers import AutoTokenizer

    results = {}
    for kv_dtype in ("auto", "fp8"):
        llm = LLM(None, dtype="bfloat16", kv_cache_dtype=kv_dtype, load_progress=False,
                  max_model_len=1024, num_kv_blocks=256)
        tok = AutoTokenizer.from_pretrained(str(llm.engine.model_path))
        prompts = [tok(p)["input_ids"] for p in SMOLLM2_PROMPTS]
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64,
                                                    ignore_eos=True), detokenize=False)
        text = tok(held_text())["input_ids"][:512]
        results[kv_dtype] = ([o.outputs[0].token_ids for o in outs],
                             perplexity(llm.engine, text, chunk_size=256))
    (bf16_tokens, bf16_ppl), (fp8_tokens, fp8_ppl) = results["auto"], results["fp8"]
    same_prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
                   for x, y in zip(bf16_tokens, fp8_tokens)]
    print(f"\nFP8 KV vs bf16 KV on SmolLM2: perplexity {fp8_ppl:.3f} vs {bf16_ppl:.3f} "
          f"({100 * (fp8_ppl / bf16_ppl - 1):+.2f} %); identical continuations "
          f"{sum(p == 64 for p in same_prefix)}/10, common prefixes {same_prefix}")
    assert abs(fp8_ppl / bf16_ppl - 1) <= 0.02
    assert all(p >= 1 for p in same_prefix)  # every first token agrees


def test_kv_cache_dtype_is_validated_and_reaches_workers():
    import argparse

    from pdserve.engine.entrypoints.arg_utils import (
        add_engine_args,
        engine_args_to_argv,
        engine_config_from_args,
    )

    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--kv-cache-dtype", "fp8", "--enforce-eager"])
    cfg = engine_config_from_args(args, None)
    assert (cfg.kv_cache_dtype, cfg.enforce_eager) == ("fp8", True)
    assert cfg.resolve_kv_cache_dtype(torch.bfloat16) == torch.float8_e4m3fn
    argv = engine_args_to_argv(args)  # what a launched worker process gets
    again = engine_config_from_args(parser.parse_args(argv), None)
    assert (again.kv_cache_dtype, again.enforce_eager) == ("fp8", True)


@pytest.mark.slow
def test_fp8_cache_blocks_stream_over_the_wire_as_stored(tiny_llama_checkpoint):
    """FP8 cache -> FP8 cache through the real sender thread, wire format and inbox (inproc
    transport), layer by layer: the decode worker's cache holds the prefill's codes and
    scales bit for bit (nothing is re-quantized, even with --kv-transfer-dtype auto), and
    decoding from them gives the colocated FP8 engine's tokens."""
    import queue

    from test_engine_remote_prefill import GREEDY, run_to_end

    from pdserve.decode_worker.kv_inbox import KVInbox
    from pdserve.prefill_worker.kv_sender import KVJob, KVSenderThread

    path, _ = tiny_llama_checkpoint
    kw = dict(dtype="float32", load_progress=False, block_size=16, max_num_batched_tokens=64,
              kv_cache_dtype="fp8")
    prefill, decode, colocated = (LLM(str(path), **kw).engine, LLM(str(path), **kw).engine,
                                  LLM(str(path), **kw))
    prompts = make_prompts([40, 90], seed=6)
    expected = [o.outputs[0].token_ids
                for o in colocated.generate(prompts, GREEDY, detokenize=False)]
    num_layers = prefill.arch.num_layers
    inbox = KVInbox("inproc", num_layers, decode.runner.dtype, keep_fp8=True)
    done: queue.Queue = queue.Queue()
    sender = KVSenderThread("inproc", False, 10.0, lambda *a: done.put(a))  # "auto"
    sender.transport = inbox.transport  # inproc: one transport object holds the queues
    prefill.kv_layer_sink = lambda rid, layer, kv, scales, n: sender.submit(KVJob(
        rid, kv, n, inbox.address, layer_start=layer, num_layers=num_layers, scales=scales))
    try:
        for i, p in enumerate(prompts):
            prefill.add_request(f"r{i}", p, GREEDY, export_kv=True)
            decode.reserve_remote_prefill(f"r{i}", p, GREEDY)
        first = run_to_end(prefill)
        reports = sorted(done.get(timeout=10) for _ in prompts)
        assert [r[0] for r in reports] == ["r0", "r1"], reports
        assert all(r[3] is None for r in reports), reports
        assert all(0 < r[4] <= r[2] for r in reports), reports  # pushing is part of it
        received = dict(inbox.ready.get(timeout=10) for _ in prompts)
    finally:
        sender.close()
        inbox.close()
    for i, p in enumerate(prompts):
        kv, scales, hidden, _ = received[f"r{i}"]
        assert hidden is None  # no hidden section was announced
        assert kv.dtype == torch.float8_e4m3fn and scales is not None
        assert decode.complete_remote_prefill(f"r{i}", first[f"r{i}"][0], kv, scales)
        n = decode.block_manager.num_blocks_for(len(p))
        got = decode.runner.read_fp8_kv_blocks(decode.requests[f"r{i}"].block_table[:n])
        assert torch.equal(got[0].view(torch.uint8), kv.view(torch.uint8))
        assert torch.equal(got[1], scales)
    rest = run_to_end(decode)
    assert [first[f"r{i}"] + rest[f"r{i}"] for i in range(len(prompts))] == expected
