"""Offline decode throughput: pdserve's engine vs transformers generate(), same prompts, same run.

SmolLM2-135M-Instruct in bf16 on CPU (2 threads by default): 32 requests of unique random
128-token prompts, 64 output tokens each, ignore_eos. Prints output tokens/s of both, the
ratio, peak RSS and the KV cache size.

    python bench/offline_throughput.py [--num-requests 32] [--input-len 128] [--output-len 64]
"""

from __future__ import annotations

import argparse
import random
import resource
import time

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model path (default: embedded SmolLM2)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--skip-transformers", action="store_true")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    from pdserve.engine import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, load_progress=False)
    vocab = llm.engine.arch.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, vocab) for _ in range(args.input_len)]
               for _ in range(args.num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)

    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4, ignore_eos=True),
                 detokenize=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, detokenize=False)
    ours_s = time.perf_counter() - t0
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    ours_tps = num_out / ours_s
    print(f"pdserve:      {num_out} tokens in {ours_s:.2f} s = {ours_tps:.1f} output tok/s")
    print(f"KV cache:     {llm.engine.runner.num_kv_blocks} blocks x {llm.engine.config.block_size}"
          f" tokens = {llm.engine.runner.kv_cache_bytes / 2**20:.1f} MiB")
    rss_after_ours = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS:     {rss_after_ours:.0f} MiB (pdserve engine loaded and run)")
    if args.skip_transformers:
        return

    from transformers import AutoModelForCausalLM

    path = llm.engine.model_path
    if path.suffix == ".gguf":
        raise SystemExit("run `pdserve pull` first: transformers loads GGUF weights packed")
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, args.dtype))
    hf.eval()
    ids = torch.tensor(prompts)
    with torch.no_grad():
        hf.generate(ids[:1, :16], max_new_tokens=4, do_sample=False)  # warm-up
        t0 = time.perf_counter()
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.output_len,
                          min_new_tokens=args.output_len, do_sample=False)
        hf_s = time.perf_counter() - t0
    hf_out = (out.shape[1] - args.input_len) * out.shape[0]
    hf_tps = hf_out / hf_s
    print(f"transformers: {hf_out} tokens in {hf_s:.2f} s = {hf_tps:.1f} output tok/s")
    print(f"ratio:        {ours_tps / hf_tps:.2f}x transformers (target >= 2.0x)")


if __name__ == "__main__":
    main()
