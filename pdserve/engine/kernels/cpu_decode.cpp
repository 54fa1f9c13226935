// Fused decode step for Llama-family decoders on x86 CPUs with AVX2/FMA/F16C.
//
// One call runs every decoder layer for the tokens of a step (a decode batch, speculative
// verification rows, a short prefill): RMSNorm, the Q/K/V, output, gate/up and down GEMVs over bf16, int4
// or int8 weights, rotary, the paged KV store and attention, SiLU-and-mul, the residual
// stream and the final norm. The Python module (cpu_decode.py) says why and when it runs.
//
// Numerics follow the eager bf16 model: every value the eager path holds in bf16 is rounded
// to bf16 here at the same point (round to nearest even), arithmetic in between is fp32.
// Int4/int8 weights multiply activations quantized per block of 32 to int8 (symmetric,
// scale max|x|/127), as GGML's Q4_1 x Q8_1 dot products do; bf16 weights multiply the fp32
// activations.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <pybind11/functional.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t QBLOCK = 32;  // activation quantization block (and int4 scale block)
// Fewest consecutive query tokens of one request that take the blocked prefill attention
// kernel in a fused step (fewer go token by token).
constexpr int64_t FLASH_MIN_QUERIES = 16;

inline float bf16_round(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0x7f800000u) {  // inf and nan keep their class
        u = (u & 0xffff0000u) | ((u & 0xffffu) ? 0x00400000u : 0u);
    } else {
        u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    }
    float r;
    std::memcpy(&r, &u, 4);
    return r;
}

inline uint16_t bf16_bits(float rounded) {
    uint32_t u;
    std::memcpy(&u, &rounded, 4);
    return static_cast<uint16_t>(u >> 16);
}

inline float bf16_value(uint16_t v) {
    uint32_t u = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline __m256 load_bf16x8(const uint16_t* p) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

inline float f16_value(uint16_t h) { return _cvtsh_ss(h); }

// ---------------------------------------------------------------- elementwise, 8 lanes

// bf16_round of 8 lanes: the same rule (round to nearest even; NaN stays NaN).
inline __m256 bf16_round8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    const __m256i r = _mm256_and_si256(
        _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), hi);
    const __m256i nan = _mm256_or_si256(_mm256_and_si256(u, hi), _mm256_set1_epi32(0x00400000));
    return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(nan),
                            _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

#if defined(__AVX512BF16__)
// ---------------------------------------------------------------- elementwise, 16 lanes
// The 8-lane functions' arithmetic over 16 lanes, lane for lane the same values.

// bf16_round8 of 16 lanes (vcvtneps2bf16: round to nearest even).
inline __m512 bf16_round16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

inline __m512 load_bf16x16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// exp8 over 16 lanes (its clamps, split of ln 2 and degree-6 polynomial).
inline __m512 exp16(__m512 x) { return pdserve_prefill_attention::exp16_taylor<6>(x); }
#endif

// dst[i] = bf16(src[i]) (round to nearest even) over n values.
inline void to_bf16(const float* src, uint16_t* dst, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512BF16__)
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
#endif
    for (; i < n; ++i) dst[i] = bf16_bits(bf16_round(src[i]));
}

// dst[i] = the fp32 value of bf16 src[i] (exact) over n values.
inline void from_bf16(const uint16_t* src, float* dst, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))), 16)));
#endif
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load_bf16x8(src + i));
    for (; i < n; ++i) dst[i] = bf16_value(src[i]);
}

// fn(begin, end) over rows 0 .. M: split across torch's threads in chunks of 8 rows for
// steps of more than 8 (a 32-row decode step of SmolLM2 on a 2-core Xeon: its norms,
// rotary and SiLU 2.36 -> 1.69 ms against one thread), on this thread for smaller ones (no
// parallel region to wake). Every row is computed the same way either way.
template <typename Fn>
inline void parallel_rows(int64_t M, const Fn& fn) {
    if (M > 8) at::parallel_for(0, M, 8, fn);
    else fn(0, M);
}

// fn over [begin, end) in chunks of `chunk`, on torch's threads, each thread taking the
// next chunk as it frees up (at::parallel_for gives each thread a fixed share). With no
// spare core, another process's wakeup preempts one of the threads: with fixed shares the
// other then waits for it at the region's end, with chunks it takes over the rest. fn must
// not throw.
template <typename Fn>
inline void dynamic_for(int64_t begin, int64_t end, int64_t chunk, const Fn& fn) {
    const int64_t n = (end - begin + chunk - 1) / chunk;
    const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), n));
    if (threads <= 1 || omp_in_parallel()) {
        fn(begin, end);
        return;
    }
    std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(threads)
    for (int64_t c = next.fetch_add(1); c < n; c = next.fetch_add(1))
        fn(begin + c * chunk, std::min(end, begin + (c + 1) * chunk));
}

// y[i] = bf16(a[i] + b[i]) (b may be null: y = bf16(a)); y may alias a or b.
inline void add_round(const float* a, const float* b, float* y, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512BF16__)
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(a + i);
        if (b) v = _mm512_add_ps(v, _mm512_loadu_ps(b + i));
        _mm512_storeu_ps(y + i, bf16_round16(v));
    }
#endif
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(a + i);
        if (b) v = _mm256_add_ps(v, _mm256_loadu_ps(b + i));
        _mm256_storeu_ps(y + i, bf16_round8(v));
    }
    for (; i < n; ++i) y[i] = bf16_round(b ? a[i] + b[i] : a[i]);
}

// add_round over M rows of width H (a, b and y all [M, H]; b not null).
inline void add_round_rows(const float* a, const float* b, float* y, int64_t M, int64_t H) {
    parallel_rows(M, [&](int64_t r0, int64_t r1) {
        add_round(a + r0 * H, b + r0 * H, y + r0 * H, (r1 - r0) * H);
    });
}

// e^x for 8 lanes, about 1 ulp: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6
// Taylor polynomial (Horner), times 2^n built in the exponent field. Clamped to fp32's range.
inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);  // ln2 in two parts
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
    __m256 p = _mm256_set1_ps(1.f / 720.f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}


// ---------------------------------------------------------------- activations as int8

struct QuantAct {
    std::vector<int8_t> q;  // [M, K]
    std::vector<float> d;   // [M, K / 32] block scale
    std::vector<float> s;   // [M, K / 32] exact sum of the block's fp32 values
    std::vector<int32_t> qs;  // [M, K / 32] 128 * the sum of the block's codes (gemv_q8t)
};

void quantize_act(const float* x, int64_t M, int64_t K, QuantAct& a) {
    const int64_t nb = K / QBLOCK;
    a.q.resize(M * K);
    a.d.resize(M * nb);
    a.s.resize(M * nb);
    a.qs.resize(M * nb);
    for (int64_t i = 0; i < M * nb; ++i) {
        const float* xb = x + i * QBLOCK;
        float amax = 0.f, sum = 0.f;
        for (int j = 0; j < QBLOCK; ++j) {
            amax = std::max(amax, std::fabs(xb[j]));
            sum += xb[j];
        }
        const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
        int32_t qsum = 0;
        for (int j = 0; j < QBLOCK; ++j) {
            a.q[i * QBLOCK + j] = static_cast<int8_t>(std::nearbyint(xb[j] * id));
            qsum += a.q[i * QBLOCK + j];
        }
        a.d[i] = d;
        a.s[i] = sum;
        a.qs[i] = 128 * qsum;
    }
}

// ---------------------------------------------------------------- weight segments

enum Kind : int64_t { BF16 = 0, Q4 = 1, Q8 = 2 };

// Rows of one linear layer's weight in one format.
//   BF16: w bf16 [rows, K]
//   Q4:   w uint8 [rows, K / 2]: in each block of 32 columns, byte j holds column j in its
//         low nibble and column j + 16 in its high nibble; s fp16 [rows, 2, K / 32] holds
//         each block's d, then each block's m: w = d * code + m (GGML's Q4_1 form)
//   Q8:   w int8 [rows, K]; s fp32 [rows]: w = s * code
struct Segment {
    int64_t kind;
    int64_t rows;
    torch::Tensor w, s;
    // w reordered for oneDNN (packed_weight: by pack_weights, else on first use)
    mutable torch::Tensor packed;
    // with AVX512-VNNI: the codes in 16-row tiles (Q8 + 128, Q4 nibbles) and for Q4 the
    // blocks' d and m (q8_tiles, q4_tiles: cpu_quant_tiles.cpp), or undefined
    torch::Tensor wt, tdm;
};

struct Linear {
    int64_t N = 0, K = 0;
    std::vector<Segment> segs;
    std::vector<float> bias;  // empty: none
    torch::Tensor bias_bf16;  // [N] bf16, or undefined: none
    bool quantized_input = false;
};

// Steps of more than this many rows (prefill chunks) multiply bf16 weights with torch's
// GEMM (MKL / oneDNN, native bf16 where the CPU has it) instead of the register-tiled GEMV.
constexpr int64_t MAX_GEMV_ROWS = 32;

// A tile of NR bf16 weight rows times MR activation rows: one fp32 accumulator per
// (weight row, activation row), columns 8 at a time in order, then a horizontal sum and
// the tail one column at a time. Every output is summed in this order whatever the tile,
// so a token's result does not depend on the tokens beside it (plain decoding and
// speculative verification agree bit for bit).
template <int NR, int MR>
inline void bf16_tile(const uint16_t* W, int64_t K, const float* X, int64_t n0, int64_t m0,
                      float* Y, int64_t ldy) {
    __m256 acc[NR][MR];
    for (int i = 0; i < NR; ++i)
        for (int j = 0; j < MR; ++j) acc[i][j] = _mm256_setzero_ps();
    const int64_t K8 = K - K % 8;
    for (int64_t k = 0; k < K8; k += 8) {
        __m256 w[NR];
        for (int i = 0; i < NR; ++i) w[i] = load_bf16x8(W + (n0 + i) * K + k);
        for (int j = 0; j < MR; ++j) {
            const __m256 x = _mm256_loadu_ps(X + (m0 + j) * K + k);
            for (int i = 0; i < NR; ++i) acc[i][j] = _mm256_fmadd_ps(w[i], x, acc[i][j]);
        }
    }
    for (int i = 0; i < NR; ++i) {
        const uint16_t* row = W + (n0 + i) * K;
        for (int j = 0; j < MR; ++j) {
            const float* x = X + (m0 + j) * K;
            float s = hsum(acc[i][j]);
            for (int64_t k = K8; k < K; ++k) s += bf16_value(row[k]) * x[k];
            Y[(m0 + j) * ldy + n0 + i] = s;
        }
    }
}

// Weight rows [n0, n1) times activation rows m0 .. m0 + MR: tiles of NR x MR, single rows
// at the end.
template <int NR, int MR, typename Tile>
inline void bf16_rows(Tile tile, int64_t n0, int64_t n1, int64_t m0) {
    int64_t n = n0;
    for (; n + NR <= n1; n += NR) tile.template run<NR, MR>(n, m0);
    for (; n < n1; ++n) tile.template run<1, MR>(n, m0);
}

// AVX2 tiles over fp32 activations: 8 x 1, 4 x 2, 2 x 3 or 2 x 4 (up to eight
// accumulators: enough independent FMAs to hide their latency).
struct Avx2Tile {
    const uint16_t* W;
    int64_t K;
    const float* X;
    float* Y;
    int64_t ldy;
    template <int NR, int MR>
    void run(int64_t n, int64_t m) const { bf16_tile<NR, MR>(W, K, X, n, m, Y, ldy); }
};

#if defined(__AVX512BF16__)
// The lane sums of 16 accumulators at once: out[k] = the sum of a[k]'s 16 lanes, added in
// the tree _mm512_reduce_add_ps uses for one vector (lanes l + l+8, then + l+4, + l+2,
// + l+1; fp32 addition commutes, so each sum is bit for bit that of the one-vector
// reduction) at about a sixth of its instructions per sum.
__attribute__((always_inline)) inline void reduce16(const __m512* a, float* out) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; ++i)  // [a(2i) lanes 0-7, a(2i+1) lanes 0-7] + lanes 8-15
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; ++i)  // quarter q: a(4i+q) lanes 0-3 + lanes 4-7
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; ++i) {  // quarter q: a(8i+q) and a(8i+4+q), 2 partials each
        const __m512d x = _mm512_castps_pd(c[2 * i]), y = _mm512_castps_pd(c[2 * i + 1]);
        d[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    // lane 4q + j: a(4j + q); permuted back to a's order
    const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88),
                                   _mm512_shuffle_ps(d[0], d[1], 0xDD));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_storeu_ps(out, _mm512_permutexvar_ps(order, e));
}

// A tile of NR bf16 weight rows times MR bf16 activation rows with AVX512-BF16 dot products
// (vdpbf16ps: 32 columns, pairs of products summed into 16 fp32 lanes), then the lanes'
// sum (reduce16, the one-vector reduction's order) and the tail one column at a time. As
// in bf16_tile, every output is summed in this order whatever the tile.
template <int NR, int MR>
inline void bf16_tile_dp(const uint16_t* W, int64_t K, const uint16_t* Xb, const float* X,
                         int64_t n0, int64_t m0, float* Y, int64_t ldy) {
    constexpr int NA = NR * MR, NP = (NA + 15) / 16 * 16;
    __m512 acc[NP];  // acc[i * MR + j]: weight row i, activation row j
    for (int a = 0; a < NP; ++a) acc[a] = _mm512_setzero_ps();
    const int64_t K32 = K - K % 32;
    for (int64_t k = 0; k < K32; k += 32) {
        __m512bh w[NR];
        for (int i = 0; i < NR; ++i)
            w[i] = (__m512bh)_mm512_loadu_si512(W + (n0 + i) * K + k);
        for (int j = 0; j < MR; ++j) {
            const __m512bh x = (__m512bh)_mm512_loadu_si512(Xb + (m0 + j) * K + k);
            for (int i = 0; i < NR; ++i)
                acc[i * MR + j] = _mm512_dpbf16_ps(acc[i * MR + j], w[i], x);
        }
    }
    alignas(64) float sums[NP];
    for (int a = 0; a < NP; a += 16) reduce16(acc + a, sums + a);
    for (int i = 0; i < NR; ++i) {
        const uint16_t* row = W + (n0 + i) * K;
        for (int j = 0; j < MR; ++j) {
            const float* x = X + (m0 + j) * K;
            float s = sums[i * MR + j];
            for (int64_t k = K32; k < K; ++k) s += bf16_value(row[k]) * x[k];
            Y[(m0 + j) * ldy + n0 + i] = s;
        }
    }
}

