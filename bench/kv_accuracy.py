"""Greedy-token fidelity of KV sent over the wire, per codec, in process.

For each long prompt an engine P prefills it (``export_kv``) and samples the first token;
its KV goes through a codec (below) into a second engine D (prefix caching off), which
decodes the rest. The reference is the same model colocated. Prints, per codec, how many
prompts keep all ``--max-tokens`` greedy tokens, the first-mismatch positions, and the
reference's top-2 logprob gap at each mismatch (a gap near 0 is a near-tie that any
perturbation of the KV can flip).

Codecs: ``exact`` (the KV as computed), ``bf16`` (rounded to bf16: the wire with
``--kv-transfer-dtype auto`` on a bf16 model), ``fp8`` (the shipped wire codec: e4m3, one
fp32 scale per (layer, K/V, block, KV head) from the absmax), ``int8`` (a reference, not a
wire format: symmetric int8 with the same scale layout).

Prompts: the 10 of ``tests/test_disaggregated_e2e.py::test_fp8_kv_keeps_greedy_tokens...``
(sentences shuffled from a fixed list, ~620 tokens), and ``--num-brown`` passages of
held-out Brown-corpus files (first 600 tokens).

    python bench/kv_accuracy.py [--dtype float32|bfloat16] [--num-brown 20]
                                [--codecs exact,bf16,fp8,int8] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def int8_reference(kv: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 with one scale per (layer, K/V, block, KV head); returns kv.dtype."""
    x = kv.float()
    scale = x.abs().amax(dim=(3, 5), keepdim=True).clamp_min(1e-30) / 127
    return (torch.round(x / scale) * scale).to(kv.dtype)


def fp8_wire(kv: torch.Tensor) -> torch.Tensor:
    """The shipped FP8 wire codec, encode then decode."""
    from pdserve.fp8 import dequantize_blocks, quantize_blocks

    codes, scales = quantize_blocks(kv)
    return dequantize_blocks(codes, scales, kv.dtype)


CODECS = {
    "exact": lambda kv: kv,
    "bf16": lambda kv: kv.to(torch.bfloat16).to(kv.dtype),
    "fp8": fp8_wire,
    "int8": int8_reference,
}


def load_prompts(tokenizer, num_brown: int) -> list[list[int]]:
    from pdserve.offline.eagle.data import (fetch_brown_corpus, read_brown_files,
                                                       split_brown_files)
    from test_disaggregated_e2e import long_prompt

    prompts = [tokenizer.encode(long_prompt(200 + seed)) for seed in range(10)]
    files = read_brown_files(fetch_brown_corpus())
    _, held_out = split_brown_files(list(files))
    for name in held_out[:num_brown]:
        prompts.append(tokenizer.encode(" ".join(files[name]))[:600])
    return prompts


def run_engine(engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-brown", type=int, default=20)
    p.add_argument("--codecs", default=",".join(CODECS))
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args()
    codecs = args.codecs.split(",")
    unknown = sorted(set(codecs) - set(CODECS))
    if unknown:
        p.error(f"unknown codec(s) {unknown}; choose from {sorted(CODECS)}")

    from pdserve.engine import LLM, SamplingParams

    kw = dict(dtype=args.dtype, load_progress=False)
    colocated = LLM(None, **kw)
    prefill = LLM(None, **kw).engine
    decode = LLM(None, enable_prefix_caching=False, **kw).engine
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    ref_params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                                logprobs=2)
    first_only = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prompts = load_prompts(colocated.tokenizer, args.num_brown)
    first_mismatch: dict[str, list[int]] = {c: [] for c in codecs}
    gaps: dict[str, list[float]] = {c: [] for c in codecs}
    t0 = time.perf_counter()
    for prompt in prompts:
        ref = colocated.generate([prompt], ref_params, detokenize=False)[0].outputs[0]
        prefill.add_request("r", prompt, first_only, export_kv=True)
        first = run_engine(prefill)["r"][0]
        kv = prefill.pop_exported_kv("r")
        for codec in codecs:
            decode.reserve_remote_prefill("r", prompt, greedy)
            decode.complete_remote_prefill("r", first, CODECS[codec](kv))
            got = [first] + run_engine(decode)["r"]
            n = next((i for i, (a, b) in enumerate(zip(ref.token_ids, got)) if a != b),
                     args.max_tokens)
            first_mismatch[codec].append(n)
            if n < args.max_tokens:
                top = ref.logprobs[n].top_logprobs
                gaps[codec].append(top[0] - top[1])
    print(f"SmolLM2-135M {args.dtype}, {args.max_tokens} greedy tokens, "
          f"{time.perf_counter() - t0:.0f} s")
    for codec in codecs:
        m = first_mismatch[codec]
        print(f"{codec:6s} test prompts {sum(x == args.max_tokens for x in m[:10])}/10, "
              f"Brown {sum(x == args.max_tokens for x in m[10:])}/{len(m) - 10}; "
              f"first mismatch {m}")
        if gaps[codec]:
            print(f"{'':6s} reference top-2 gap at mismatches: "
                  + " ".join(f"{g:.3f}" for g in sorted(gaps[codec])))


if __name__ == "__main__":
    main()
