"""Why a repeated greedy prompt on a disaggregated server can answer differently from its
first (remote) answer, measured on the engines themselves (float32, no servers).

For each held-out Brown passage: a prefill engine (as a prefill worker runs it: eager,
``export_kv``) prefills it and samples the first token; its KV crosses a wire codec (exact,
or FP8 e4m3 with per-block, per-head scales: ``pdserve.fp8``, the wire's codec) into a
decode engine, which decodes the rest (the first, remote answer). The same passage is then
sent to that decode engine again: it holds the passage's full blocks in its prefix cache
(the KV it received) and computes only the tail (the repeat). A colocated engine's answer
is the reference. Reported per codec: answers equal to the reference and repeats equal to
the first answer; at each first divergence, the reference's top-2 logprob gap there and how
far the first token's logprob moved.

    python bench/greedy_repeat.py --passages 8 --out bench/results/<dir>/greedy_repeat.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.fp8 import dequantize_blocks, quantize_blocks

CODECS = {"exact": lambda kv: kv,
          "fp8": lambda kv: dequantize_blocks(*quantize_blocks(kv), kv.dtype)}


def load_passages(tokenizer, num: int, num_tokens: int) -> list[list[int]]:
    """The first ``num_tokens`` tokens of the first ``num`` held-out Brown files."""
    from pdserve.offline.eagle.data import (fetch_brown_corpus, read_brown_files,
                                            split_brown_files)

    files = read_brown_files(fetch_brown_corpus())
    _, held_out = split_brown_files(list(files))
    out = [ids[:num_tokens] for name in held_out
           if len(ids := tokenizer.encode(" ".join(files[name]))) >= num_tokens]
    return out[:num]


def drain(engine, rid: str) -> tuple[list[int], list]:
    """Step ``engine`` until idle; ``rid``'s tokens and logprobs."""
    tokens, logprobs = [], []
    while engine.has_unfinished_requests:
        for d in engine.step():
            if d.request_id == rid:
                tokens += d.new_token_ids
                logprobs += d.new_logprobs or []
    return tokens, logprobs


def first_divergence(a: tuple[list[int], list], b: tuple[list[int], list]) -> dict | None:
    """Where two answers first differ, with each one's top-2 logprob gap there."""
    for i, (x, y) in enumerate(zip(a[0], b[0])):
        if x != y:
            gap = [lp.top_logprobs[0] - lp.top_logprobs[1] for lp in (a[1][i], b[1][i])]
            return {"position": i, "top2_gap_nats": gap}
    return None


def run_passage(prefill, decode, colocated, prompt: list[int], params, n: int) -> dict:
    """One passage through every codec (see the module docstring)."""
    colocated.add_request(f"c{n}", prompt, params)
    ref = drain(colocated, f"c{n}")
    prefill.add_request(f"p{n}", prompt, params, export_kv=True)
    first = drain(prefill, f"p{n}")
    kv = prefill.pop_exported_kv(f"p{n}")
    out = {}
    for name, codec in CODECS.items():
        bm = decode.block_manager
        bm.__init__(bm.num_blocks, bm.block_size, True)  # forget earlier passages
        rid = f"{name}{n}"
        decode.reserve_remote_prefill(rid, prompt, params)
        decode.complete_remote_prefill(rid, first[0][0], codec(kv))
        rest = drain(decode, rid)
        remote = (first[0] + rest[0], first[1] + rest[1])
        decode.add_request(rid + "r", prompt, params)
        repeat = drain(decode, rid + "r")
        out[name] = {
            "remote_equals_colocated": remote[0] == ref[0],
            "repeat_equals_remote": repeat[0] == remote[0],
            "remote_vs_colocated": first_divergence(ref, remote),
            "repeat_vs_remote": first_divergence(remote, repeat),
            "first_token_logprob_shift": abs(repeat[1][0].logprob - remote[1][0].logprob),
        }
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--passages", type=int, default=8)
    p.add_argument("--num-tokens", type=int, default=640)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--out", default=None, help="JSON file for the per-passage results")
    args = p.parse_args()
    kw = dict(dtype="float32", load_progress=False, max_model_len=2048, num_kv_blocks=256)
    prefill = LLM(None, enforce_eager=True, **kw)
    decode, colocated = LLM(None, **kw).engine, LLM(None, **kw).engine
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                            logprobs=2)
    passages = load_passages(prefill.tokenizer, args.passages, args.num_tokens)
    results = []
    for n, prompt in enumerate(passages):
        start = time.monotonic()
        results.append(run_passage(prefill.engine, decode, colocated, prompt, params, n))
        print(f"passage {n}: {json.dumps(results[-1])} ({time.monotonic() - start:.0f} s)",
              flush=True)
    print(f"\n{len(passages)} passages x {args.max_tokens} greedy tokens, float32, "
          f"torch {torch.__version__}")
    print("| codec | remote = colocated | repeat = remote | first-token logprob shift "
          "(max) | top-2 gaps at repeat divergences |")
    print("|---|---|---|---|---|")
    for name in CODECS:
        rows = [r[name] for r in results]
        gaps = [round(min(r["repeat_vs_remote"]["top2_gap_nats"]), 4) for r in rows
                if r["repeat_vs_remote"]]
        print(f"| {name} | {sum(r['remote_equals_colocated'] for r in rows)}/{len(rows)} | "
              f"{sum(r['repeat_equals_remote'] for r in rows)}/{len(rows)} | "
              f"{max(r['first_token_logprob_shift'] for r in rows):.2e} | {gaps} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