struct DpTile {
    const uint16_t* W;
    int64_t K;
    const uint16_t* Xb;
    const float* X;
    float* Y;
    int64_t ldy;
    template <int NR, int MR>
    void run(int64_t n, int64_t m) const { bf16_tile_dp<NR, MR>(W, K, Xb, X, n, m, Y, ldy); }
};
#endif

// Prefetch slice `part` of `parts` of [next, next + bytes) into L1 (cache lines).
inline void prefetch_part(const char* next, int64_t bytes, int64_t part, int64_t parts) {
    const int64_t slice = (bytes + parts - 1) / parts;
    const int64_t end = std::min(bytes, (part + 1) * slice);
    for (int64_t b = part * slice; b < end; b += 64) _mm_prefetch(next + b, _MM_HINT_T0);
}

#if defined(__AVX512BF16__)
// Row n of a quantized segment as bf16, 32 columns (one Q4 block) at a time: Q8
// bf16(code * s), Q4 bf16(d * code + m) (one fused multiply-add), 16 lanes a conversion
// (dequantized_bf16).
struct QuantRows {
    int64_t kind, K;
    const int8_t* w8 = nullptr;     // Q8: codes [rows, K]
    const float* s8 = nullptr;      //     scales [rows]
    const uint8_t* w4 = nullptr;    // Q4: codes [rows, K / 2]
    const uint16_t* ds = nullptr;   //     fp16 d [nb] then m [nb] per row
    QuantRows(const Segment& g, int64_t K_) : kind(g.kind), K(K_) {
        if (kind == Q8) {
            w8 = g.w.data_ptr<int8_t>();
            s8 = g.s.data_ptr<float>();
        } else {
            w4 = g.w.data_ptr<uint8_t>();
            ds = reinterpret_cast<const uint16_t*>(g.s.data_ptr<at::Half>());
        }
    }
    void row32(int64_t n, int64_t s, uint16_t* out) const {
        __m512 lo, hi;
        if (kind == Q8) {
            const int8_t* w = w8 + n * K + 32 * s;
            const __m512 sc = _mm512_set1_ps(s8[n]);
            lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                   _mm_loadu_si128(reinterpret_cast<const __m128i*>(w)))), sc);
            hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                   _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16)))), sc);
        } else {  // byte j of the block: column j (low nibble), column j + 16 (high)
            const int64_t nb = K / QBLOCK;
            const __m128i b = _mm_loadu_si128(
                reinterpret_cast<const __m128i*>(w4 + n * (K / 2) + 16 * s));
            const __m128i low4 = _mm_set1_epi8(0x0f);
            const __m512 d = _mm512_set1_ps(_cvtsh_ss(ds[n * nb * 2 + s]));
            const __m512 m = _mm512_set1_ps(_cvtsh_ss(ds[n * nb * 2 + nb + s]));
            lo = _mm512_fmadd_ps(
                d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, low4))), m);
            hi = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                        _mm_and_si128(_mm_srli_epi16(b, 4), low4))), m);
        }
        _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
};
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// AMX (Intel since Sapphire Rapids): tdpbf16ps multiplies a 16 x 32 bf16 tile by a 32 x 16
// one into 16 x 16 fp32 accumulators, 16,384 flops per instruction against vdpbf16ps's
// 64. Here the weight rows are the left tile as they lie in memory (16 rows of 32 columns,
// row stride K), the activations the right one, repacked per call into pairs of columns
// (the VNNI layout tdpbf16ps takes: row p holds columns 2p and 2p + 1 of each activation
// row): Y^T = W X^T, no weight repacking. Every output sums its column pairs in column
// order whatever the batch, so a token's result does not depend on the tokens beside it.

// Linux hands out AMX tile state per process on request; false where the kernel or CPU
// refuses (then the AVX512-BF16 tiles run).
bool amx_usable() {
    static const bool ok = [] {
        constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }();
    const char* env = std::getenv("PDSERVE_CPU_AMX");
    return ok && !(env && env[0] == '0');
}

struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// Tile registers are not renamed: a tile load waits for the multiplies still reading the
// tile it overwrites. So loads alternate between two sets of tiles (even and odd column
// steps), and the next step's operands load while this step's multiply.
// M > 16 (TWO): 16 weight rows a block, accumulators 0 (activation rows 0-15) and 1 (16+);
// weights in 2 (even) / 3 (odd), activations in 4, 5 (even) / 6, 7 (odd).
// M <= 16: 32 weight rows a block, accumulators 0 (rows 0-15) and 1 (16-31); weights in
// 2, 3 (even) / 4, 5 (odd), activations in 6 (even) / 7 (odd).
template <bool TWO>
inline void amx_configure(int64_t M) {
    TileConfig c;
    for (int t = 0; t < 8; ++t) c.rows[t] = 16;
    if (TWO) {
        const uint16_t a = 64, b = static_cast<uint16_t>((M - 16) * 4);
        c.colsb[0] = c.colsb[4] = c.colsb[6] = a;
        c.colsb[1] = c.colsb[5] = c.colsb[7] = b;
        c.colsb[2] = c.colsb[3] = 64;
    } else {
        const uint16_t a = static_cast<uint16_t>(M * 4);
        c.colsb[0] = c.colsb[1] = c.colsb[6] = c.colsb[7] = a;
        c.colsb[2] = c.colsb[3] = c.colsb[4] = c.colsb[5] = 64;
    }
    _tile_loadconfig(&c);
}

// out[j][i] = in[i][j] for a 16 x 16 fp32 block (in: row stride 16; out: row stride ldo),
// rows j < rows_out only.
inline void transpose16(const float* in, float* out, int64_t ldo, int64_t rows_out) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_load_ps(in + 16 * i);
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 2]);
        const __m512d c = _mm512_castps_pd(t[i + 1]), d = _mm512_castps_pd(t[i + 3]);
        r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
        r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
        r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
    }
    for (int i = 0; i < 4; ++i) {
        for (int h = 0; h < 2; ++h) {
            const int a = 8 * h + i, b = 8 * h + 4 + i;
            t[a] = _mm512_shuffle_f32x4(r[a], r[b], 0x88);
            t[b] = _mm512_shuffle_f32x4(r[a], r[b], 0xDD);
        }
    }
    for (int i = 0; i < 8; ++i) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    }
    for (int q = 0; q < rows_out; ++q) _mm512_storeu_ps(out + q * ldo, r[q]);  // column q
}

// Prefetch the 64-byte lines of `rows` weight rows at column step `s` (32 columns).
inline void prefetch_rows(const uint16_t* w, int64_t K, int64_t rows, int64_t s) {
    for (int64_t r = 0; r < rows; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + r * K + s * 32), _MM_HINT_T0);
}

constexpr int64_t AMX_AHEAD = 6;  // column steps prefetched ahead

// Weight rows [n0, n1) (a multiple of the block) times activation rows 0 .. M (M <= 32)
// into Y. Xv: the activations in pairs, [2 blocks][K / 2][16 rows][2]; nmax: rows that
// exist (prefetches stop there).
template <bool TWO>
void amx_rows(const uint16_t* W, int64_t K, const uint16_t* Xv, int64_t M, int64_t n0,
              int64_t n1, int64_t nmax, float* Y, int64_t ldy) {
    constexpr int64_t R = TWO ? 16 : 32;  // weight rows a block
    amx_configure<TWO>(M);
    alignas(64) float c[2][16][16];
    const int64_t steps = K / 32, half = (K / 2) * 32;
    const int64_t lda = K * 2;
    for (int64_t n = n0; n < n1; n += R) {
        const uint16_t* w = W + n * K;
        const bool next = n + 2 * R <= nmax;
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t s = 0; s < steps; ++s) {
            const int64_t p = s + AMX_AHEAD;
            if (p < steps) prefetch_rows(w, K, R, p);
            else if (next) prefetch_rows(w + R * K, K, R, p - steps);
            const uint16_t* xs = Xv + s * 512;
            // the two tile sets spelled out: GCC's tile intrinsics paste the tile number
            // into the instruction text, so it must be a literal (not a template argument)
            if (TWO) {
                if (s & 1) {
                    _tile_loadd(3, w + s * 32, lda);
                    _tile_loadd(6, xs, 64);
                    _tile_loadd(7, xs + half, 64);
                    _tile_dpbf16ps(0, 3, 6);
                    _tile_dpbf16ps(1, 3, 7);
                } else {
                    _tile_loadd(2, w + s * 32, lda);
                    _tile_loadd(4, xs, 64);
                    _tile_loadd(5, xs + half, 64);
                    _tile_dpbf16ps(0, 2, 4);
                    _tile_dpbf16ps(1, 2, 5);
                }
            } else {
                if (s & 1) {
                    _tile_loadd(4, w + s * 32, lda);
                    _tile_loadd(5, w + 16 * K + s * 32, lda);
                    _tile_loadd(7, xs, 64);
                    _tile_dpbf16ps(0, 4, 7);
                    _tile_dpbf16ps(1, 5, 7);
                } else {
                    _tile_loadd(2, w + s * 32, lda);
                    _tile_loadd(3, w + 16 * K + s * 32, lda);
                    _tile_loadd(6, xs, 64);
                    _tile_dpbf16ps(0, 2, 6);
                    _tile_dpbf16ps(1, 3, 6);
                }
            }
        }
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        if (TWO) {  // c[a][i][j]: weight row n + i, activation row 16a + j
            transpose16(c[0][0], Y + n, ldy, 16);
            transpose16(c[1][0], Y + 16 * ldy + n, ldy, M - 16);
        } else {  // c[b][i][j]: weight row n + 16b + i, activation row j
            transpose16(c[0][0], Y + n, ldy, M);
            transpose16(c[1][0], Y + n + 16, ldy, M);
        }
    }
}

// Y [M, ldy] (columns 0 .. N32) = X W^T for the first N32 (a multiple of 32) weight rows;
// K % 32 == 0, M <= 32. Xb: the activations as bf16 [M, K].
void gemm_amx(const uint16_t* W, int64_t K, int64_t N32, const uint16_t* Xb, int64_t M,
              float* Y, int64_t ldy) {
    std::vector<uint16_t> xv(2 * K * 16);
    for (int64_t m = 0; m < M; ++m) {
        uint16_t* dst = xv.data() + (m >= 16 ? K * 16 : 0) + (m & 15) * 2;
        const uint16_t* src = Xb + m * K;
        for (int64_t p = 0; p < K / 2; ++p) {
            dst[p * 32] = src[2 * p];
            dst[p * 32 + 1] = src[2 * p + 1];
        }
    }
    dynamic_for(0, N32 / 32, 2, [&](int64_t begin, int64_t end) {
        if (M > 16) amx_rows<true>(W, K, xv.data(), M, begin * 32, end * 32, N32, Y, ldy);
        else amx_rows<false>(W, K, xv.data(), M, begin * 32, end * 32, N32, Y, ldy);
    });
}

// Prefill attention in AMX tiles (cpu_amx_attention.cpp, later in this translation unit).
// One chunk: n queries q [n, ldq] bf16 (head h at column h * 64) after lk - n context
// positions; keys as AMX tiles, k [Hkv][lkp / 16][2 (dimensions 0-31, 32-63)][16][32] bf16
// (keys lk .. lkp zero, lkp = lk rounded up to 32); values transposed per block of 32 keys,
// vt [Hkv][2 (dimensions 0-31, 32-63)][lkp / 32][32][32] bf16 (keys lk .. lkp zero); out
// [n, ldo] bf16.
struct FlashChunk {
    const uint16_t* q;
    int64_t ldq;
    const uint16_t* k;
    const uint16_t* vt;
    int64_t n, lk, lkp;
    uint16_t* out;  // bf16 rows, stride ldo
    int64_t ldo;
};
// Every chunk's causal attention (query i of a chunk sees keys 0 .. lk - n + i), head_dim
// 64, on torch's threads.
void flash_amx(const std::vector<FlashChunk>& chunks, int64_t Hq, int64_t Hkv, float scale);
// Key blocks [b0, b1) (32 keys each) of one chunk in FlashChunk's layout: k and vt from the
// rows of keys 0 .. lk (krows[j], vrows[j]: kv_size bf16 each), zeros after.
void pack_kv(const uint16_t* const* krows, const uint16_t* const* vrows, int64_t lk,
             int64_t lkp, int64_t kv_size, int64_t b0, int64_t b1, uint16_t* k, uint16_t* vt);
// Python's view of flash_amx over one chunk: q [n, H, 64], k/v [num_context + n, Hkv, 64]
// bf16 -> [n, H, 64] bf16.
torch::Tensor amx_prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                    int64_t num_context, double scale);
#endif


// Rows of a weight panel against every activation row, 4 at a time, then the 1-3 left
// (NR weight rows per tile for each activation row count). Meanwhile the next panel
// ([next, next + next_bytes)) is prefetched, a slice per group of rows: the tiles read a
// panel's rows as short interleaved streams, which the hardware prefetchers do not
// follow (the first group's weight loads stalled on memory).
template <int NR4, int NR3, int NR2, int NR1, typename Tile>
inline void bf16_panel(Tile tile, int64_t n0, int64_t n1, int64_t M, const char* next,
                       int64_t next_bytes) {
    const int64_t groups = (M + 3) / 4;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) {
        prefetch_part(next, next_bytes, m / 4, groups);
        bf16_rows<NR4, 4>(tile, n0, n1, m);
    }
    if (m < M) prefetch_part(next, next_bytes, m / 4, groups);
    switch (M - m) {
        case 3: bf16_rows<NR3, 3>(tile, n0, n1, m); break;
        case 2: bf16_rows<NR2, 2>(tile, n0, n1, m); break;
        case 1: bf16_rows<NR1, 1>(tile, n0, n1, m); break;
        default: break;
    }
}

