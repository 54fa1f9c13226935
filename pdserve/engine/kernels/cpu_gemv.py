"""bf16-weight GEMV for x86 CPUs with AVX2/FMA but no native bf16 (a C++ extension).

A decode step at small batch multiplies every weight by a few rows, so it is bound by
streaming the weights from memory. On CPUs without AVX512-BF16/AMX, oneDNN's bf16 GEMM
(``F.linear`` on bf16) converts and multiplies at ~18 GB/s on a 2-core AVX2 EPYC, well
under the memory's ~34 GB/s (``bench/cpu_gemm.py``), and SmolLM2-135M's GEMMs took 16.5 of
a 27 ms decode step. This kernel widens each bf16 weight to fp32 with a shift (bf16 is the
top half of an fp32), multiplies by the fp32 activations with FMA into four independent
accumulators per row, and splits the output rows over torch's intra-op threads
(``at::parallel_for``): the arithmetic of a bf16 GEMM with fp32 accumulation, in another
summation order.

The extension is built once per machine with torch's ``cpp_extension`` (g++ and ninja;
about half a minute) into ``~/.cache/pdserve/kernels`` and reused after; where it cannot
be built or the CPU lacks AVX2/FMA, :func:`bf16_gemv` is None and callers keep
``F.linear``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

// y[m, n] = sum_k x[m, k] * w[n, k]; w bf16 [N, K] contiguous, x fp32 [M, K], 1 <= M <= 8.
// Rows go in pairs over each weight row (the row stays in L1 between pairs); every output
// is summed in the same order whatever M is, so a row's result does not depend on the
// rows beside it (plain decoding and speculative verification agree bit for bit).
static inline __m256 load_bf16x8(const uint16_t* p) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

static inline float bf16_to_f32(uint16_t v) {
    uint32_t bits = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

torch::Tensor gemv(torch::Tensor w, torch::Tensor x) {
    TORCH_CHECK(w.scalar_type() == torch::kBFloat16 && w.is_contiguous() && w.dim() == 2,
                "w must be a contiguous 2-D bf16 tensor");
    TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2,
                "x must be a contiguous 2-D fp32 tensor");
    const int64_t N = w.size(0), K = w.size(1), M = x.size(0);
    TORCH_CHECK(x.size(1) == K && M >= 1 && M <= 8, "x must be [1 to 8, K]");
    auto y = torch::empty({M, N}, x.options());
    const uint16_t* W = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
    const float* X = x.data_ptr<float>();
    float* Y = y.data_ptr<float>();
    const int64_t K32 = K - K % 32;
    at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
        for (int64_t n = begin; n < end; ++n) {
            const uint16_t* row = W + n * K;
            for (int64_t m = 0; m < M; m += 2) {
                const float* x0 = X + m * K;
                const float* x1 = (m + 1 < M) ? x0 + K : nullptr;
                __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
                __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
                __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
                __m256 b2 = _mm256_setzero_ps(), b3 = _mm256_setzero_ps();
                int64_t k = 0;
                for (; k < K32; k += 32) {
                    __m256 w0 = load_bf16x8(row + k), w1 = load_bf16x8(row + k + 8);
                    __m256 w2 = load_bf16x8(row + k + 16), w3 = load_bf16x8(row + k + 24);
                    a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x0 + k), a0);
                    a1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x0 + k + 8), a1);
                    a2 = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x0 + k + 16), a2);
                    a3 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x0 + k + 24), a3);
                    if (x1) {
                        b0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x1 + k), b0);
                        b1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x1 + k + 8), b1);
                        b2 = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x1 + k + 16), b2);
                        b3 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x1 + k + 24), b3);
                    }
                }
                float s0 = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
                float s1 = hsum(_mm256_add_ps(_mm256_add_ps(b0, b1), _mm256_add_ps(b2, b3)));
                for (; k < K; ++k) {
                    float wk = bf16_to_f32(row[k]);
                    s0 += wk * x0[k];
                    if (x1) s1 += wk * x1[k];
                }
                Y[m * N + n] = s0;
                if (x1) Y[(m + 1) * N + n] = s1;
            }
        }
    });
    return y;
}
"""

_lock = threading.Lock()
_state: dict[str, object] = {}


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _build():
    """The compiled module, or None (logged once) when it cannot be built here."""
    if os.environ.get("PDSERVE_DISABLE_CPU_KERNELS"):
        return None
    if not {"avx2", "fma"} <= _cpu_flags():
        return None
    from torch.utils import cpp_extension  # noqa: PLC0415 (only where the kernel is used)

    cflags = ["-O3", "-mavx2", "-mfma", "-fopenmp"]  # OpenMP: at::parallel_for's threads
    digest = hashlib.sha256(" ".join([_SOURCE, torch.__version__, *cflags]).encode()
                            ).hexdigest()[:16]
    build_dir = Path(os.environ.get("PDSERVE_KERNEL_CACHE",
                                    Path.home() / ".cache" / "pdserve" / "kernels")) / digest
    build_dir.mkdir(parents=True, exist_ok=True)
    # ninja comes with the package (PyPI ninja) next to this interpreter, which is not on
    # PATH when the venv was not activated (`.venv/bin/pdserve serve`)
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    try:
        return cpp_extension.load_inline(
            name=f"pdserve_cpu_gemv_{digest}", cpp_sources=_SOURCE, functions=["gemv"],
            extra_cflags=cflags, extra_ldflags=["-fopenmp"], build_directory=str(build_dir),
            verbose=False)
    except Exception as exc:  # no compiler, no ninja, a build error: keep F.linear
        logger.warning("the AVX2 bf16 GEMV kernel could not be built (%s); bf16 decode "
                       "GEMMs use torch's F.linear", str(exc).splitlines()[0][:200])
        return None


def bf16_gemv_module():
    """The built extension (building it on first use), or None where it is unavailable."""
    if "module" in _state:  # the hot path: no lock once decided
        return _state["module"]
    with _lock:
        if "module" not in _state:
            _state["module"] = _build()
        return _state["module"]


#: Most rows one kernel call takes (a decode step at batch 1-2, or one request's speculative
#: verification of up to 7 drafts).
MAX_GEMV_ROWS = 8


def bf16_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight^T`` for 1-8 rows with a bf16 weight, fp32 accumulation.

    Args:
        x: ``[M, K]``, ``1 <= M <=`` :data:`MAX_GEMV_ROWS`, any float dtype (computed in fp32).
        weight: ``[N, K]`` bf16, contiguous.

    Returns:
        ``[M, N]`` in ``x.dtype``.

    Raises:
        RuntimeError: when the kernel is unavailable (check :func:`bf16_gemv_module`) or
            the shapes/dtypes do not fit.
    """
    module = bf16_gemv_module()
    if module is None:
        raise RuntimeError("the AVX2 bf16 GEMV kernel is not available on this machine")
    return module.gemv(weight, x.float().contiguous()).to(x.dtype)
