"""GPU fast-path benchmark: kernel checks, decode-step latency, prefill tokens/s, FP8 vs bf16 KV.

On one CUDA device, in this order (about 5 minutes on an H200):

1. every Triton kernel against its torch reference at serving-sized shapes (PASS/FAIL);
2. the device's copy bandwidth (device-to-device copy) and bf16 matmul rate;
3. for random-weight models of Qwen3-0.6B and Llama-3.1-8B shape (bf16, Triton backend):
   decode-step latency at batch 1/16/64/256 (context 1024 each), eager and CUDA graph,
   each beside its floor ``(weight bytes + KV bytes read) / copy bandwidth``;
   prefill tokens/s (8 x 2048 tokens) beside ``FLOPs / matmul rate``;
   decode at batch 64 and 256 with context 2048, bf16 KV vs FP8 KV.

Without CUDA it exits with status 2 and says so; ``--dry-run`` runs the CPU-side parts
instead (model shapes on the meta device, byte and FLOP accounting, floors at nominal H200
rates), which the test suite runs.

    python bench/gpu_bench.py [--dry-run] [--models qwen3-0.6b,llama-3.1-8b]
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from dataclasses import dataclass

import torch

#: Nominal H200 rates, used by --dry-run only (a real run measures them).
NOMINAL_COPY_BYTES_PER_S = 4.0e12
NOMINAL_BF16_FLOPS = 7.0e14

#: Hugging Face config.json fields of the benchmarked shapes (weights are random).
MODEL_SHAPES: dict[str, dict] = {
    "qwen3-0.6b": dict(
        architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=1024,
        intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, max_position_embeddings=40960,
        tie_word_embeddings=True, rope_theta=1000000.0, eos_token_id=151645),
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, rms_norm_eps=1e-5, max_position_embeddings=131072,
        tie_word_embeddings=False, rope_theta=500000.0, eos_token_id=128001,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}
DECODE_BATCHES = (1, 16, 64, 256)
DECODE_CONTEXT = 1024
LONG_CONTEXT = 2048
PREFILL_REQUESTS, PREFILL_LEN = 8, 2048
BLOCK_SIZE = 16


@dataclass
class Rates:
    """Measured (or nominal) device rates: bytes/s of a device copy, bf16 FLOP/s."""

    copy_bytes_per_s: float
    matmul_flops: float


def build_model(name: str, device: torch.device, backend_name: str = "triton"):
    """``(arch, model)``: random-weight bf16 model of the named shape (meta device: shapes
    only, for accounting)."""
    from pdserve.engine.attention import get_backend
    from pdserve.engine.config import ModelArchConfig
    from pdserve.engine.models import get_model_class

    arch = ModelArchConfig.from_hf_config(MODEL_SHAPES[name])
    backend = get_backend(backend_name if device.type == "cuda" else "torch", device)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with device:
            model = get_model_class(arch.architecture)(arch, backend, LONG_CONTEXT + 1)
    finally:
        torch.set_default_dtype(old)
    if device.type != "meta":
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02)
        model.eval()
    return arch, model


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct parameters (a tied LM head counts once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def kv_bytes_read(arch, batch: int, context: int, kv_elem_bytes: int) -> int:
    """K and V bytes a decode step reads: every layer, every KV head, the whole context
    (plus one fp32 scale per block and head for FP8)."""
    kv = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * kv_elem_bytes
    scales = 0
    if kv_elem_bytes == 1:
        scales = 2 * arch.num_layers * arch.num_kv_heads * 4 * -(-context // BLOCK_SIZE)
    return batch * (context * kv + scales)


def prefill_flops(arch, num_params: int, num_seqs: int, seq_len: int) -> float:
    """Matmul FLOPs of a causal prefill: ``2 * params * tokens`` plus attention
    ``QK^T`` and ``PV`` over the causal half (``2 * 2 * L^2 / 2 * heads * head_dim``)."""
    tokens = num_seqs * seq_len
    attn = 2 * seq_len * seq_len * arch.num_heads * arch.head_dim * arch.num_layers
    return 2.0 * num_params * tokens + num_seqs * attn


def floors_table(name: str, arch, wbytes: int, num_params: int, rates: Rates) -> list[str]:
    """The floor of every figure this benchmark measures for one model, as report lines."""
    lines = []
    for b in DECODE_BATCHES:
        kv = kv_bytes_read(arch, b, DECODE_CONTEXT, 2)
        lines.append(f"{name} decode b={b:<3d} ctx={DECODE_CONTEXT}: floor "
                     f"{1e3 * (wbytes + kv) / rates.copy_bytes_per_s:.3f} ms "
                     f"(weights {wbytes / 2**30:.2f} GiB + KV {kv / 2**30:.3f} GiB)")
    flops = prefill_flops(arch, num_params, PREFILL_REQUESTS, PREFILL_LEN)
    lines.append(f"{name} prefill {PREFILL_REQUESTS}x{PREFILL_LEN}: floor "
                 f"{PREFILL_REQUESTS * PREFILL_LEN / (flops / rates.matmul_flops):,.0f} tok/s "
                 f"({flops / 1e12:.1f} TFLOP)")
    for b in (64, 256):
        for label, elem in (("bf16", 2), ("fp8", 1)):
            kv = kv_bytes_read(arch, b, LONG_CONTEXT, elem)
            lines.append(f"{name} decode b={b:<3d} ctx={LONG_CONTEXT} KV {label}: floor "
                         f"{1e3 * (wbytes + kv) / rates.copy_bytes_per_s:.3f} ms "
                         f"(KV {kv / 2**30:.2f} GiB)")
    return lines


def dry_run(models: list[str]) -> int:
    """CPU-side parts: shapes on the meta device, accounting, floors at nominal rates."""
    rates = Rates(NOMINAL_COPY_BYTES_PER_S, NOMINAL_BF16_FLOPS)
    print(f"dry run (no GPU work): floors at nominal {rates.copy_bytes_per_s / 1e12:.1f} TB/s, "
          f"{rates.matmul_flops / 1e12:.0f} TFLOP/s")
    for name in models:
        arch, model = build_model(name, torch.device("meta"))
        num_params = sum(p.numel() for p in model.parameters())
        print(f"{name}: {num_params / 1e9:.3f} B parameters, {arch.num_layers} layers, "
              f"GQA {arch.num_heads}:{arch.num_kv_heads}, head_dim {arch.head_dim}")
        for line in floors_table(name, arch, weight_bytes(model), num_params, rates):
            print("  " + line)
    return 0


# -- CUDA parts ------------------------------------------------------------------------------

def cuda_time_s(fn, iters: int = 20, warmup: int = 3) -> float:
    """Mean seconds per call of ``fn`` on the current stream (CUDA events)."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def measure_rates(device: torch.device) -> Rates:
    """Device copy bandwidth (bytes read + written per second) and bf16 matmul FLOP/s."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = cuda_time_s(lambda: dst.copy_(src), iters=10)
    a = torch.randn((8192, 8192), dtype=torch.bfloat16, device=device)
    b = torch.randn((8192, 8192), dtype=torch.bfloat16, device=device)
    mm_s = cuda_time_s(lambda: a @ b, iters=10)
    del src, dst
    return Rates(2 * (1 << 30) / copy_s, 2 * 8192**3 / mm_s)


def check_kernels(device: torch.device) -> bool:
    """Each kernel vs its reference at serving-sized shapes; prints one line per kernel."""
    from pdserve.engine.kernels import decode_attention as da
    from pdserve.engine.kernels import kv_store, rmsnorm, rotary
    from pdserve.engine.kernels import prefill_attention as pa
    from pdserve.engine.layers.rotary import RotaryEmbedding

    gen = torch.Generator(device=device).manual_seed(0)
    ok = True

    def report(name: str, err: float, tol: float) -> None:
        nonlocal ok
        ok &= err <= tol
        print(f"  {name:<32s} max rel err {err:.2e}  (tol {tol:.0e})  "
              f"{'PASS' if err <= tol else 'FAIL'}")

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b.float()).abs().max() / b.float().abs().max())

    bf16 = torch.bfloat16
    num_blocks, heads, kv_heads, dim = 512, 32, 8, 128
    seq_lens = [1, 300, 1024, 77, 2000, 513]
    tables = torch.randperm(num_blocks, device=device, generator=gen)[:sum(
        -(-s // BLOCK_SIZE) for s in seq_lens)].to(torch.int32)
    table = torch.zeros((len(seq_lens), 128), dtype=torch.int32, device=device)
    used = 0
    for r, s in enumerate(seq_lens):
        n = -(-s // BLOCK_SIZE)
        table[r, :n] = tables[used:used + n]
        used += n
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    shape = (num_blocks, BLOCK_SIZE, kv_heads, dim)
    for label, fp8 in (("bf16", False), ("fp8", True)):
        k = torch.randn(shape, device=device, generator=gen, dtype=bf16)
        v = torch.randn(shape, device=device, generator=gen, dtype=bf16)
        ks = vs = None
        if fp8:
            ks = k.float().abs().amax(dim=(1, 3)) / 448
            vs = v.float().abs().amax(dim=(1, 3)) / 448
            k = (k.float() / ks[:, None, :, None]).to(torch.float8_e4m3fn)
            v = (v.float() / vs[:, None, :, None]).to(torch.float8_e4m3fn)
        q = torch.randn((len(seq_lens), heads, dim), device=device, generator=gen, dtype=bf16)
        got = da.paged_decode_attention(q, k, v, table, lens, dim**-0.5, ks, vs)
        want = da.paged_decode_attention_reference(q, k, v, table, lens, dim**-0.5, ks, vs)
        report(f"decode attention ({label} KV)", rel(got, want), 2e-2)
        q_lens = [1, 300, 24, 77, 1000, 513]
        cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=device)
        qp = torch.randn((sum(q_lens), heads, dim), device=device, generator=gen, dtype=bf16)
        got = pa.paged_prefill_attention(qp, k, v, table, cu, lens, max(q_lens), dim**-0.5,
                                         ks, vs)
        want = pa.paged_prefill_attention_reference(qp, k, v, table, cu, lens, dim**-0.5,
                                                    ks, vs)
        report(f"prefill attention ({label} KV)", rel(got, want), 2e-2)
    x = torch.randn((4096, kv_heads, dim), device=device, generator=gen, dtype=bf16)
    slots = torch.arange(4096, device=device)
    cache = torch.zeros(shape, dtype=torch.float8_e4m3fn, device=device)
    scales = torch.ones((num_blocks, kv_heads), device=device)
    ref_cache, ref_scales = cache.clone(), scales.clone()
    kv_store.store_kv(x, cache, slots, scales,
                      kv_store.store_segments([4096], [4096], BLOCK_SIZE, device))
    kv_store.store_kv_reference(x, ref_cache, slots, ref_scales)
    deq = cache.float() * scales[:, None, :, None]
    ref_deq = ref_cache.float() * ref_scales[:, None, :, None]
    report("KV store, FP8 quantize", rel(deq, ref_deq), 1e-6)
    h = torch.randn((4096, 4096), device=device, generator=gen, dtype=bf16)
    res = torch.randn_like(h)
    w = torch.randn(4096, device=device, generator=gen, dtype=bf16)
    report("RMSNorm + residual", rel(rmsnorm.rms_norm(h, w, 1e-6, res)[0],
                                     rmsnorm.rms_norm_reference(h, w, 1e-6, res)[0]), 2e-2)
    rope = RotaryEmbedding(dim, 8192, 10000.0).to(device)
    pos = torch.randint(0, 8192, (4096,), device=device, generator=gen)
    qr = torch.randn((4096, heads, dim), device=device, generator=gen, dtype=bf16)
    kr = torch.randn((4096, kv_heads, dim), device=device, generator=gen, dtype=bf16)
    want_q, _ = rotary.apply_rotary_reference(pos, qr, kr, rope.cos_cached, rope.sin_cached)
    rotary.apply_rotary_(pos, qr, kr, rope.cos_cached, rope.sin_cached)
    report("rotary (q and k)", rel(qr, want_q), 2e-2)
    return ok


def bench_model(name: str, device: torch.device, rates: Rates) -> None:
    """Decode latency (eager, CUDA graph), prefill tokens/s, FP8 vs bf16 KV for one shape."""
    from pdserve.engine.attention import AttentionInputs
    from pdserve.engine.compiled.cuda_graphs import CUDAGraphRunner

    arch, model = build_model(name, device)
    wbytes = weight_bytes(model)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"{name}: {num_params / 1e9:.2f} B parameters ({wbytes / 2**30:.1f} GiB bf16)")
    backend = model.model.layers[0].self_attn.backend
    max_batch = max(DECODE_BATCHES)
    num_blocks = max_batch * LONG_CONTEXT // BLOCK_SIZE + 1

    def kv_caches(fp8: bool) -> list:
        dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
        cache = torch.zeros((arch.num_layers, 2, num_blocks, BLOCK_SIZE, arch.num_kv_heads,
                             arch.head_dim), dtype=dtype, device=device)
        if not fp8:
            return [(cache[i, 0], cache[i, 1]) for i in range(arch.num_layers)]
        scales = torch.ones((arch.num_layers, 2, num_blocks, arch.num_kv_heads), device=device)
        return [(cache[i, 0], cache[i, 1], scales[i, 0], scales[i, 1])
                for i in range(arch.num_layers)]

    def decode_inputs(batch: int, context: int):
        per_seq = -(-context // BLOCK_SIZE)
        tables = [list(range(r * per_seq, (r + 1) * per_seq)) for r in range(batch)]
        slots = [t[(context - 1) // BLOCK_SIZE] * BLOCK_SIZE + (context - 1) % BLOCK_SIZE
                 for t in tables]
        return [1] * batch, [context - 1] * batch, slots, tables, [context] * batch

    def time_decode(caches: list, batch: int, context: int, graphs: bool) -> float:
        ids, pos, slots, tables, lens = decode_inputs(batch, context)
        if graphs:
            runner = CUDAGraphRunner(model, caches, batch, context, BLOCK_SIZE, device)
            runner.buckets = (batch,)
            runner.capture()
            return cuda_time_s(lambda: runner.run(ids, pos, slots, tables, lens))
        ids_t = torch.tensor(ids, device=device)
        pos_t = torch.tensor(pos, device=device)
        inputs = AttentionInputs(torch.tensor(slots, device=device), [1] * batch, lens,
                                 tables, batch, BLOCK_SIZE)
        return cuda_time_s(lambda: model(ids_t, pos_t, caches,
                                         backend.build_metadata(inputs)))

    with torch.inference_mode():
        caches = kv_caches(fp8=False)
        for b in DECODE_BATCHES:
            floor_s = (wbytes + kv_bytes_read(arch, b, DECODE_CONTEXT, 2)) / rates.copy_bytes_per_s
            eager = time_decode(caches, b, DECODE_CONTEXT, graphs=False)
            graph = time_decode(caches, b, DECODE_CONTEXT, graphs=True)
            print(f"  decode b={b:<3d} ctx={DECODE_CONTEXT}: eager {1e3 * eager:7.3f} ms, "
                  f"graph {1e3 * graph:7.3f} ms, floor {1e3 * floor_s:7.3f} ms "
                  f"({100 * floor_s / graph:.0f} % of floor)")
        tables = [list(range(r * PREFILL_LEN // BLOCK_SIZE, (r + 1) * PREFILL_LEN // BLOCK_SIZE))
                  for r in range(PREFILL_REQUESTS)]
        slots = torch.tensor([t[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                              for t in tables for p in range(PREFILL_LEN)], device=device)
        inputs = AttentionInputs(slots, [PREFILL_LEN] * PREFILL_REQUESTS,
                                 [PREFILL_LEN] * PREFILL_REQUESTS, tables, 0, BLOCK_SIZE)
        ids = torch.randint(0, arch.vocab_size, (PREFILL_REQUESTS * PREFILL_LEN,), device=device)
        pos = torch.arange(PREFILL_LEN, device=device).repeat(PREFILL_REQUESTS)
        prefill_s = cuda_time_s(lambda: model(ids, pos, caches, backend.build_metadata(inputs)),
                                iters=5, warmup=1)
        flops = prefill_flops(arch, num_params, PREFILL_REQUESTS, PREFILL_LEN)
        tokens = PREFILL_REQUESTS * PREFILL_LEN
        print(f"  prefill {PREFILL_REQUESTS}x{PREFILL_LEN}: {tokens / prefill_s:,.0f} tok/s, "
              f"floor {tokens / (flops / rates.matmul_flops):,.0f} tok/s "
              f"({100 * flops / rates.matmul_flops / prefill_s:.0f} % of floor)")
        del caches
        for fp8 in (False, True):
            caches = kv_caches(fp8)
            for b in (64, 256):
                kv = kv_bytes_read(arch, b, LONG_CONTEXT, 1 if fp8 else 2)
                graph = time_decode(caches, b, LONG_CONTEXT, graphs=True)
                floor_s = (wbytes + kv) / rates.copy_bytes_per_s
                print(f"  decode b={b:<3d} ctx={LONG_CONTEXT} KV {'fp8 ' if fp8 else 'bf16'}: "
                      f"{1e3 * graph:7.3f} ms, floor {1e3 * floor_s:7.3f} ms "
                      f"(KV {kv / 2**30:.2f} GiB)")
            del caches
    del model
    torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true",
                   help="CPU-side parts only (shapes, accounting, nominal floors)")
    p.add_argument("--models", default=",".join(MODEL_SHAPES),
                   help=f"comma-separated, from {sorted(MODEL_SHAPES)}")
    args = p.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODEL_SHAPES]
    if unknown:
        p.error(f"unknown model(s) {unknown}; choose from {sorted(MODEL_SHAPES)}")
    if args.dry_run:
        return dry_run(models)
    if not torch.cuda.is_available():
        print("gpu_bench.py needs a CUDA device and found none; run with --dry-run for the "
              "CPU-side checks", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    t0 = time.monotonic()
    print(f"device: {torch.cuda.get_device_name(device)}")
    print("kernel checks:")
    kernels_ok = check_kernels(device)
    rates = measure_rates(device)
    print(f"copy bandwidth {rates.copy_bytes_per_s / 1e12:.2f} TB/s, bf16 matmul "
          f"{rates.matmul_flops / 1e12:.0f} TFLOP/s")
    for name in models:
        bench_model(name, device, rates)
    print(f"done in {time.monotonic() - t0:.0f} s; kernels {'PASS' if kernels_ok else 'FAIL'}")
    return 0 if kernels_ok else 1


if __name__ == "__main__":
    sys.exit(main())