// Every panel of weight rows [begin, end) (a thread's share) against every activation row.
template <int NR4, int NR3, int NR2, int NR1, typename Tile>
inline void bf16_panels(Tile tile, const uint16_t* W, int64_t K, int64_t begin, int64_t end,
                        int64_t panel, int64_t M) {
    for (int64_t p = begin; p < end; p += panel) {
        const int64_t p1 = std::min(end, p + panel), q1 = std::min(end, p1 + panel);
        bf16_panel<NR4, NR3, NR2, NR1>(tile, p, p1, M, reinterpret_cast<const char*>(W + p1 * K),
                                       (q1 - p1) * K * 2);
    }
}

// Y = X W^T over a bf16 segment. The weight goes through in panels of ~24 KB (L1) and
// every activation row meets a panel while it is cached: the weight is read from memory
// once per call whatever M (a 32-row LM head read its 56 MB eight times before).
// bf16_x: X holds bf16 values (the fused layers' inputs always do), which the AVX512-BF16
// build then multiplies as bf16 pairs; otherwise (any fp32 rows) the AVX2 tiles run.
void gemv_bf16(const Segment& g, int64_t K, const float* X, int64_t M, float* Y, int64_t ldy,
               bool bf16_x = true) {
    const uint16_t* W = reinterpret_cast<const uint16_t*>(g.w.data_ptr<at::BFloat16>());
    const int64_t panel = std::max<int64_t>(8, (24576 / (2 * K)) / 8 * 8);
#if defined(__AVX512BF16__)
    if (bf16_x) {
        std::vector<uint16_t> xb(M * K);  // exact: the values are bf16 ones
        to_bf16(X, xb.data(), M * K);
        int64_t n_amx = 0;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
        if (K % 32 == 0 && M <= 32 && amx_usable()) {
            n_amx = g.rows / 32 * 32;
            if (n_amx) gemm_amx(W, K, n_amx, xb.data(), M, Y, ldy);
        }
#endif
        if (n_amx == g.rows) return;
        const DpTile tile{W, K, xb.data(), X, Y, ldy};
        dynamic_for(n_amx, g.rows, 4 * panel, [&](int64_t begin, int64_t end) {
            bf16_panels<4, 4, 8, 8>(tile, W, K, begin, end, panel, M);
        });
        return;
    }
#endif
    const Avx2Tile tile{W, K, X, Y, ldy};
    dynamic_for(0, g.rows, 4 * panel, [&](int64_t begin, int64_t end) {
        bf16_panels<2, 2, 4, 8>(tile, W, K, begin, end, panel, M);
    });
}

// One int4 weight row against MC activation rows (MC a compile-time count, so the
// accumulators stay in registers): sum over blocks of d * dx * (codes . xq) + m * sum(x).
// ds: the row's fp16 scales d [nb] then offsets m [nb]; dd: scratch [MC * nb].
template <int MC>
inline void q4_row(const uint8_t* row, const uint16_t* ds, int64_t nb, const QuantAct& a,
                   int64_t m0, float* y, int64_t ldy, float* dd) {
    const __m128i low4 = _mm_set1_epi8(0x0f);
    const __m256i ones = _mm256_set1_epi16(1);
    const int8_t* xq = a.q.data() + m0 * nb * QBLOCK;
    const float* xd = a.d.data() + m0 * nb;
    const float* xs = a.s.data() + m0 * nb;
    __m256 acc[MC], acc2[MC], mv[MC];  // acc: even blocks, acc2: odd ones (two FMA chains)
    float mterm[MC];
    for (int m = 0; m < MC; ++m) {
        acc[m] = _mm256_setzero_ps();
        acc2[m] = _mm256_setzero_ps();
        mv[m] = _mm256_setzero_ps();
        mterm[m] = 0.f;
    }
    int64_t b = 0;  // dd = d * dx per block; mterm = sum of m * sum(x)
    for (; b + 8 <= nb; b += 8) {
        const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ds + b)));
        const __m256 m8 = _mm256_cvtph_ps(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(ds + nb + b)));
        for (int m = 0; m < MC; ++m) {
            _mm256_storeu_ps(dd + m * nb + b, _mm256_mul_ps(d8, _mm256_loadu_ps(xd + m * nb + b)));
            mv[m] = _mm256_fmadd_ps(m8, _mm256_loadu_ps(xs + m * nb + b), mv[m]);
        }
    }
    for (; b < nb; ++b) {
        const float d = f16_value(ds[b]), mn = f16_value(ds[nb + b]);
        for (int m = 0; m < MC; ++m) {
            dd[m * nb + b] = d * xd[m * nb + b];
            mterm[m] += mn * xs[m * nb + b];
        }
    }
    const __m256i low4x2 = _mm256_set1_epi8(0x0f);
    b = 0;
#if defined(__AVX512VNNI__)
    // Two blocks per vpdpbusd: int32 lane i holds the 4 products of columns 4i .. 4i + 3
    // of block b (lanes 0-7) or b + 1 (lanes 8-15), the same integers as maddubs + madd
    // below, scaled and summed into the same lanes as acc (even) and acc2 (odd): the same
    // result bit for bit, in a third of the instructions.
    __m512 acc16[MC];
    for (int m = 0; m < MC; ++m) acc16[m] = _mm512_setzero_ps();
    for (; b + 2 <= nb; b += 2) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * 16));
        const __m256i lo = _mm256_and_si256(v, low4x2);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4x2);
        const __m512i q = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_permute2x128_si256(lo, hi, 0x20)),
            _mm256_permute2x128_si256(lo, hi, 0x31), 1);
        for (int m = 0; m < MC; ++m) {
            const __m512i p = _mm512_dpbusd_epi32(
                _mm512_setzero_si512(), q, _mm512_loadu_si512(xq + (m * nb + b) * QBLOCK));
            const __m512 sc = _mm512_insertf32x8(
                _mm512_castps256_ps512(_mm256_broadcast_ss(dd + m * nb + b)),
                _mm256_broadcast_ss(dd + m * nb + b + 1), 1);
            acc16[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), sc, acc16[m]);
        }
    }
    for (int m = 0; m < MC; ++m) {
        acc[m] = _mm512_castps512_ps256(acc16[m]);
        acc2[m] = _mm512_extractf32x8_ps(acc16[m], 1);
    }
#endif
    for (; b + 2 <= nb; b += 2) {  // two blocks per 32-byte load
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * 16));
        const __m256i lo = _mm256_and_si256(v, low4x2);                       // cols 0-15
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4x2);  // cols 16-31
        const __m256i q0 = _mm256_permute2x128_si256(lo, hi, 0x20);  // block b
        const __m256i q1 = _mm256_permute2x128_si256(lo, hi, 0x31);  // block b + 1
        for (int m = 0; m < MC; ++m) {
            const int8_t* x = xq + (m * nb + b) * QBLOCK;
            const __m256i p0 = _mm256_madd_epi16(
                _mm256_maddubs_epi16(q0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))),
                ones);
            const __m256i p1 = _mm256_madd_epi16(
                _mm256_maddubs_epi16(
                    q1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + QBLOCK))),
                ones);
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_broadcast_ss(dd + m * nb + b),
                                     acc[m]);
            acc2[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1),
                                      _mm256_broadcast_ss(dd + m * nb + b + 1), acc2[m]);
        }
    }
    for (; b < nb; ++b) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 16));
        const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low4),
                                           _mm_and_si128(v, low4));
        for (int m = 0; m < MC; ++m) {
            const __m256i x = _mm256_loadu_si256(
                reinterpret_cast<const __m256i*>(xq + (m * nb + b) * QBLOCK));
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), ones);
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(dd + m * nb + b),
                                     acc[m]);
        }
    }
    for (int m = 0; m < MC; ++m)
        y[(m0 + m) * ldy] = hsum(_mm256_add_ps(acc[m], acc2[m])) + (hsum(mv[m]) + mterm[m]);
}

// One int8 weight row (per-channel scale s) against MC activation rows.
template <int MC>
inline void q8_row(const int8_t* row, float s, int64_t nb, const QuantAct& a, int64_t m0,
                   float* y, int64_t ldy) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int8_t* xq = a.q.data() + m0 * nb * QBLOCK;
    const float* xd = a.d.data() + m0 * nb;
    __m256 acc[MC];
    for (int m = 0; m < MC; ++m) acc[m] = _mm256_setzero_ps();
    int64_t b = 0;
#if defined(__AVX512VNNI__)
    // Two blocks per vpdpbusd (|w| times x with w's sign): lanes 0-7 sum block b's products,
    // 8-15 block b + 1's, each half scaled by its block's activation scale; the halves are
    // added at the end (another order of the fp32 sums than the AVX2 loop below).
    __m512 acc16[MC];
    for (int m = 0; m < MC; ++m) acc16[m] = _mm512_setzero_ps();
    for (; b + 2 <= nb; b += 2) {
        const __m512i w = _mm512_loadu_si512(row + b * 32);
        const __m512i aw = _mm512_abs_epi8(w);
        const __mmask64 neg = _mm512_movepi8_mask(w);
        for (int m = 0; m < MC; ++m) {
            const __m512i x = _mm512_loadu_si512(xq + (m * nb + b) * QBLOCK);
            // x with w's sign (0 where w is 0: then |w| is 0 too)
            const __m512i sx = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
            const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), aw, sx);
            const __m512 sc = _mm512_insertf32x8(
                _mm512_castps256_ps512(_mm256_set1_ps(xd[m * nb + b])),
                _mm256_set1_ps(xd[m * nb + b + 1]), 1);
            acc16[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), sc, acc16[m]);
        }
    }
    for (int m = 0; m < MC; ++m)
        acc[m] = _mm256_add_ps(_mm512_castps512_ps256(acc16[m]),
                               _mm512_extractf32x8_ps(acc16[m], 1));
#endif
    for (; b < nb; ++b) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * 32));
        const __m256i aw = _mm256_sign_epi8(w, w);  // |w|: maddubs wants unsigned left
        for (int m = 0; m < MC; ++m) {
            const __m256i x = _mm256_loadu_si256(
                reinterpret_cast<const __m256i*>(xq + (m * nb + b) * QBLOCK));
            const __m256i p = _mm256_madd_epi16(
                _mm256_maddubs_epi16(aw, _mm256_sign_epi8(x, w)), ones);
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(xd[m * nb + b]),
                                     acc[m]);
        }
    }
    for (int m = 0; m < MC; ++m) y[(m0 + m) * ldy] = hsum(acc[m]) * s;
}

// Calls row_fn<MC>(m0) for activation rows in chunks of 4, then the rest (1-3).
template <template <int> class Rows, typename... Args>
inline void for_row_chunks(int64_t M, Args&&... args) {
    int64_t m0 = 0;
    for (; m0 + 4 <= M; m0 += 4) Rows<4>::run(m0, args...);
    switch (M - m0) {
        case 3: Rows<3>::run(m0, args...); break;
        case 2: Rows<2>::run(m0, args...); break;
        case 1: Rows<1>::run(m0, args...); break;
        default: break;
    }
}

template <int MC>
struct Q4Rows {
    static void run(int64_t m0, const uint8_t* row, const uint16_t* ds, int64_t nb,
                    const QuantAct& a, float* y, int64_t ldy, float* dd) {
        q4_row<MC>(row, ds, nb, a, m0, y, ldy, dd);
    }
};

template <int MC>
struct Q8Rows {
    static void run(int64_t m0, const int8_t* row, float s, int64_t nb, const QuantAct& a,
                    float* y, int64_t ldy) {
        q8_row<MC>(row, s, nb, a, m0, y, ldy);
    }
};

void gemv_q4(const Segment& g, int64_t K, const QuantAct& a, int64_t M, float* Y, int64_t ldy) {
    const uint8_t* W = g.w.data_ptr<uint8_t>();
    const uint16_t* DS = reinterpret_cast<const uint16_t*>(g.s.data_ptr<at::Half>());
    const int64_t nb = K / QBLOCK;
    at::parallel_for(0, g.rows, 16, [&](int64_t begin, int64_t end) {
        std::vector<float> dd(4 * nb);
        for (int64_t n = begin; n < end; ++n) {
            for_row_chunks<Q4Rows>(M, W + n * (K / 2), DS + n * nb * 2, nb, a, Y + n, ldy,
                                   dd.data());
        }
    });
}

void gemv_q8(const Segment& g, int64_t K, const QuantAct& a, int64_t M, float* Y, int64_t ldy) {
    const int8_t* W = g.w.data_ptr<int8_t>();
    const float* S = g.s.data_ptr<float>();
    const int64_t nb = K / QBLOCK;
    at::parallel_for(0, g.rows, 16, [&](int64_t begin, int64_t end) {
        for (int64_t n = begin; n < end; ++n) {
            for_row_chunks<Q8Rows>(M, W + n * K, S[n], nb, a, Y + n, ldy);
        }
    });
}

// y [M, N] = bf16(x [M, K] @ W^T + bias) for bf16 weights through torch's GEMM: the eager
// layer's own call (F.linear in bf16), so the same value as the eager model.
// The conversions are this file's own (rows split over the threads, 16 lanes where the
// build has AVX512): torch's copies between bf16 and fp32 took as long as the GEMMs of a
// 4,096-token step (AVX2 kernels, one pass per tensor).
// The bf16 results [M, rows] of x (bf16 [M, K]) times each bf16 segment of L (+ bias).
// Below SPLIT_GEMM_ROWS rows, the rows are split over torch's threads, each running torch's
// GEMM on its share alone (inside the parallel region it runs on one thread): given both
// threads, oneDNN's own split of M = 768-1,400 rows ran at half speed where N = 576 (a
// 2-core Xeon with AMX: 1,024 x 1,536 x 576 1.52 us a row, each thread on half the rows
// 0.89; 1,500 rows 0.77 either way; a 2,117-token prompt in 1,024-token steps, two runs
// each alternating: GEMMs 340-349 ms, split 321-324). Steps of that size are a chunked
// prompt's last chunk, a short prompts' batch, or a decode worker's prefill.
constexpr int64_t SPLIT_GEMM_ROWS = 1408;

