"""Fused CPU decode step: every decoder layer of a Llama-family model in one C++ call.

Why. At decode time a 135M-parameter model's step on 2 AVX2 cores spent ~11 ms streaming
the weights through the GEMV kernel and ~25 ms more in the ~900 small torch ops around
them (norms, rotary, the KV store, attention over a gathered context, SiLU, residual adds,
dtype casts): each op costs a few microseconds of dispatch and allocation whatever its size
(measured: ``bench/profile_step.py``, 2-core AMD EPYC, SmolLM2-135M bf16, decode batch 1).
``torch.compile`` of the whole forward took 74 s to compile and recompiled on every call.
This kernel (``cpu_decode.cpp``) runs a step's decoder layers for up to 32 tokens (a
decode batch, speculative verification rows, a short prefill chunk) in one call, with the
weights read once per step; for bf16 weights on CPUs with native bf16 GEMMs it takes longer
prefill chunks too, their GEMMs torch's own.

What it computes. The eager bf16 model's arithmetic (each value the eager path rounds to
bf16 is rounded here at the same point; see the C++ header), over:

- bf16 weights (dense models; fp32 accumulation, as the eager GEMV kernel);
- int4 weights in GGML's Q4_1 form, ``w = d * code + m`` per block of 32 columns (GGUF
  Q4_0/Q4_1 exactly; AWQ/GPTQ/RTN groups that are multiples of 32, ``d = s``,
  ``m = -z * s``), multiplied with activations quantized per block of 32 to int8
  (GGML's Q4_1 x Q8_1 scheme: AVX2 ``maddubs`` integer dot products);
- int8 weights with one scale per output channel (``w = s * code``), int8 activations
  likewise.

Attention reads each token's context (positions ``0 .. pos`` of its request) through the
block table from the paged bf16 cache ``[layers, 2, blocks, block_size, kv_heads,
head_dim]``, after writing this step's K/V at ``slot_mapping``.

Built once per machine (see :mod:`.cpu_build`); needs AVX2, FMA and F16C. On CPUs with
AVX512-BF16 (Zen 4, Intel since Cooper Lake) the build's bf16 GEMVs multiply with
``vdpbf16ps`` instead: the same products, summed in another (fixed) order. On CPUs with
AMX (Intel since Sapphire Rapids) the ``amx`` build multiplies bf16 weights (``K % 32 ==
0``, whole blocks of 32 rows) in AMX tiles, the weights read in place as the left tile:
a 32-row decode step's GEMMs 56 -> 22 ms and its LM head 13.8 -> 3.9 ms on a 2-core Xeon
(README, Speed on CPU); ``PDSERVE_CPU_AMX=0`` turns the tiles off (the
AVX512-BF16 tiles run), for comparison. There a step's prefill chunks (head_dim 64) take
causal attention in AMX tiles too, all of the step's chunks in one call
(``cpu_amx_attention.cpp``: one layer of a 1,500-token prompt 3.8 ms against torch's flash
attention's 6.2; a 32 x 128 prefill step's attention 267 -> 174 ms);
``PDSERVE_PREFILL_ATTENTION=torch`` (or ``cpu``: the AVX512-BF16 kernel) for comparison.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch

from pdserve.engine.kernels.cpu_build import build_cpu_extension, cpu_flags

#: Most tokens one fused call takes with the kernel's own GEMVs (any weight format).
MAX_FUSED_TOKENS = 32
#: Most tokens one fused call takes where every weight is bf16 (more than
#: :data:`MAX_FUSED_TOKENS` rows multiply through torch's GEMM): a whole step's budget.
MAX_FUSED_PREFILL_TOKENS = 1 << 16
#: Weight segment kinds (the C++ ``Kind``).
BF16, INT4, INT8 = 0, 1, 2
_AVX2 = ["-mavx2", "-mfma", "-mf16c"], frozenset({"avx2", "fma", "f16c"})
#: AVX512 with bf16 dot products (vdpbf16ps) and VNNI (vpdpbusd: the quantized GEMVs' products).
_AVX512 = (_AVX2[0] + ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16",
                       "-mavx512vnni"],
           _AVX2[1] | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"})
#: The builds, best first: ``name -> (compiler flags, CPU flags needed)``. The AMX one is
#: the AVX512-BF16 one plus AMX tiles for bf16 GEMMs of up to 32 rows and prefill attention
#: (and AVX512-VBMI's byte permutes, which every AMX CPU has); the AVX512-BF16
#: one multiplies bf16 GEMVs and attention scores with ``vdpbf16ps`` (32 bf16 products
#: per instruction against AVX2's 8 fp32 FMAs after a conversion).
BUILDS = {
    "amx": (_AVX512[0] + ["-mamx-tile", "-mamx-bf16", "-mavx512vbmi"],
            _AVX512[1] | {"amx_tile", "amx_bf16", "avx512vbmi"}),
    "avx512_bf16": _AVX512,
    "avx2": _AVX2,
}
#: Columns per int4 scale block and per activation quantization block.
BLOCK = 32

_lock = threading.Lock()
_state: dict[str, object] = {}


def cpu_decode_module(isa: str | None = None):
    """The built extension (building it on first use), or None where it is unavailable.

    Args:
        isa: ``"avx512_bf16"`` or ``"avx2"``: that build (None where the CPU lacks its
            flags); None: the best build this CPU runs, unless ``PDSERVE_CPU_DECODE_ISA``
            names one.

    Raises:
        ValueError: an unknown ``isa``.
    """
    isa = isa or os.environ.get("PDSERVE_CPU_DECODE_ISA") or None
    if isa not in (None, *BUILDS):
        raise ValueError(f"unknown ISA {isa!r}: expected one of {sorted(BUILDS)}")
    key = isa or "best"
    if key in _state:
        return _state[key]
    with _lock:
        if key not in _state:
            names = [isa] if isa else [n for n in BUILDS if BUILDS[n][1] <= cpu_flags()]
            module = None
            for name in names:
                module = _build(name)
                if module is not None:
                    break
            _state[key] = module
        return _state[key]


def _build(name: str):
    """Build ``name`` of :data:`BUILDS` once per process (None where unavailable); the
    caller holds ``_lock``."""
    if f"build:{name}" not in _state:
        source = "".join(Path(__file__).with_name(f).read_text() for f in (
            "cpu_prefill_attention.cpp", "cpu_flash_f32.cpp", "cpu_decode.cpp",
            "cpu_amx_attention.cpp", "cpu_quant_tiles.cpp"))  # one translation unit
        cflags, needs = BUILDS[name]
        _state[f"build:{name}"] = build_cpu_extension(f"cpu_decode_{name}", source, cflags,
                                                      needs)
    return _state[f"build:{name}"]


#: One weight segment as the C++ side takes it: ``(kind, w, s)`` (``s`` empty for bf16).
Segment = tuple[int, torch.Tensor, torch.Tensor]


def bf16_segment(weight: torch.Tensor) -> Segment:
    """``weight [rows, K]`` as a bf16 segment (a view when it already is contiguous bf16)."""
    return BF16, weight.detach().to(torch.bfloat16).contiguous(), torch.empty(0)


def int4_segment(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> Segment:
    """An int4 segment, ``w = d * code + m`` per block of 32 columns.

    Args:
        codes: ``[rows, K]`` integer codes in 0..15, ``K % 32 == 0``.
        d, m: ``[rows, K / 32]`` float scale and offset per block.

    Raises:
        ValueError: ``K`` not a multiple of 32 or shapes that do not match.
    """
    rows, k = codes.shape
    if k % BLOCK or d.shape != (rows, k // BLOCK) or m.shape != d.shape:
        raise ValueError(f"int4 segment needs codes [rows, K % 32 == 0] and d/m [rows, K/32]; "
                         f"got {tuple(codes.shape)}, {tuple(d.shape)}, {tuple(m.shape)}")
    c = codes.to(torch.uint8).reshape(rows, k // BLOCK, BLOCK)
    packed = (c[..., :16] | (c[..., 16:] << 4)).reshape(rows, k // 2).contiguous()
    ds = torch.stack((d.float(), m.float()), dim=1).to(torch.float16).contiguous()  # [rows, 2, K/32]
    return INT4, packed, ds


def int8_segment(weight: torch.Tensor) -> Segment:
    """``weight [rows, K]`` float as per-output-channel symmetric int8 (``scale = max|w_row|
    / 127``, ``code = round(w / scale)``): half a step of rounding."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-30)
    codes = (w / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8).contiguous()
    return INT8, codes, scale.contiguous()


def group_to_blocks(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per-group values ``[rows, K / group_size]`` repeated per block of 32 columns.

    Raises:
        ValueError: ``group_size`` not a multiple of 32.
    """
    if group_size % BLOCK:
        raise ValueError(f"group size {group_size} is not a multiple of {BLOCK}")
    return values.repeat_interleave(group_size // BLOCK, dim=1)
