"""One layer's causal prefill attention on CPU: pdserve's C++ kernel against torch's flash.

SmolLM2-135M's heads by default (9 query heads, 3 KV heads, head_dim 64), random inputs,
fp32 (what prefills attend in on CPUs without native bf16: ``cpu_flash_f32.cpp``) or bf16
(the AVX512-BF16 kernel, ``cpu_prefill_attention.cpp``, where the CPU has it). Each case is
a chunk of ``n`` queries after ``ctx`` cached positions (a whole prompt: ``ctx`` 0), as the
torch backend runs it: torch's flash kernel causal, or for a chunk after context an unmasked
pass over the context plus a causal pass over the chunk merged by log-sum-exp. The two run
alternately, best of ``--repeat``; prints ms per layer, GFLOP/s (4 x D x H x (n x ctx +
n^2 / 2)) and the speed-up, and the largest difference between the two outputs.

    python bench/cpu_prefill_attention.py [--dtype float32|bfloat16] [--cases 1500:0,...]
        [--heads 9] [--kv-heads 3] [--head-dim 64] [--repeat 7] [--threads N]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--cases", default="128:0,1500:0,2048:0,952:2048",
                   help="comma-separated n:ctx (queries : cached positions before them)")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeat", type=int, default=7, help="timed runs of each (best is kept)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    return p.parse_args()


def torch_attention(q, k, v, ctx: int, scale: float) -> torch.Tensor:
    """The torch backend's path: ``[n, H, D]`` queries, ``[ctx + n, Hkv, D]`` K/V."""
    from pdserve.engine.kernels.chunk_attention import context_then_causal

    qp, kp, vp = (t.transpose(0, 1)[None] for t in (q, k, v))
    if ctx == 0:
        out = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale,
                                             enable_gqa=True)
    else:
        out = context_then_causal(qp, kp, vp, ctx, scale)
    return out[0].transpose(0, 1)


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from pdserve.engine.kernels.cpu_build import cpu_flags
    from pdserve.engine.kernels.cpu_prefill_attention import prefill_attention

    dtype = getattr(torch, args.dtype)
    h, hkv, d = args.heads, args.kv_heads, args.head_dim
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx2", "avx512_bf16", "amx")))
    print(f"{args.dtype}, {h} heads / {hkv} KV heads of {d}, {torch.get_num_threads()} "
          f"threads, CPU flags {' '.join(flags)}")
    gen = torch.Generator().manual_seed(0)
    for case in args.cases.split(","):
        n, ctx = (int(x) for x in case.split(":"))
        q = torch.randn(n, h, d, generator=gen).to(dtype)
        k = torch.randn(ctx + n, hkv, d, generator=gen).to(dtype)
        v = torch.randn(ctx + n, hkv, d, generator=gen).to(dtype)
        runs = {"torch": lambda: torch_attention(q, k, v, ctx, d**-0.5),
                "pdserve": lambda: prefill_attention(q, k, v, ctx, d**-0.5)}
        outs = {name: f() for name, f in runs.items()}  # warm-up (and the kernel's build)
        best = dict.fromkeys(runs, float("inf"))
        for _ in range(args.repeat):
            for name, f in runs.items():
                t0 = time.perf_counter()
                f()
                best[name] = min(best[name], time.perf_counter() - t0)
        flops = 4 * d * h * (n * ctx + n * n / 2)
        diff = (outs["pdserve"].float() - outs["torch"].float()).abs().max().item()
        print(f"n={n:5d} ctx={ctx:5d}: " + "  ".join(
            f"{name} {s * 1e3:7.2f} ms {flops / s / 1e9:5.0f} GFLOP/s" for name, s in
            best.items()) + f"  speed-up {best['torch'] / best['pdserve']:.2f}x"
            f"  max |diff| {diff:.1e}")


if __name__ == "__main__":
    main()