// Steps of at most PACKED_MAX_ROWS rows, and steps not split (SPLIT_GEMM_ROWS rows or
// more), take a bf16 segment's GEMM on its weight reordered once into oneDNN's blocked
// layout (the same values: checked equal to torch's GEMM at 64 to 3,008 rows): torch's
// GEMM on the plain [N, K] weight reorders it inside every call. bench/cpu_gemm.py
// --weights bf16,bf16-packed on a 2-core Xeon with AMX (a step's GEMMs of SmolLM2's 30
// layers and LM head, weights streamed from memory): 38.9 -> 26.6 ms at 128 rows, 56.5 ->
// 36.2 at 256; at 512 rows 81.9 against 87.4 (no gain). In the fused forward (SmolLM2,
// alternating in one process, GEMMs a token): the 32 x 128 batch in one step 96.7 ->
// 91.9 us, a 3,000-token prompt in two steps of 1,504 rows 101.6 -> 96.4, 11 x 128 rows
// 98.6 -> 87.3; at 768-1,280 rows the split GEMM stays faster (1,024: 105.6 against 126.6).
constexpr int64_t PACKED_MAX_ROWS = 384;

// g's weight in oneDNN's blocked layout (made on first use, under a lock: the GEMM warm-up
// thread and the forward may ask at once), or an undefined tensor where torch has no
// mkldnn bf16 linear.
const torch::Tensor& packed_weight(const Segment& g) {
    static std::mutex lock;
    static bool usable = at::hasMKLDNN() &&
        c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""}).has_value();
    std::lock_guard<std::mutex> hold(lock);
    if (!g.packed.defined() && usable && g.kind == BF16) {
        try {
            static auto reorder = c10::Dispatcher::singleton()
                .findSchemaOrThrow("mkldnn::_reorder_linear_weight", "")
                .typed<at::Tensor(const at::Tensor&, std::optional<int64_t>)>();
            g.packed = reorder.call(g.w, PACKED_MAX_ROWS / 3);
        } catch (const std::exception&) {  // this torch cannot: the stored weights serve
            usable = false;
        }
    }
    return g.packed;
}

// y [M, g.rows] bf16 = x [M, K] bf16 @ packed^T (+ bias [g.rows] bf16, or undefined).
torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& packed,
                            const torch::Tensor& bias) {
    static auto op = c10::Dispatcher::singleton()
        .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
        .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                          c10::string_view, c10::List<std::optional<at::Scalar>>,
                          std::optional<c10::string_view>)>();
    return op.call(x, packed, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt,
                   "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
}

// A quantized segment's weight as bf16 [rows, K] (Q4: d * code + m per block of 32 in one
// fused multiply-add, Q8: code * s per row, rounded to bf16 once), for the prefill GEMMs of
// a step of more than 32 rows: rebuilt in each call (a thread's scratch, no second copy of
// the weights kept), rows split over the threads, 16 lanes at a time where the build has
// AVX512-BF16 (QuantRows). SmolLM2's 30 layers: ~105 M weights a step. slot: the segment's
// index in its layer (each slot its own scratch, reused by the next layer's call).
torch::Tensor dequantized_bf16(const Segment& g, int64_t K, size_t slot) {
    thread_local std::vector<torch::Tensor> scratch;
    if (scratch.size() <= slot) scratch.resize(slot + 1);
    if (!scratch[slot].defined() || scratch[slot].numel() < g.rows * K)
        scratch[slot] = torch::empty({g.rows * K}, torch::kBFloat16);
    torch::Tensor view = scratch[slot].narrow(0, 0, g.rows * K).view({g.rows, K});
    uint16_t* out = reinterpret_cast<uint16_t*>(view.data_ptr<at::BFloat16>());
    at::parallel_for(0, g.rows, 16, [&](int64_t r0, int64_t r1) {
#if defined(__AVX512BF16__)
        const QuantRows q(g, K);
        for (int64_t n = r0; n < r1; ++n)
            for (int64_t s = 0; s < K / 32; ++s) q.row32(n, s, out + n * K + 32 * s);
#else
        const int64_t nb = K / QBLOCK;
        std::vector<float> row(K);
        for (int64_t n = r0; n < r1; ++n) {
            if (g.kind == Q8) {
                const int8_t* w = g.w.data_ptr<int8_t>() + n * K;
                const float sc = g.s.data_ptr<float>()[n];
                for (int64_t k = 0; k < K; ++k) row[k] = static_cast<float>(w[k]) * sc;
            } else {  // Q4: byte j of a block holds column j (low nibble) and j + 16 (high)
                const uint8_t* w = g.w.data_ptr<uint8_t>() + n * (K / 2);
                const at::Half* ds = g.s.data_ptr<at::Half>() + n * nb * 2;
                for (int64_t b = 0; b < nb; ++b) {
                    const float d = static_cast<float>(ds[b]), m = static_cast<float>(ds[nb + b]);
                    for (int j = 0; j < 16; ++j) {
                        const uint8_t byte = w[b * 16 + j];
                        row[b * 32 + j] = std::fma(d, static_cast<float>(byte & 15), m);
                        row[b * 32 + j + 16] = std::fma(d, static_cast<float>(byte >> 4), m);
                    }
                }
            }
            to_bf16(row.data(), out + n * K, K);
        }
#endif
    });
    return view;
}

std::vector<torch::Tensor> linear_torch_bf16(const Linear& L, const torch::Tensor& x) {
    const int64_t M = x.size(0), threads = at::get_num_threads();
    const bool split = M >= 64 * threads && M < SPLIT_GEMM_ROWS && !at::in_parallel_region();
    if (M <= PACKED_MAX_ROWS || !split) {
        std::vector<torch::Tensor> ys;
        int64_t col = 0;
        for (const Segment& g : L.segs) {
            const torch::Tensor& packed = packed_weight(g);
            if (!packed.defined()) {
                ys.clear();
                break;
            }
            ys.push_back(packed_linear(x, packed, L.bias_bf16.defined()
                                                      ? L.bias_bf16.narrow(0, col, g.rows)
                                                      : torch::Tensor()));
            col += g.rows;
        }
        if (!ys.empty()) return ys;
    }
    std::vector<torch::Tensor> ys, wq(L.segs.size());
    for (size_t i = 0; i < L.segs.size(); ++i) {
        const Segment& g = L.segs[i];
        ys.push_back(torch::empty({M, g.rows}, torch::kBFloat16));
        if (g.kind != BF16) wq[i] = dequantized_bf16(g, L.K, i);
    }
    const int64_t parts = split ? threads : 1;
    at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
        c10::InferenceMode inference;  // a worker thread's own mode: the tensors' (no autograd)
        for (int64_t p = p0; p < p1; ++p) {
            const int64_t r0 = M * p / parts, r1 = M * (p + 1) / parts;
            if (r1 == r0) continue;
            const auto xs = x.narrow(0, r0, r1 - r0);
            int64_t col = 0;
            for (size_t i = 0; i < ys.size(); ++i) {
                const Segment& g = L.segs[i];
                const torch::Tensor& w = g.kind == BF16 ? g.w : wq[i];
                auto out = ys[i].narrow(0, r0, r1 - r0);
                if (L.bias_bf16.defined())
                    at::addmm_out(out, L.bias_bf16.narrow(0, col, g.rows), xs, w.t());
                else
                    at::mm_out(out, xs, w.t());
                col += g.rows;
            }
        }
    });
    return ys;
}

inline const uint16_t* bf16_data(const torch::Tensor& t) {
    return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}

// Rows of a torch GEMM's operands for a step of M rows: more than MAX_GEMV_ROWS go up to a
// multiple of 32, the rows past M zeros (their results unread). oneDNN builds (JIT-compiles)
// a kernel for each new shape, and each prompt length was one: a 2-core Xeon, 1,400-1,600
// token prompts of distinct lengths took 372-398 ms per 1,500 tokens against 335-360 for
// one length repeated. Padded, at most 128 shapes per layer GEMM up to 4,096 rows, which
// oneDNN's primitive cache (1,024 entries) keeps.
inline int64_t gemm_rows(int64_t M) { return M > MAX_GEMV_ROWS ? (M + 31) / 32 * 32 : M; }

// A bf16 [gemm_rows(M), K] tensor for M rows of data, the padding rows zeroed.
torch::Tensor gemm_input(int64_t M, int64_t K) {
    auto x = torch::empty({gemm_rows(M), K}, torch::kBFloat16);
    if (x.size(0) > M) x.narrow(0, M, x.size(0) - M).zero_();
    return x;
}

// X [M, K] fp32 holding bf16 values as a bf16 tensor, padded (gemm_input; rows split over
// the threads).
torch::Tensor bf16_rows(const float* X, int64_t M, int64_t K) {
    auto x = gemm_input(M, K);
    uint16_t* xb = const_cast<uint16_t*>(bf16_data(x));
    at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
        to_bf16(X + r0 * K, xb + r0 * K, (r1 - r0) * K);
    });
    return x;
}

// Y [M, ldy] columns col .. col + N = y, a bf16 [M, N] tensor (rows split over the threads).
void rows_from_bf16(const torch::Tensor& y, int64_t M, int64_t N, float* Y, int64_t ldy,
                    int64_t col) {
    const uint16_t* yb = bf16_data(y);
    at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) from_bf16(yb + r * N, Y + r * ldy + col, N);
    });
}

// Y [M, N] fp32 = xb (bf16 [M, K]) times L's bf16 segments through torch.
void linear_torch_from_bf16(const Linear& L, const torch::Tensor& xb, int64_t M, float* Y) {
    const auto ys = linear_torch_bf16(L, xb);
    int64_t col = 0;
    for (size_t i = 0; i < ys.size(); ++i) {
        rows_from_bf16(ys[i], M, L.segs[i].rows, Y, L.N, col);
        col += L.segs[i].rows;
    }
}

void linear_torch(const Linear& L, const float* X, int64_t M, float* Y) {
    linear_torch_from_bf16(L, bf16_rows(X, M, L.K), M, Y);
}

#if defined(__AVX512VNNI__)
// Q8 segments in 16-row tiles (cpu_quant_tiles.cpp, later in this translation unit).
void q8_tiles(Segment& g, int64_t K);
void gemv_q8t(const Segment& g, int64_t K, const QuantAct& a, int64_t M, float* Y, int64_t ldy);
void q4_tiles(Segment& g, int64_t K);
void gemv_q4t(const Segment& g, int64_t K, const QuantAct& a, int64_t M, float* Y, int64_t ldy);
#endif

// y [M, N] = X W^T for a quantized segment: its 16-row tiles' kernel where make_linear
// made them (q8_tiles, q4_tiles), else the per-row one.
void linear_quant(const Segment& g, int64_t K, const QuantAct& a, int64_t M, float* Y,
                  int64_t ldy) {
#if defined(__AVX512VNNI__)
    if (g.wt.defined()) return g.kind == Q4 ? gemv_q4t(g, K, a, M, Y, ldy)
                                            : gemv_q8t(g, K, a, M, Y, ldy);
#endif
    if (g.kind == Q4) gemv_q4(g, K, a, M, Y, ldy);
    else gemv_q8(g, K, a, M, Y, ldy);
}

// y [M, N] = bf16(x [M, K] @ W^T + bias): the eager layer's bf16 output.
void linear(const Linear& L, const float* X, int64_t M, float* Y) {
    if (M > MAX_GEMV_ROWS) return linear_torch(L, X, M, Y);  // quantized: dequantized_bf16
    QuantAct a;
    if (L.quantized_input) quantize_act(X, M, L.K, a);
    int64_t col = 0;
    for (const Segment& g : L.segs) {
        float* Yg = Y + col;
        if (g.kind == BF16) gemv_bf16(g, L.K, X, M, Yg, L.N);
        else linear_quant(g, L.K, a, M, Yg, L.N);
        col += g.rows;
    }
    // the bias and the rounding, split over the threads by columns when there are many
    // (an LM head's 32 x 49,152 logits took ~0.5 ms on one thread)
    const float* bias = L.bias.empty() ? nullptr : L.bias.data();
    const int64_t grain = M * L.N >= (1 << 16) ? std::max<int64_t>(256, (1 << 14) / M) : L.N;
    at::parallel_for(0, L.N, grain, [&](int64_t c0, int64_t c1) {
        for (int64_t m = 0; m < M; ++m) {
            float* y = Y + m * L.N + c0;
            add_round(y, bias ? bias + c0 : nullptr, y, c1 - c0);
        }
    });
}

Linear make_linear(const std::vector<std::tuple<int64_t, torch::Tensor, torch::Tensor>>& segs,
                   const torch::Tensor& bias, int64_t K) {
    Linear L;
    L.K = K;
    for (const auto& t : segs) {
        Segment g{std::get<0>(t), std::get<1>(t).size(0), std::get<1>(t).contiguous(),
                  std::get<2>(t).contiguous()};
        if (g.kind == BF16) {
            TORCH_CHECK(g.w.scalar_type() == torch::kBFloat16 && g.w.size(1) == K,
                        "bf16 segment must be bf16 [rows, K]");
        } else if (g.kind == Q4) {
            TORCH_CHECK(g.w.scalar_type() == torch::kUInt8 && g.w.size(1) == K / 2 &&
                            g.s.scalar_type() == torch::kHalf && g.s.numel() == g.rows * K / 16,
                        "int4 segment must be uint8 [rows, K/2] with fp16 [rows, 2, K/32]");
            L.quantized_input = true;
#if defined(__AVX512VNNI__)
            if (g.rows % 16 == 0 && K % QBLOCK == 0) q4_tiles(g, K);
#endif
        } else {
            TORCH_CHECK(g.kind == Q8 && g.w.scalar_type() == torch::kInt8 &&
                            g.w.size(1) == K && g.s.scalar_type() == torch::kFloat32 &&
                            g.s.numel() == g.rows,
                        "int8 segment must be int8 [rows, K] with fp32 [rows]");
            L.quantized_input = true;
#if defined(__AVX512VNNI__)
            if (g.rows % 16 == 0 && K % QBLOCK == 0) q8_tiles(g, K);
#endif
        }
        L.N += g.rows;
        L.segs.push_back(g);
    }
    TORCH_CHECK(!L.quantized_input || K % QBLOCK == 0, "quantized weights need K % 32 == 0");
    if (bias.numel()) {
        TORCH_CHECK(bias.numel() == L.N, "bias must have N elements");
        auto b = bias.to(torch::kFloat32).contiguous();
        L.bias.assign(b.data_ptr<float>(), b.data_ptr<float>() + L.N);
        L.bias_bf16 = bias.to(torch::kBFloat16).contiguous();
    }
    return L;
}

