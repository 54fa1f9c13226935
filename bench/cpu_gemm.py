"""CPU GEMM form per row count: ``F.linear`` against ``cpu_linear``, same run, same weights.

Times one decode step's dense GEMMs of SmolLM2-135M-Instruct's shapes (30 layers of
q/k/v, o, gate/up and down projections plus the 49,152-row LM head; random fp32 weights,
~530 MB, so every step streams them from memory as serving does) at several row counts
(batch size, or batch x (k+1) under speculative decoding), and prints milliseconds per
step and the ratio. ``--weights`` adds the weight formats a decode step can read instead
of fp32: ``bf16`` (``F.linear`` on bf16 weights and activations, the path bf16 models take
for 1-2 rows), ``bf16-packed`` (the same weights reordered once into oneDNN's blocked
layout for AMX/AVX512-BF16, ``torch.ops.mkldnn._reorder_linear_weight``, and run with
``mkldnn._linear_pointwise``: plain bf16 weights are reordered inside every call), ``int8``
and ``int4`` (torch's packed CPU kernels of ``pdserve/engine/quantization/cpu_packed.py``,
bf16 activations). ``--all-rows`` prints F.linear and the unpadded NN form for every row
count 1..96, which is how ``PADDED_ROWS`` in ``pdserve/engine/layers/linear.py`` was chosen.

    python bench/cpu_gemm.py [--rows 1,2,4,5,16,80] [--threads 2] [--all-rows]
        [--weights bf16,bf16-packed,int8,int4]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from pdserve.engine.layers.linear import cpu_linear

HIDDEN, INTERMEDIATE, Q, KV, LAYERS, VOCAB = 576, 1536, 576, 192, 30, 49152


def step_fn(weights: list[torch.Tensor], rows: int, form: str):
    xs = {n: torch.randn(rows, n) for n in (HIDDEN, INTERMEDIATE)}

    def run() -> None:
        for w in weights:
            x = xs[w.shape[1]]
            if form == "linear":
                F.linear(x, w)
            elif form == "nn":
                torch.mm(w, x.t()).t().contiguous()
            else:
                cpu_linear(x, w)
    return run


def packed_step_fn(weights: list[torch.Tensor], rows: int, form: str):
    """One step over ``weights`` in ``form`` (bf16 / int8 / int4), bf16 activations."""
    from pdserve.engine.quantization.cpu_packed import Int4CpuGemm, Int8CpuGemm

    def int4(w: torch.Tensor) -> Int4CpuGemm:
        out, cols = w.shape
        g = w.view(out, cols // 32, 32)
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=1e-6)
        codes = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).view(out, cols)
        return Int4CpuGemm(codes, scale, lo + 8 * scale, 32)

    if form == "bf16":
        gemms = [lambda x, w=w.bfloat16(): F.linear(x, w) for w in weights]
    elif form == "bf16-packed":  # oneDNN's blocked layout, made once (mkldnn builds only)
        mkldnn = torch.ops.mkldnn
        gemms = [lambda x, w=mkldnn._reorder_linear_weight(w.bfloat16(), rows):
                 mkldnn._linear_pointwise(x, w, None, "none", [], "") for w in weights]
    elif form == "int8":
        gemms = [Int8CpuGemm(w) for w in weights]
    else:
        gemms = [int4(w) for w in weights]
    xs = {n: torch.randn(rows, n, dtype=torch.bfloat16) for n in (HIDDEN, INTERMEDIATE)}
    shapes = [w.shape[1] for w in weights]

    def run() -> None:
        for g, cols in zip(gemms, shapes):
            g(xs[cols])
    return run


def best_ms(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,3,4,5,8,12,16,20,32,64,80,128")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--all-rows", action="store_true")
    p.add_argument("--weights", default="",
                   help="also time these weight formats: bf16, bf16-packed, int8, int4 "
                   "(comma-separated)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weights = []
    for _ in range(LAYERS):
        weights += [torch.randn(Q + 2 * KV, HIDDEN), torch.randn(HIDDEN, Q),
                    torch.randn(2 * INTERMEDIATE, HIDDEN), torch.randn(HIDDEN, INTERMEDIATE)]
    weights.append(torch.randn(VOCAB, HIDDEN))
    forms = ("linear", "nn") if args.all_rows else ("linear", "cpu_linear")
    rows_list = range(1, 97) if args.all_rows else [int(r) for r in args.rows.split(",")]
    extra = [f for f in args.weights.split(",") if f]
    bad = [f for f in extra if f not in ("bf16", "bf16-packed", "int8", "int4")]
    if bad:
        p.error(f"--weights: unknown format(s) {bad}; choose from bf16, bf16-packed, int8, "
                "int4")
    print(f"rows  {forms[0]:>9s} ms  {forms[1]:>11s} ms  ratio"
          + "".join(f"  {f:>7s} ms" for f in extra))
    for rows in rows_list:
        a, b = (best_ms(step_fn(weights, rows, f), args.reps) for f in forms)
        more = "".join(f"  {best_ms(packed_step_fn(weights, rows, f), args.reps):10.1f}"
                       for f in extra)
        print(f"{rows:4d}  {a:12.1f}  {b:14.1f}  {b / a:5.2f}x{more}", flush=True)


if __name__ == "__main__":
    main()
