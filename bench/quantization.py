"""Decode throughput and memory per weight quantization method, SmolLM2 on CPU, same run.

Each method runs in its own child process (so peak RSS is its own): load, one warm-up, then
decode at batch 1 and batch 32 (unique random 32-token prompts, 32 output tokens each,
ignore_eos, greedy), plus weight bytes (quantized layers vs their bf16 size). Prints one
markdown table. AWQ/GPTQ rows need checkpoints written by ``pdserve quantize``.

    python bench/quantization.py [--methods none,gguf,fp8,rtn-int4,rtn-int8]
        [--awq-checkpoint DIR] [--gptq-checkpoint DIR] [--output-len 32] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default="none,gguf,fp8,rtn-int4,rtn-int8")
    p.add_argument("--awq-checkpoint", default=None, help="folder from pdserve quantize")
    p.add_argument("--gptq-checkpoint", default=None, help="folder from pdserve quantize")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args()


def run_one(label: str, model: str | None, quantization: str | None,
            args: argparse.Namespace) -> dict:
    """Measure one configuration in this process; returns the row as a dict."""
    import torch

    torch.set_num_threads(args.threads)
    from pdserve.engine import LLM, SamplingParams

    llm = LLM(model, dtype=args.dtype, load_progress=False, quantization=quantization,
              num_kv_blocks=512)
    mem = llm.engine.runner.weight_memory
    vocab = llm.engine.arch.vocab_size
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([[rng.randrange(1000, vocab) for _ in range(8)]],
                 SamplingParams(max_tokens=2, ignore_eos=True), detokenize=False)
    row = {"method": label, "weight_MiB": mem.total_bytes / 2**20,
           "quantized_ratio": mem.quantized_ratio}
    for batch in (1, 32):
        prompts = [[rng.randrange(1000, vocab) for _ in range(args.input_len)]
                   for _ in range(batch)]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, detokenize=False)
        elapsed = time.perf_counter() - t0
        row[f"tok_s_b{batch}"] = sum(len(o.outputs[0].token_ids) for o in outs) / elapsed
    row["peak_rss_MiB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return row


def main() -> None:
    args = parse_args()
    if args.child:
        label, model, quant = json.loads(args.child)
        print(json.dumps(run_one(label, model, quant, args)))
        return
    configs = [(m, None, None if m == "none" else m) for m in args.methods.split(",")]
    if args.awq_checkpoint:
        configs.append(("awq", args.awq_checkpoint, None))
    if args.gptq_checkpoint:
        configs.append(("gptq", args.gptq_checkpoint, None))
    rows = []
    for cfg in configs:
        argv = [sys.executable, __file__, "--child", json.dumps(cfg),
                "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                "--threads", str(args.threads), "--dtype", args.dtype]
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(f"done: {rows[-1]}", file=sys.stderr)
    print("| method | weights MiB | quantized / bf16 | decode tok/s b=1 | decode tok/s b=32 "
          "| peak RSS MiB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['weight_MiB']:.0f} | {r['quantized_ratio']:.3f} | "
              f"{r['tok_s_b1']:.1f} | {r['tok_s_b32']:.1f} | {r['peak_rss_MiB']:.0f} |")


if __name__ == "__main__":
    main()