std::vector<float> to_floats(const torch::Tensor& t) {
    if (!t.numel()) return {};
    auto f = t.to(torch::kFloat32).contiguous();
    return std::vector<float>(f.data_ptr<float>(), f.data_ptr<float>() + f.numel());
}

// out = bf16(w * bf16(x * rsqrt(mean(x^2) + eps))) over rows of width H: eager RMSNorm.
void rmsnorm(const float* x, const std::vector<float>& w, int64_t rows, int64_t H, float eps,
             float* out) {
    parallel_rows(rows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
        const float* xr = x + r * H;
        __m256 ss8 = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= H; i += 8) {
            const __m256 v = _mm256_loadu_ps(xr + i);
            ss8 = _mm256_fmadd_ps(v, v, ss8);
        }
        float ss = hsum(ss8);
        for (int64_t j = i; j < H; ++j) ss += xr[j] * xr[j];
        const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
        const __m256 inv8 = _mm256_set1_ps(inv);
        i = 0;
#if defined(__AVX512BF16__)
        for (const __m512 inv16 = _mm512_set1_ps(inv); i + 16 <= H; i += 16) {
            const __m512 v = bf16_round16(_mm512_mul_ps(_mm512_loadu_ps(xr + i), inv16));
            const __m512 y = _mm512_mul_ps(_mm512_loadu_ps(&w[i]), v);
            _mm512_storeu_ps(out + r * H + i, bf16_round16(y));
        }
#endif
        for (; i + 8 <= H; i += 8) {
            const __m256 v = bf16_round8(_mm256_mul_ps(_mm256_loadu_ps(xr + i), inv8));
            const __m256 y = _mm256_mul_ps(_mm256_loadu_ps(&w[i]), v);
            _mm256_storeu_ps(out + r * H + i, bf16_round8(y));
        }
        for (; i < H; ++i) out[r * H + i] = bf16_round(w[i] * bf16_round(xr[i] * inv));
    }
    });
}

// res [M, H] = bf16(res + y) for y bf16 [M, H] (a torch GEMM's output rows), and x16
// [M, H] = rmsnorm(res) as bf16: the residual add, the norm and the next GEMM's input in one
// pass over the rows, each row's steps in L1 (add_round's and rmsnorm's arithmetic). A
// 1,500-token step had converted the GEMM's output to fp32, added, normed and converted
// back in four passes over [M, H] fp32 arrays.
void add_rmsnorm_bf16(const uint16_t* y, float* res, const std::vector<float>& w, int64_t M,
                      int64_t H, float eps, uint16_t* x16) {
    at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
        std::vector<float> row(H);
        for (int64_t r = r0; r < r1; ++r) {
            float* rr = res + r * H;
            from_bf16(y + r * H, row.data(), H);
            add_round(row.data(), rr, rr, H);
            rmsnorm(rr, w, 1, H, eps, row.data());  // one row: on this thread
            to_bf16(row.data(), x16 + r * H, H);
        }
    });
}

struct Layer {
    std::vector<float> input_norm, post_norm, q_norm, k_norm;
    Linear qkv, o, gate_up, down;
};

// 64-byte aligned storage for the decoder's scratch buffers: AMX tile rows and AVX-512
// loads must not straddle cache lines (glibc's malloc aligns to 16 bytes; the AMX prefill
// kernel's K/V tiles from such a buffer: a 2-core Xeon, SmolLM2's 3,000-token prompt,
// attention 64.9 -> 58.9 us a token).
template <typename T>
struct Aligned64 {
    using value_type = T;
    Aligned64() = default;
    template <typename U>
    Aligned64(const Aligned64<U>&) {}
    T* allocate(std::size_t n) {
        void* p = std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64);
        if (!p) throw std::bad_alloc();
        return static_cast<T*>(p);
    }
    void deallocate(T* p, std::size_t) { std::free(p); }
    bool operator==(const Aligned64&) const { return true; }
    bool operator!=(const Aligned64&) const { return false; }
};
using VecF = std::vector<float, Aligned64<float>>;
using Vec16 = std::vector<uint16_t, Aligned64<uint16_t>>;

}  // namespace

// The model's decoder stack, its weights referenced (not copied) from the torch model. An
// empty final norm or layer input norm is none: the hidden states go on as they are (an
// EAGLE-1 head's one layer, whose input is its fc output and whose output is not normed).
class FusedDecoder {
  public:
    FusedDecoder(int64_t hidden, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                 int64_t intermediate, double eps, torch::Tensor cos, torch::Tensor signed_sin,
                 torch::Tensor final_norm)
        : H_(hidden), Hq_(num_heads), Hkv_(num_kv_heads), D_(head_dim), I_(intermediate),
          eps_(static_cast<float>(eps)), cos_(cos.to(torch::kFloat32).contiguous()),
          sin_(signed_sin.to(torch::kFloat32).contiguous()), final_norm_(to_floats(final_norm)) {
        TORCH_CHECK((D_ == 16 || D_ == 32 || D_ == 64 || D_ == 128) && Hq_ % Hkv_ == 0,
                    "head_dim 16, 32, 64 or 128 and heads % kv heads");
        TORCH_CHECK(cos_.dim() == 2 && cos_.size(1) == D_, "rotary tables must be [pos, D]");
    }

    using Segs = std::vector<std::tuple<int64_t, torch::Tensor, torch::Tensor>>;

    void add_layer(torch::Tensor input_norm, torch::Tensor post_norm, torch::Tensor q_norm,
                   torch::Tensor k_norm, Segs qkv, torch::Tensor qkv_bias, Segs o,
                   torch::Tensor o_bias, Segs gate_up, torch::Tensor gate_up_bias, Segs down,
                   torch::Tensor down_bias) {
        Layer l;
        l.input_norm = to_floats(input_norm);
        l.post_norm = to_floats(post_norm);
        l.q_norm = to_floats(q_norm);
        l.k_norm = to_floats(k_norm);
        l.qkv = make_linear(qkv, qkv_bias, H_);
        l.o = make_linear(o, o_bias, Hq_ * D_);
        l.gate_up = make_linear(gate_up, gate_up_bias, H_);
        l.down = make_linear(down, down_bias, I_);
        TORCH_CHECK(l.qkv.N == (Hq_ + 2 * Hkv_) * D_ && l.o.N == H_ &&
                        l.gate_up.N == 2 * I_ && l.down.N == H_,
                    "layer weights do not match the decoder's shape");
        layers_.push_back(std::move(l));
    }

    int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

    // Reorders every layer's bf16 weights for the GEMMs that take them (steps of at most
    // PACKED_MAX_ROWS rows or of SPLIT_GEMM_ROWS and more) now (packed_weight), so the
    // first such step does not pay for it (and measure it into the worker's prefill rate).
    // Returns the weights reordered (0 without oneDNN).
    int64_t pack_weights() {
        int64_t n = 0;
        for (const Layer& ly : layers_)
            for (const Linear* L : {&ly.qkv, &ly.o, &ly.gate_up, &ly.down})
                if (!L->quantized_input)
                    for (const Segment& g : L->segs) n += packed_weight(g).defined();
        return n;
    }

    // Runs the torch GEMM of each layer weight shape once at `rows` rows (a padded step
    // size: a multiple of 32 above MAX_GEMV_ROWS), on zeros, so oneDNN compiles their kernels
    // ahead of the first step of that size (~5-10 ms a shape on a 2-core Xeon, four shapes
    // a step). Weights off the torch path (quantized) are skipped. Returns the GEMMs run.
    int64_t warm_gemms(int64_t rows) {
        TORCH_CHECK(rows > MAX_GEMV_ROWS && gemm_rows(rows) == rows, "not a padded step size");
        if (layers_.empty()) return 0;
        const Layer& ly = layers_[0];
        int64_t n = 0;
        for (const Linear* L : {&ly.qkv, &ly.o, &ly.gate_up, &ly.down}) {
            bool bf16 = !L->quantized_input && !L->segs.empty();
            for (const Segment& g : L->segs) bf16 = bf16 && g.kind == BF16;
            if (!bf16) continue;
            linear_torch_bf16(*L, torch::zeros({rows, L->K}, torch::kBFloat16));
            ++n;
        }
        return n;
    }

    // Per-part timing of forward() for profiling (bench/profile_step.py); off by default
    // (one branch per part when off). part_ms(): ms spent since the last call in {GEMMs,
    // KV store + attention, norms/rotary/activation/residual adds, the whole forward},
    // then reset.
    void set_timing(bool on) {
        std::lock_guard<std::mutex> hold(mutex_);
        timing_ = on;
        part_ns_.fill(0.0);
    }
    std::vector<double> part_ms() {
        std::lock_guard<std::mutex> hold(mutex_);
        std::vector<double> ms;
        for (double ns : part_ns_) ms.push_back(ns / 1e6);
        part_ns_.fill(0.0);
        return ms;
    }

    // embeds bf16 [M, H]; positions, slots, rows int64 [M]; tables int64 [R, max_blocks];
    // kv_cache bf16 [L, 2, num_blocks, block_size, Hkv, D]. Returns {hidden bf16 [M, H],
    // aux bf16 [M, len(aux_ids) * H] (empty without aux_ids)}. layer_done (may be empty) is
    // called with each layer's index once its K/V are in the cache (a Python callable: it
    // takes the GIL for the call).
    std::vector<torch::Tensor> forward(torch::Tensor embeds, torch::Tensor positions,
                                       torch::Tensor slots, torch::Tensor tables,
                                       torch::Tensor rows, torch::Tensor kv_cache,
                                       std::vector<int64_t> aux_ids,
                                       std::function<void(int64_t)> layer_done) {
        const int64_t M = embeds.size(0);
        TORCH_CHECK(M >= 1 && embeds.size(1) == H_, "embeds must be [tokens, H]");
        auto pos = positions.contiguous(), slt = slots.contiguous();
        auto tab = tables.contiguous(), rws = rows.contiguous();
        const Step st = step_of(M, pos, slt, tab, rws, kv_cache);

        std::lock_guard<std::mutex> hold(mutex_);  // the scratch buffers are the decoder's
        Timed whole(part(TOTAL));
        VecF& h = sized(buf_.h, M * H_);
        if (embeds.scalar_type() == torch::kBFloat16 && embeds.is_contiguous()) {
            // straight into h: a fresh fp32 copy was ~850 page faults a 1,500-token step
            rows_from_bf16(embeds, M, H_, h.data(), H_, 0);
        } else {
            auto emb = embeds.to(torch::kFloat32).contiguous();
            std::memcpy(h.data(), emb.data_ptr<float>(), M * H_ * sizeof(float));
        }
        VecF& res = sized(buf_.res, M * H_);
        VecF& x = sized(buf_.x, M * H_);
        const int64_t naux = static_cast<int64_t>(aux_ids.size());
        auto aux = torch::empty({naux ? M : 0, naux * H_}, torch::kBFloat16);
        torch::Tensor h16;  // the last layer's MLP output as bf16 [>= M, H] (else in h)
        for (int64_t l = 0; l < num_layers(); ++l) {
            const bool aux_here = std::find(aux_ids.begin(), aux_ids.end(), l) != aux_ids.end();
            if (h16.defined() && (aux_here || layers_[l].input_norm.empty()))
                h16 = take_rows(h16, M, h);
            for (int64_t j = 0; j < naux; ++j)
                if (aux_ids[j] == l) write_aux(aux, j, naux, l, M, h, res);
            torch::Tensor x16;  // the layer's normed input as bf16, where h16 had its output
            if (l == 0) {
                res = h;
            } else if (h16.defined()) {
                x16 = gemm_input(M, H_);
                timed(NORM_ACT, [&] {
                    add_rmsnorm_bf16(bf16_data(h16), res.data(), layers_[l].input_norm, M, H_,
                                     eps_, const_cast<uint16_t*>(bf16_data(x16)));
                });
            } else {
                add_round_rows(h.data(), res.data(), res.data(), M, H_);
            }
            if (!x16.defined()) {
                Timed t(part(NORM_ACT));
                if (layers_[l].input_norm.empty()) x = res;  // none (an EAGLE-1 head's layer)
                else rmsnorm(res.data(), layers_[l].input_norm, M, H_, eps_, x.data());
            }
            h16 = layer(layers_[l], l, st, M, x, x16, h, res);
            if (layer_done) layer_done(l);  // layer l's K/V are in the cache
        }
        auto out = torch::empty({M, H_}, torch::kBFloat16);
        auto* O = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
        if (h16.defined() && !final_norm_.empty()) {
            add_rmsnorm_bf16(bf16_data(h16), res.data(), final_norm_, M, H_, eps_, O);
            return {out, aux};
        }
        if (h16.defined()) take_rows(h16, M, h);
        add_round_rows(h.data(), res.data(), res.data(), M, H_);
        if (final_norm_.empty()) x = res;  // none (an EAGLE-1 head)
        else rmsnorm(res.data(), final_norm_, M, H_, eps_, x.data());
        for (int64_t i = 0; i < M * H_; ++i) O[i] = bf16_bits(x[i]);
        return {out, aux};
    }

