"""HTTP path vs offline engine: 32 concurrent streaming requests, same run.

Starts `pdserve serve` (unless --base-url is given), sends N concurrent streaming
completion requests (unique random 128-token prompts as token ids, 64 output tokens,
ignore_eos), and reports output tok/s with TTFT/TPOT p50/p99. Then it stops the server and
runs the offline engine on the same requests in this process, and prints the ratio.

    python bench/serve_throughput.py [--num-requests 32] [--input-len 128] [--output-len 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


async def one_request(http: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                      output_len: int) -> tuple[float, list[float], int]:
    """Returns (ttft_s, token arrival times, num tokens)."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    arrivals: list[float] = []
    num_tokens = 0
    async with http.stream("POST", url, json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                arrivals.append(time.perf_counter())
    return arrivals[0] - start, arrivals, num_tokens


async def run_http(base_url: str, model: str, prompts: list[list[int]], output_len: int):
    async with httpx.AsyncClient(timeout=600) as http:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_request(http, f"{base_url}/completions", model, p,
                                                     output_len) for p in prompts))
        elapsed = time.perf_counter() - t0
    return results, elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default=None, help="use a running server (…/v1)")
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    args = p.parse_args()

    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 49000) for _ in range(args.input_len)]
               for _ in range(args.num_requests)]
    server = None
    base_url = args.base_url
    if base_url is None:
        from server_utils import ServerProcess

        server = ServerProcess("--max-num-seqs", "256")
        base_url = server.base_url
    try:
        asyncio.run(run_http(base_url, args.model, prompts[:2], 4))  # warm-up
        results, elapsed = asyncio.run(run_http(base_url, args.model, prompts, args.output_len))
    finally:
        if server is not None:
            server.stop()
    num_out = sum(r[2] for r in results)
    ttfts = [r[0] for r in results]
    tpots = [(r[1][-1] - r[1][0]) / (len(r[1]) - 1) for r in results if len(r[1]) > 1]
    http_tps = num_out / elapsed
    print(f"HTTP:    {num_out} tokens in {elapsed:.2f} s = {http_tps:.1f} output tok/s")
    print(f"  TTFT p50 {pct(ttfts, 50) * 1000:.0f} ms  p99 {pct(ttfts, 99) * 1000:.0f} ms")
    print(f"  TPOT p50 {pct(tpots, 50) * 1000:.1f} ms  p99 {pct(tpots, 99) * 1000:.1f} ms"
          f"  (mean {statistics.mean(tpots) * 1000:.1f} ms)")

    from pdserve.engine import LLM, SamplingParams

    llm = LLM(None, load_progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4), detokenize=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, detokenize=False)
    off_s = time.perf_counter() - t0
    off_tps = sum(len(o.outputs[0].token_ids) for o in outs) / off_s
    print(f"offline: {off_tps:.1f} output tok/s")
    print(f"ratio:   HTTP / offline = {http_tps / off_tps:.2f} (target >= 0.85)")


if __name__ == "__main__":
    main()