  private:
    enum Part { GEMM, ATTENTION, NORM_ACT, TOTAL, NUM_PARTS };
    // Adds the lifetime of the scope to *slot (nothing where slot is null).
    struct Timed {
        double* slot;
        std::chrono::steady_clock::time_point t0;
        explicit Timed(double* s) : slot(s) {
            if (slot) t0 = std::chrono::steady_clock::now();
        }
        ~Timed() {
            if (slot)
                *slot += std::chrono::duration<double, std::nano>(
                             std::chrono::steady_clock::now() - t0).count();
        }
    };
    double* part(Part p) { return timing_ ? &part_ns_[p] : nullptr; }
    template <typename Fn>
    void timed(Part p, const Fn& fn) {
        Timed t(part(p));
        fn();
    }

    struct Step {
        const int64_t *pos, *slots, *tables, *rows;
        int64_t max_blocks, num_blocks, block_size;
        uint16_t* kv;
    };

    // x: the normed input [M, H] (x16: the same as bf16 [>= M, H] instead, where defined);
    // res: the residual stream after the attention half (updated in place). Returns the
    // layer's MLP output as bf16 [>= M, H] where its last GEMM was torch's (steps of more
    // than 32 rows), else an undefined tensor and the output in h [M, H].
    torch::Tensor layer(const Layer& ly, int64_t l, const Step& st, int64_t M,
                        const VecF& x, const torch::Tensor& x16, VecF& h, VecF& res) {
        const int64_t qkv_n = ly.qkv.N, q_size = Hq_ * D_;
        VecF& qkv = queries_keys_values(ly, st, M, x, x16);
        VecF& attn = sized(buf_.attn, M * q_size);
        // a step of more than 32 rows takes torch's GEMM for the output projection: the
        // attention's rows go to it in bf16, as the AMX prefill kernel writes them
        const bool torch_gemm = M > MAX_GEMV_ROWS;
        torch::Tensor attn16 = torch_gemm ? gemm_input(M, q_size) : torch::Tensor();
        timed(ATTENTION, [&] {
            store_kv(qkv.data(), M, qkv_n, l, st);
            attention(qkv.data(), M, qkv_n, l, st, attn.data(),
                      torch_gemm ? const_cast<uint16_t*>(bf16_data(attn16)) : nullptr);
        });
        const auto& gus = ly.gate_up.segs;
        const bool mlp16 = torch_gemm && ly.down.segs.size() == 1 &&
                           ((gus.size() == 1 && gus[0].rows == 2 * I_) ||
                            (gus.size() == 2 && gus[0].rows == I_ && gus[1].rows == I_));
        if (mlp16 && ly.o.segs.size() == 1) {  // the o GEMM's rows straight into add + norm
            torch::Tensor o16, xn16 = gemm_input(M, H_);
            timed(GEMM, [&] { o16 = linear_torch_bf16(ly.o, attn16)[0]; });
            timed(NORM_ACT, [&] {
                add_rmsnorm_bf16(bf16_data(o16), res.data(), ly.post_norm, M, H_, eps_,
                                 const_cast<uint16_t*>(bf16_data(xn16)));
            });
            return mlp_bf16(ly, xn16, M);
        }
        VecF& o = sized(buf_.o, M * H_);
        timed(GEMM, [&] {
            if (torch_gemm) linear_torch_from_bf16(ly.o, attn16, M, o.data());
            else linear(ly.o, attn.data(), M, o.data());
        });
        VecF& xn = sized(buf_.xn, M * H_);
        timed(NORM_ACT, [&] {
            add_round_rows(o.data(), res.data(), res.data(), M, H_);
            rmsnorm(res.data(), ly.post_norm, M, H_, eps_, xn.data());
        });
        if (mlp16) {
            torch::Tensor xn16;
            timed(GEMM, [&] { xn16 = bf16_rows(xn.data(), M, H_); });
            return mlp_bf16(ly, xn16, M);
        }
        VecF& gu = sized(buf_.gu, M * 2 * I_);
        VecF& act = sized(buf_.act, M * I_);
        timed(GEMM, [&] { linear(ly.gate_up, xn.data(), M, gu.data()); });
        timed(NORM_ACT, [&] { silu_mul(gu.data(), M, act.data()); });
        timed(GEMM, [&] { linear(ly.down, act.data(), M, h.data()); });
        return torch::Tensor();
    }

    // The step's views after checking them (forward's arguments; the tensors must outlive it).
    Step step_of(int64_t M, const torch::Tensor& pos, const torch::Tensor& slt,
                 const torch::Tensor& tab, const torch::Tensor& rws,
                 const torch::Tensor& kv_cache) const {
        TORCH_CHECK(kv_cache.scalar_type() == torch::kBFloat16 && kv_cache.is_contiguous() &&
                        kv_cache.dim() == 6 && kv_cache.size(0) == num_layers() &&
                        kv_cache.size(4) == Hkv_ && kv_cache.size(5) == D_,
                    "kv_cache must be contiguous bf16 [L, 2, blocks, block_size, Hkv, D]");
        TORCH_CHECK(pos.scalar_type() == torch::kInt64 && slt.scalar_type() == torch::kInt64 &&
                        tab.scalar_type() == torch::kInt64 && rws.scalar_type() == torch::kInt64,
                    "positions, slots, tables and rows must be int64");
        const int64_t* P = pos.data_ptr<int64_t>();
        for (int64_t t = 0; t < M; ++t) {
            TORCH_CHECK(P[t] >= 0 && P[t] < cos_.size(0), "position out of the rotary table");
        }
        return Step{P, slt.data_ptr<int64_t>(), tab.data_ptr<int64_t>(), rws.data_ptr<int64_t>(),
                    tab.size(1), kv_cache.size(2), kv_cache.size(3),
                    reinterpret_cast<uint16_t*>(kv_cache.data_ptr<at::BFloat16>())};
    }

    // aux [M, naux * H] columns j * H .. (j + 1) * H = layer l's input hidden states
    // (bf16(h + res) after the first layer: what an EAGLE-3 drafter takes).
    void write_aux(torch::Tensor& aux, int64_t j, int64_t naux, int64_t l, int64_t M,
                   const VecF& h, const VecF& res) const {
        auto* A = reinterpret_cast<uint16_t*>(aux.data_ptr<at::BFloat16>());
        for (int64_t t = 0; t < M; ++t)
            for (int64_t i = 0; i < H_; ++i) {
                float v = l == 0 ? h[t * H_ + i] : bf16_round(h[t * H_ + i] + res[t * H_ + i]);
                A[t * naux * H_ + j * H_ + i] = bf16_bits(v);
            }
    }

    // qkv [M, qkv.N] fp32 (bf16 values) = the layer's query/key/value projection of x (or
    // x16, as in layer()), the queries and keys normed per head (Qwen3) and rotated.
    VecF& queries_keys_values(const Layer& ly, const Step& st, int64_t M, const VecF& x,
                              const torch::Tensor& x16) {
        const int64_t qkv_n = ly.qkv.N, q_size = Hq_ * D_;
        VecF& qkv = sized(buf_.qkv, M * qkv_n);
        timed(GEMM, [&] {
            if (x16.defined()) linear_torch_from_bf16(ly.qkv, x16, M, qkv.data());
            else linear(ly.qkv, x.data(), M, qkv.data());
        });
        timed(NORM_ACT, [&] {
            if (!ly.q_norm.empty()) {  // Qwen3: RMSNorm over each query and key head
                for (int64_t t = 0; t < M; ++t) {
                    float* r = qkv.data() + t * qkv_n;
                    rmsnorm(r, ly.q_norm, Hq_, D_, eps_, r);
                    rmsnorm(r + q_size, ly.k_norm, Hkv_, D_, eps_, r + q_size);
                }
            }
            rotate(qkv.data(), M, qkv_n, st.pos);
        });
        return qkv;
    }

    // h [M, H] fp32 = the rows of y (bf16 [>= M, H]); returns an undefined tensor (what the
    // caller's bf16 output becomes once taken).
    torch::Tensor take_rows(const torch::Tensor& y, int64_t M, VecF& h) const {
        rows_from_bf16(y, M, H_, h.data(), H_, 0);
        return torch::Tensor();
    }

    // The MLP of a step of more than 32 rows (bf16 weights: torch's GEMMs) with its
    // intermediates in bf16, as torch returns them: a 4,096-row step's gate/up output
    // (48 MB as fp32) was written, converted and read back in fp32 for each layer.
    // Returns down(bf16(bf16(silu(gate)) * up)) for xn16 (bf16 [>= M, H]): bf16 [>= M, H],
    // the values of the fp32 path.
    torch::Tensor mlp_bf16(const Layer& ly, const torch::Tensor& xn16, int64_t M) {
        auto act = gemm_input(M, I_);
        timed(GEMM, [&] { gu_ = linear_torch_bf16(ly.gate_up, xn16); });
        timed(NORM_ACT, [&] {
            // gate columns [0, I) and up [I, 2I): one segment of 2I rows or two of I
            const bool one = gu_.size() == 1;
            const uint16_t* gate = bf16_data(gu_[0]);
            const uint16_t* up = one ? gate + I_ : bf16_data(gu_[1]);
            const int64_t ld = one ? 2 * I_ : I_;
            uint16_t* a = const_cast<uint16_t*>(bf16_data(act));
            at::parallel_for(0, M, 16, [&](int64_t t0, int64_t t1) {
                for (int64_t t = t0; t < t1; ++t)
                    silu_mul_row(gate + t * ld, up + t * ld, a + t * I_);
            });
            gu_.clear();
        });
        torch::Tensor y;
        timed(GEMM, [&] { y = linear_torch_bf16(ly.down, act)[0]; });
        return y;
    }

    // a [I] = bf16(bf16(silu(gate)) * up) over one row of bf16 values, silu_mul's arithmetic.
    void silu_mul_row(const uint16_t* g, const uint16_t* u, uint16_t* a) const {
        int64_t i = 0;
#if defined(__AVX512BF16__)
        for (; i + 16 <= I_; i += 16) {
            const __m512 x = load_bf16x16(g + i);
            const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
            const __m512 s = bf16_round16(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(a + i),  // exact: a bf16 value
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(s, load_bf16x16(u + i))));
        }
#endif
        for (; i + 8 <= I_; i += 8) {
            const __m256 x = load_bf16x8(g + i);
            const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
            const __m256 s = bf16_round8(_mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), e)));
            const __m256i r = _mm256_srli_epi32(
                _mm256_castps_si256(bf16_round8(_mm256_mul_ps(s, load_bf16x8(u + i)))), 16);
            _mm_storeu_si128(reinterpret_cast<__m128i*>(a + i),
                             _mm_packus_epi32(_mm256_castsi256_si128(r),
                                              _mm256_extracti128_si256(r, 1)));
        }
        for (; i < I_; ++i) {
            const float x = bf16_value(g[i]);
            const float sv = bf16_round(x / (1.f + std::exp(-x)));
            a[i] = bf16_bits(bf16_round(sv * bf16_value(u[i])));
        }
    }

    // act [M, I] = bf16(bf16(silu(gate)) * up) from gu [M, 2I] (gate | up per row).
    void silu_mul(const float* gu, int64_t M, float* act) const {
        parallel_rows(M, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
            const float* g = gu + t * 2 * I_;
            float* a = act + t * I_;
            int64_t i = 0;
            for (; i + 8 <= I_; i += 8) {
                const __m256 x = _mm256_loadu_ps(g + i);
                const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
                const __m256 s = bf16_round8(
                    _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), e)));
                _mm256_storeu_ps(a + i, bf16_round8(_mm256_mul_ps(s, _mm256_loadu_ps(g + I_ + i))));
            }
            for (; i < I_; ++i) {
                const float s = bf16_round(g[i] / (1.f + std::exp(-g[i])));
                a[i] = bf16_round(s * g[I_ + i]);
            }
        }
        });
    }

    // x * cos + roll(x, D/2) * signed_sin per head of the queries and keys, in bf16 steps.
    void rotate(float* qkv, int64_t M, int64_t ld, const int64_t* pos) const {
        const float* C = cos_.data_ptr<float>();
        const float* S = sin_.data_ptr<float>();
        const int64_t half = D_ / 2;
        parallel_rows(M, [&](int64_t t0, int64_t t1) {
        std::vector<float> tmp(D_);
        for (int64_t t = t0; t < t1; ++t) {
            const float* c = C + pos[t] * D_;
            const float* s = S + pos[t] * D_;
            for (int64_t hd = 0; hd < Hq_ + Hkv_; ++hd) {
                float* v = qkv + t * ld + hd * D_;
#if defined(__AVX512BF16__)
                if (half % 16 == 0) {  // halves of whole 16-lane registers
                    for (int64_t i = 0; i < D_; i += 16) {
                        const int64_t j = i < half ? i + half : i - half;
                        const __m512 a = bf16_round16(_mm512_mul_ps(
                            _mm512_loadu_ps(v + i), bf16_round16(_mm512_loadu_ps(c + i))));
                        const __m512 b = bf16_round16(_mm512_mul_ps(
                            _mm512_loadu_ps(v + j), bf16_round16(_mm512_loadu_ps(s + i))));
                        _mm512_storeu_ps(tmp.data() + i, bf16_round16(_mm512_add_ps(a, b)));
                    }
                    std::memcpy(v, tmp.data(), D_ * sizeof(float));
                    continue;
                }
#endif
                for (int64_t i = 0; i < D_; i += 8) {  // D % 16 == 0: halves of whole lanes
                    const int64_t j = i < half ? i + half : i - half;  // roll by D / 2
                    const __m256 a = bf16_round8(_mm256_mul_ps(
                        _mm256_loadu_ps(v + i), bf16_round8(_mm256_loadu_ps(c + i))));
                    const __m256 b = bf16_round8(_mm256_mul_ps(
                        _mm256_loadu_ps(v + j), bf16_round8(_mm256_loadu_ps(s + i))));
                    _mm256_storeu_ps(tmp.data() + i, bf16_round8(_mm256_add_ps(a, b)));
                }
                std::memcpy(v, tmp.data(), D_ * sizeof(float));
            }
        }
        });
    }

    uint16_t* cache(const Step& st, int64_t l, int64_t kv) const {
        return st.kv + ((l * 2 + kv) * st.num_blocks * st.block_size) * Hkv_ * D_;
    }

    void store_kv(const float* qkv, int64_t M, int64_t ld, int64_t l, const Step& st) const {
        uint16_t *K = cache(st, l, 0), *V = cache(st, l, 1);
        const int64_t kv_size = Hkv_ * D_, q_size = Hq_ * D_;
        for (int64_t t = 0; t < M; ++t)
            TORCH_CHECK(st.slots[t] >= 0 && st.slots[t] < st.num_blocks * st.block_size,
                        "slot out of range");
        parallel_rows(M, [&](int64_t t0, int64_t t1) {  // bf16 values held in fp32: exact
            for (int64_t t = t0; t < t1; ++t) {
                const float* k = qkv + t * ld + q_size;
                to_bf16(k, K + st.slots[t] * kv_size, kv_size);
                to_bf16(k + kv_size, V + st.slots[t] * kv_size, kv_size);
            }
        });
    }

    // out [M, Hq * D]: softmax(q k^T * scale) v over each token's context (positions 0 ..
    // pos of its request, read through its block table), fp32, rounded to bf16. Where the
    // build has AVX512-BF16, a request's run of FLASH_MIN_QUERIES or more consecutive query
    // tokens (a prefill chunk) takes the blocked prefill kernel (cpu_prefill_attention.cpp)
    // over its gathered context; the rest (decodes, verification rows) go token by token.
    // With out16 (bf16 [M, Hq * D]) the rows go there instead (out: scratch).
    void attention(const float* qkv, int64_t M, int64_t ld, int64_t l, const Step& st,
                   float* out, uint16_t* out16) {
#if defined(__AVX512BF16__)
        if (M >= FLASH_MIN_QUERIES && D_ >= 32) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
            const bool amx = D_ == 64 && amx_chunk_attention();
#else
            const bool amx = false;
#endif
            std::vector<std::pair<int64_t, int64_t>> runs;  // the AMX kernel's, all at once
            int64_t pending = 0;  // tokens [pending, t0) go token by token
            for (int64_t t0 = 0; t0 < M;) {
                int64_t t1 = t0 + 1;
                while (t1 < M && st.rows[t1] == st.rows[t0] && st.pos[t1] == st.pos[t1 - 1] + 1)
                    ++t1;
                if (t1 - t0 >= FLASH_MIN_QUERIES) {
                    if (pending < t0) token_attention(qkv, pending, t0, ld, l, st, out);
                    if (amx) runs.emplace_back(t0, t1);
                    else chunk_attention(qkv, t0, t1, ld, l, st, out);
                    pending = t1;
                }
                t0 = t1;
            }
            if (pending < M) token_attention(qkv, pending, M, ld, l, st, out);
            std::vector<char> amx_row(M, 0);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
            if (!runs.empty()) {  // bf16 rows: into out16, or through scratch into out
                uint16_t* o16 = out16 ? out16 : sized(buf_.attn16, M * Hq_ * D_).data();
                amx_attention(qkv, runs, ld, l, st, o16);
                for (const auto& [t0, t1] : runs) {
                    std::fill(amx_row.begin() + t0, amx_row.begin() + t1, 1);
                    if (!out16)
                        from_bf16(o16 + t0 * Hq_ * D_, out + t0 * Hq_ * D_, (t1 - t0) * Hq_ * D_);
                }
            }
#endif
            if (out16) rows_to_bf16(out, M, amx_row, out16);
            return;
        }
#endif
        token_attention(qkv, 0, M, ld, l, st, out);
        if (out16) rows_to_bf16(out, M, std::vector<char>(M, 0), out16);
    }

    // out16 rows t (bf16 [M, Hq * D]) = out's (fp32, bf16 values: exact) where !skip[t].
    void rows_to_bf16(const float* out, int64_t M, const std::vector<char>& skip,
                      uint16_t* out16) const {
        const int64_t q_size = Hq_ * D_;
        at::parallel_for(0, M, 64, [&](int64_t t0, int64_t t1) {
            for (int64_t t = t0; t < t1; ++t)
                if (!skip[t]) to_bf16(out + t * q_size, out16 + t * q_size, q_size);
        });
    }

    // attention() of tokens t0 .. t1 one (token, KV head) at a time.
    void token_attention(const float* qkv, int64_t t0, int64_t t1, int64_t ld, int64_t l,
                         const Step& st, float* out) const {
        Step sub = st;
        sub.pos += t0;
        sub.rows += t0;
        const float* q = qkv + t0 * ld;
        float* o = out + t0 * Hq_ * D_;
        switch (D_ / 16) {
            case 1: return attention_nz<1>(q, t1 - t0, ld, l, sub, o);
            case 2: return attention_nz<2>(q, t1 - t0, ld, l, sub, o);
            case 4: return attention_nz<4>(q, t1 - t0, ld, l, sub, o);
            case 8: return attention_nz<8>(q, t1 - t0, ld, l, sub, o);
            default: TORCH_CHECK(false, "fused attention takes head_dim 16, 32, 64 or 128");
        }
    }

#if defined(__AVX512BF16__)
    // attention() of the consecutive queries t0 .. t1 of one request (positions pos[t0] ..
    // pos[t1 - 1]): its keys 0 .. pos[t1 - 1] gathered from the paged cache, then the
    // causal prefill kernel (probabilities rounded to bf16 before they weigh the values,
    // as in the eager bf16 prefill on this CPU).
    void chunk_attention(const float* qkv, int64_t t0, int64_t t1, int64_t ld, int64_t l,
                         const Step& st, float* out) {
        const int64_t n = t1 - t0, lk = st.pos[t1 - 1] + 1, q_size = Hq_ * D_;
        const int64_t kv_size = Hkv_ * D_;
        const int64_t* bt = st.tables + st.rows[t0] * st.max_blocks;
        TORCH_CHECK((lk + st.block_size - 1) / st.block_size <= st.max_blocks,
                    "context longer than the block table");
        Vec16& q = sized(buf_.q16, n * q_size);
        Vec16& k = sized(buf_.k16, lk * kv_size);
        Vec16& v = sized(buf_.v16, lk * kv_size);
        Vec16& o = sized(buf_.o16, n * q_size);
        const uint16_t *K = cache(st, l, 0), *V = cache(st, l, 1);
        for (int64_t j = 0; j < lk; j += st.block_size) {  // whole blocks, then the tail
            const int64_t len = std::min(st.block_size, lk - j);
            const int64_t src = bt[j / st.block_size] * st.block_size * kv_size;
            std::memcpy(&k[j * kv_size], K + src, len * kv_size * sizeof(uint16_t));
            std::memcpy(&v[j * kv_size], V + src, len * kv_size * sizeof(uint16_t));
        }
        for (int64_t t = 0; t < n; ++t)  // bf16 values held in fp32: exact
            to_bf16(qkv + (t0 + t) * ld, &q[t * q_size], q_size);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
        if (torch_chunk_attention()) return sdpa_chunk(q.data(), k.data(), v.data(), n, lk,
                                                       out + t0 * q_size);
#endif
        namespace pa = pdserve_prefill_attention;
        const pa::Shapes s{n, lk - n, lk, Hq_, Hkv_, Hq_ / Hkv_, D_, (lk + pa::KB - 1) / pa::KB,
                           q_size, kv_size, kv_size, q_size,
                           1.f / std::sqrt(static_cast<float>(D_))};
        pa::causal(q.data(), k.data(), v.data(), o.data(), s);
        from_bf16(o.data(), out + t0 * q_size, n * q_size);
    }
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    // Where the CPU has AMX, prefill chunks of head_dim 64 take the AMX kernel
    // (cpu_amx_attention.cpp: a 2-core Xeon, SmolLM2's heads, one layer: 1,500 tokens 3.8 ms
    // against torch's flash attention's 6.2 and this build's own 14.1), other head sizes
    // torch's (AMX tiles too); PDSERVE_PREFILL_ATTENTION=torch or =cpu asks for either.
    static const char* prefill_attention_choice() {
        const char* env = std::getenv("PDSERVE_PREFILL_ATTENTION");
        return env ? env : "";
    }
    static bool amx_chunk_attention() {
        const char* c = prefill_attention_choice();
        return std::strcmp(c, "cpu") != 0 && std::strcmp(c, "torch") != 0 && amx_usable();
    }
    static bool torch_chunk_attention() {
        return std::strcmp(prefill_attention_choice(), "cpu") != 0 && amx_usable();
    }

    // attention() of the runs [t0, t1) of consecutive queries (each one request's prefill
    // chunk) in one call of the AMX kernel: their K/V gathered from the paged cache in its
    // layout, queries rounded to bf16 (exact: bf16 values held in fp32). out: bf16 rows
    // [M, Hq * D] (the runs' rows written).
    void amx_attention(const float* qkv, const std::vector<std::pair<int64_t, int64_t>>& runs,
                       int64_t ld, int64_t l, const Step& st, uint16_t* out) {
        const int64_t q_size = Hq_ * D_, kv_size = Hkv_ * D_;
        const int64_t R = static_cast<int64_t>(runs.size());
        std::vector<int64_t> kofs(R + 1, 0);  // each run's first padded key
        std::vector<std::pair<int64_t, int64_t>> blocks;  // (run, key block of 32)
        for (int64_t r = 0; r < R; ++r) {
            const int64_t lk = st.pos[runs[r].second - 1] + 1, lkp = (lk + 31) / 32 * 32;
            TORCH_CHECK((lk + st.block_size - 1) / st.block_size <= st.max_blocks,
                        "context longer than the block table");
            kofs[r + 1] = kofs[r] + lkp;
            for (int64_t b = 0; b < lkp / 32; ++b) blocks.emplace_back(r, b);
        }
        Vec16& q = sized(buf_.q16, M_of(runs) * q_size);
        Vec16& k = sized(buf_.k16, kofs[R] * kv_size);
        Vec16& vt = sized(buf_.v16, kofs[R] * kv_size);
        std::vector<const uint16_t*> krows(kofs[R]), vrows(kofs[R]);
        const uint16_t *K = cache(st, l, 0), *V = cache(st, l, 1);
        std::vector<FlashChunk> chunks;
        int64_t qofs = 0;
        for (int64_t r = 0; r < R; ++r) {
            const auto [t0, t1] = runs[r];
            const int64_t lk = st.pos[t1 - 1] + 1;
            const int64_t* bt = st.tables + st.rows[t0] * st.max_blocks;
            for (int64_t j = 0; j < lk; ++j) {
                const int64_t slot = bt[j / st.block_size] * st.block_size + j % st.block_size;
                krows[kofs[r] + j] = K + slot * kv_size;
                vrows[kofs[r] + j] = V + slot * kv_size;
            }
            chunks.push_back({q.data() + qofs * q_size, q_size, k.data() + kofs[r] * kv_size,
                              vt.data() + kofs[r] * kv_size, t1 - t0, lk, kofs[r + 1] - kofs[r],
                              out + t0 * q_size, q_size});
            qofs += t1 - t0;
        }
        at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t i0, int64_t i1) {
            for (int64_t i = i0; i < i1; ++i) {
                const auto [r, b] = blocks[i];
                const FlashChunk& c = chunks[r];
                pack_kv(&krows[kofs[r]], &vrows[kofs[r]], c.lk, c.lkp, kv_size, b, b + 1,
                        const_cast<uint16_t*>(c.k), const_cast<uint16_t*>(c.vt));
                for (int64_t t = b * 32; t < std::min(c.n, (b + 1) * 32); ++t)  // its queries
                    to_bf16(qkv + (runs[r].first + t) * ld,
                            const_cast<uint16_t*>(c.q) + t * q_size, q_size);
            }
        });
        flash_amx(chunks, Hq_, Hkv_, 1.f / std::sqrt(static_cast<float>(D_)));
    }
    static int64_t M_of(const std::vector<std::pair<int64_t, int64_t>>& runs) {
        int64_t m = 0;
        for (const auto& r : runs) m += r.second - r.first;
        return m;
    }

    // chunk_attention() through scaled_dot_product_attention: q [n, Hq, D], k/v [lk, Hkv, D]
    // bf16; query i attends keys 0 .. lk - n + i (a mask where a context precedes the
    // chunk, torch's causal flag aligning the first query with the first key). out [n, Hq *
    // D] fp32 (bf16 values).
    void sdpa_chunk(uint16_t* q, uint16_t* k, uint16_t* v, int64_t n, int64_t lk,
                    float* out) const {
        const auto bf16 = torch::TensorOptions().dtype(torch::kBFloat16);
        auto qt = torch::from_blob(q, {n, Hq_, D_}, bf16).transpose(0, 1).unsqueeze(0);
        auto kt = torch::from_blob(k, {lk, Hkv_, D_}, bf16).transpose(0, 1).unsqueeze(0);
        auto vt = torch::from_blob(v, {lk, Hkv_, D_}, bf16).transpose(0, 1).unsqueeze(0);
        const double scale = 1.0 / std::sqrt(static_cast<double>(D_));
        torch::Tensor o;
        if (lk == n) {
            o = at::scaled_dot_product_attention(qt, kt, vt, {}, 0.0, true, scale, true);
        } else {
            auto mask = at::arange(lk).unsqueeze(0) <= (at::arange(n) + (lk - n)).unsqueeze(1);
            o = at::scaled_dot_product_attention(qt, kt, vt, mask, 0.0, false, scale, true);
        }
        torch::from_blob(out, {n, Hq_, D_}, torch::kFloat32).copy_(o[0].transpose(0, 1));
    }
#endif

    // The same with D = 16 * NZ, NZ a compile-time count so a head's accumulators stay in
    // registers. Per (token, KV head): the scores of each query head of the group 8 keys at
    // a time (one sum of 8 lanes per key: dot8), a vectorized softmax, then the value rows
    // weighted into NZ 16-lane accumulators per query head.
    template <int NZ>
    void attention_nz(const float* qkv, int64_t M, int64_t ld, int64_t l, const Step& st,
                      float* out) const {
        const uint16_t *K = cache(st, l, 0), *V = cache(st, l, 1);
        const int64_t group = Hq_ / Hkv_, kv_size = Hkv_ * D_;
        const float scale = 1.f / std::sqrt(static_cast<float>(D_));
        at::parallel_for(0, M * Hkv_, 1, [&](int64_t begin, int64_t end) {
            std::vector<float> scores;
            std::vector<const uint16_t*> krow, vrow;
            for (int64_t task = begin; task < end; ++task) {
                const int64_t t = task / Hkv_, g = task % Hkv_;
                const int64_t ctx = st.pos[t] + 1;
                const int64_t* bt = st.tables + st.rows[t] * st.max_blocks;
                TORCH_CHECK((ctx + st.block_size - 1) / st.block_size <= st.max_blocks,
                            "context longer than the block table");
                krow.resize(ctx);
                vrow.resize(ctx);
                for (int64_t j = 0; j < ctx; ++j) {
                    const int64_t slot = bt[j / st.block_size] * st.block_size + j % st.block_size;
                    krow[j] = K + slot * kv_size + g * D_;
                    vrow[j] = V + slot * kv_size + g * D_;
                }
                // every line of the task's keys and values asked for at once, not as each
                // row is read (a 32-row decode step of SmolLM2 at ~160 tokens, 2-core Xeon:
                // attention 9.9-10.6 -> 8.2-8.9 ms; the next task's lines asked for during
                // this one instead: 9.4-10.5)
                for (int64_t j = 0; j < ctx; ++j)
                    for (int64_t b = 0; b < D_ * 2; b += 64) {
                        _mm_prefetch(reinterpret_cast<const char*>(krow[j]) + b, _MM_HINT_T1);
                        _mm_prefetch(reinterpret_cast<const char*>(vrow[j]) + b, _MM_HINT_T1);
                    }
                scores.resize(group * ctx);
                for (int64_t h = 0; h < group; ++h) {
                    const float* q = qkv + t * ld + (g * group + h) * D_;
                    head_scores<NZ>(q, krow.data(), ctx, scale, scores.data() + h * ctx);
                    softmax(scores.data() + h * ctx, ctx);
                }
                float* o = out + t * Hq_ * D_ + g * group * D_;
                int64_t h = 0;
#if defined(__AVX512BF16__)
                constexpr int G = NZ <= 4 ? 3 : 1;  // heads per pass over the value rows
                for (; h + G <= group; h += G)
                    weigh_values<NZ, G>(scores.data() + h * ctx, vrow.data(), ctx, o + h * D_);
#endif
                for (; h < group; ++h)
                    weigh_values<NZ>(scores.data() + h * ctx, vrow.data(), ctx, o + h * D_);
            }
        });
    }

#if defined(__AVX512BF16__)
    // sc[j] = scale * q . k_j, bf16 dot products (q holds bf16 values: exact) summed in
    // 8 fp32 lanes, then across them.
    template <int NZ>
    static void head_scores(const float* q, const uint16_t* const* krow, int64_t ctx,
                            float scale, float* sc) {
        __m256bh qb[NZ];  // 16 bf16 each
        for (int c = 0; c < NZ; ++c) {
            alignas(32) uint16_t tmp[16];
            for (int i = 0; i < 16; ++i) tmp[i] = bf16_bits(bf16_round(q[16 * c + i]));
            qb[c] = (__m256bh)_mm256_load_si256(reinterpret_cast<const __m256i*>(tmp));
        }
        int64_t j = 0;
        for (; j + 8 <= ctx; j += 8) {
            __m256 acc[8];
            for (int i = 0; i < 8; ++i) {
                acc[i] = _mm256_setzero_ps();
                for (int c = 0; c < NZ; ++c)
                    acc[i] = _mm256_dpbf16_ps(acc[i], qb[c], (__m256bh)_mm256_loadu_si256(
                        reinterpret_cast<const __m256i*>(krow[j + i] + 16 * c)));
            }
            _mm256_storeu_ps(sc + j, _mm256_mul_ps(sum8x8(acc), _mm256_set1_ps(scale)));
        }
        for (; j < ctx; ++j) {
            __m256 acc = _mm256_setzero_ps();
            for (int c = 0; c < NZ; ++c)
                acc = _mm256_dpbf16_ps(acc, qb[c], (__m256bh)_mm256_loadu_si256(
                    reinterpret_cast<const __m256i*>(krow[j] + 16 * c)));
            sc[j] = hsum(acc) * scale;
        }
    }

    // o = bf16(sum_j p_j v_j) for G query heads of one KV head: p [G, ctx], o [G, 16 NZ]
    // (consecutive heads); fp32 products, 16 lanes per register, each value row loaded
    // once for the G heads (a 32-row SmolLM2 decode step, G = 3 against 1: its attention
    // 8.40-8.67 -> 7.67-8.08 ms, 2-core Xeon), each head's sums in the same order.
    template <int NZ, int G = 1>
    static void weigh_values(const float* p, const uint16_t* const* vrow, int64_t ctx,
                             float* o) {
        __m512 acc[G][NZ];
        for (int h = 0; h < G; ++h)
            for (int c = 0; c < NZ; ++c) acc[h][c] = _mm512_setzero_ps();
        for (int64_t j = 0; j < ctx; ++j) {
            __m512 pj[G];
            for (int h = 0; h < G; ++h) pj[h] = _mm512_set1_ps(p[h * ctx + j]);
            for (int c = 0; c < NZ; ++c) {
                const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vrow[j] + 16 * c))), 16));
                for (int h = 0; h < G; ++h) acc[h][c] = _mm512_fmadd_ps(pj[h], v, acc[h][c]);
            }
        }
        for (int h = 0; h < G; ++h)
            for (int c = 0; c < NZ; ++c) {
                float* oc = o + h * 16 * NZ + 16 * c;
                _mm256_storeu_ps(oc, bf16_round8(_mm512_castps512_ps256(acc[h][c])));
                const __m256 upper =
                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[h][c]), 1));
                _mm256_storeu_ps(oc + 8, bf16_round8(upper));
            }
    }
#else
    // sc[j] = scale * q . k_j: fp32 FMAs over 8 lanes, 8 keys at a time, then across lanes.
    template <int NZ>
    static void head_scores(const float* q, const uint16_t* const* krow, int64_t ctx,
                            float scale, float* sc) {
        int64_t j = 0;
        for (; j + 8 <= ctx; j += 8) {
            __m256 acc[8];
            for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
            for (int c = 0; c < 2 * NZ; ++c) {
                const __m256 qc = _mm256_loadu_ps(q + 8 * c);
                for (int i = 0; i < 8; ++i)
                    acc[i] = _mm256_fmadd_ps(load_bf16x8(krow[j + i] + 8 * c), qc, acc[i]);
            }
            _mm256_storeu_ps(sc + j, _mm256_mul_ps(sum8x8(acc), _mm256_set1_ps(scale)));
        }
        for (; j < ctx; ++j) {
            __m256 acc = _mm256_setzero_ps();
            for (int c = 0; c < 2 * NZ; ++c)
                acc = _mm256_fmadd_ps(load_bf16x8(krow[j] + 8 * c), _mm256_loadu_ps(q + 8 * c),
                                      acc);
            sc[j] = hsum(acc) * scale;
        }
    }

    // o = bf16(sum_j p_j v_j): fp32 products, 8 lanes per register.
    template <int NZ>
    static void weigh_values(const float* p, const uint16_t* const* vrow, int64_t ctx,
                             float* o) {
        __m256 acc[2 * NZ];
        for (int c = 0; c < 2 * NZ; ++c) acc[c] = _mm256_setzero_ps();
        for (int64_t j = 0; j < ctx; ++j) {
            const __m256 pj = _mm256_set1_ps(p[j]);
            for (int c = 0; c < 2 * NZ; ++c)
                acc[c] = _mm256_fmadd_ps(pj, load_bf16x8(vrow[j] + 8 * c), acc[c]);
        }
        for (int c = 0; c < 2 * NZ; ++c) _mm256_storeu_ps(o + 8 * c, bf16_round8(acc[c]));
    }
#endif

    // Eight 8-lane sums at once: lane i of the result is the sum of a[i]'s lanes.
    static __m256 sum8x8(const __m256* a) {
        const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
        const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
        const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
        return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                             _mm256_permute2f128_ps(u0, u1, 0x31));
    }

    // sc[0 .. n) = softmax(sc) in place (fp32).
    static void softmax(float* sc, int64_t n) {
        __m256 mx8 = _mm256_set1_ps(-INFINITY);
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) mx8 = _mm256_max_ps(mx8, _mm256_loadu_ps(sc + j));
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, mx8);
        float mx = lanes[0];
        for (int i = 1; i < 8; ++i) mx = std::max(mx, lanes[i]);
        for (int64_t i = j; i < n; ++i) mx = std::max(mx, sc[i]);
        const __m256 m8 = _mm256_set1_ps(mx);
        __m256 sum8 = _mm256_setzero_ps();
        for (j = 0; j + 8 <= n; j += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + j), m8));
            _mm256_storeu_ps(sc + j, e);
            sum8 = _mm256_add_ps(sum8, e);
        }
        float sum = hsum(sum8);
        for (; j < n; ++j) {
            sc[j] = std::exp(sc[j] - mx);
            sum += sc[j];
        }
        const float inv = 1.f / sum;
        const __m256 inv8 = _mm256_set1_ps(inv);
        for (j = 0; j + 8 <= n; j += 8)
            _mm256_storeu_ps(sc + j, _mm256_mul_ps(_mm256_loadu_ps(sc + j), inv8));
        for (; j < n; ++j) sc[j] *= inv;
    }

    // Scratch for a step's activations, kept between steps: a prefill chunk's buffers are
    // tens of MB, and fresh ones per layer cost page faults (glibc maps and unmaps them).
    struct Buffers {
        VecF h, res, x, qkv, attn, o, xn, gu, act;
        Vec16 q16, k16, v16, o16;  // a prefill chunk's attention (bf16)
        Vec16 attn16;  // the AMX kernel's rows where attention() returns fp32
    };
    template <typename V>
    static V& sized(V& v, int64_t n) {
        v.resize(n);
        return v;
    }
    Buffers buf_;
    std::vector<torch::Tensor> gu_;  // mlp_bf16's gate/up output between its parts
    std::mutex mutex_;
    bool timing_ = false;
    std::array<double, NUM_PARTS> part_ns_{};

    int64_t H_, Hq_, Hkv_, D_, I_;
    float eps_;
    torch::Tensor cos_, sin_;
    std::vector<float> final_norm_;
    std::vector<Layer> layers_;
};

// y [M, N] fp32 = x [M, K] @ W^T for one stand-alone linear (the LM head), bf16-rounded;
// x holds bf16 values (a bf16 hidden state).
class FusedLinear {
  public:
    FusedLinear(FusedDecoder::Segs segs, torch::Tensor bias, int64_t K)
        : L_(make_linear(segs, bias, K)) {}

    torch::Tensor forward(torch::Tensor x) {
        TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(1) == L_.K, "x must be [rows, K]");
        auto xf = x.to(torch::kFloat32).contiguous();
        auto y = torch::empty({x.size(0), L_.N}, torch::kFloat32);
        linear(L_, xf.data_ptr<float>(), x.size(0), y.data_ptr<float>());
        return y;
    }

  private:
    Linear L_;
};

// y [M, N] fp32 = x [M, K] fp32 @ w [N, K] bf16 ^T, fp32 accumulation (no rounding): the
// eager model's bf16 decode GEMV (pdserve/engine/kernels/cpu_gemv.py), 1 to 8 rows.
torch::Tensor gemv(torch::Tensor w, torch::Tensor x) {
    TORCH_CHECK(w.scalar_type() == torch::kBFloat16 && w.is_contiguous() && w.dim() == 2,
                "w must be a contiguous 2-D bf16 tensor");
    TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2,
                "x must be a contiguous 2-D fp32 tensor");
    const int64_t N = w.size(0), K = w.size(1), M = x.size(0);
    TORCH_CHECK(x.size(1) == K && M >= 1 && M <= 8, "x must be [1 to 8, K]");
    auto y = torch::empty({M, N}, x.options());
    Segment g{BF16, N, w, torch::Tensor()};
    gemv_bf16(g, K, x.data_ptr<float>(), M, y.data_ptr<float>(), N, /*bf16_x=*/false);
    return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("gemv", &gemv, pybind11::call_guard<pybind11::gil_scoped_release>());
    // module_local: the AVX2 and the AVX512-BF16 builds can be loaded in one process
    pybind11::class_<FusedDecoder>(m, "FusedDecoder", pybind11::module_local())
        .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, torch::Tensor,
                            torch::Tensor, torch::Tensor>())
        .def("add_layer", &FusedDecoder::add_layer)
        .def("num_layers", &FusedDecoder::num_layers)
        .def("warm_gemms", &FusedDecoder::warm_gemms,
             pybind11::call_guard<pybind11::gil_scoped_release>())
        .def("set_timing", &FusedDecoder::set_timing)
        .def("part_ms", &FusedDecoder::part_ms)
        .def("pack_weights", &FusedDecoder::pack_weights,
             pybind11::call_guard<pybind11::gil_scoped_release>())
        .def("forward", &FusedDecoder::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
    pybind11::class_<FusedLinear>(m, "FusedLinear", pybind11::module_local())
        .def(pybind11::init<FusedDecoder::Segs, torch::Tensor, int64_t>())
        .def("forward", &FusedLinear::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    m.def("amx_usable", &amx_usable);
    m.def("amx_prefill_attention", &amx_prefill_attention,
          pybind11::call_guard<pybind11::gil_scoped_release>());
#else
    m.def("amx_usable", [] { return false; });
#endif
#if defined(__AVX512BF16__)
    m.def("prefill_attention", &prefill_attention,  // cpu_prefill_attention.cpp
          pybind11::call_guard<pybind11::gil_scoped_release>());
#endif
    m.def("prefill_attention_f32", &prefill_attention_f32,  // cpu_flash_f32.cpp
          pybind11::call_guard<pybind11::gil_scoped_release>());
}
