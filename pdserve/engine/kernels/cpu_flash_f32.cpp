// Causal prefill attention over fp32 Q/K/V with AVX2 + FMA: where the CPU has no native
// 16-bit dot products, prefills attend in fp32 (FlashAttention's online softmax over key
// blocks, Dao et al. 2022; nothing of size [queries, keys] is written out).
//
// A work item is 24 rows of one KV head: the (query token, query head) pairs of the heads
// that share it (grouped-query attention without repeating K/V), token-major, padded with
// copies of the last row. Rows sit in the vector lanes (3 vectors of 8): the queries are
// transposed once per item into Qt[D][24] (times scale * log2(e), so the softmax is 2^x),
// and everything after reads K and V in place, one scalar broadcast per key and dimension:
//   St[key][24] = sum_d Qt[d][.] * K[key][d]      (4 keys x 3 vectors of accumulators)
//   Ot[d][24]  += sum_key V[key][d] * Pt[key][.]  (4 dimensions x 3 vectors)
// so the running max and sum of each row are lane-wise (no horizontal reductions) and K/V
// need no packing. Every value is fp32; 2^x is a degree-6 polynomial (relative error
// ~1e-7).
//
// Compiled with cpu_decode.cpp as one translation unit (cpu_decode.py puts this text after
// cpu_prefill_attention.cpp, whose operand checks it shares, and before cpu_decode.cpp,
// which binds prefill_attention_f32 in every build).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
namespace pdserve_flash_f32 {

constexpr int KB = 64;  // keys per block (one online-softmax update)
constexpr int RT = 24;  // rows per item
constexpr int RV = 3;   // vectors per row set

// 2^x for x <= 0 (lanes at or below -126.5, -inf included, give 0): x = n + f with |f| <=
// 1/2, 2^f by its degree-6 Taylor polynomial in f ln 2, times 2^n built in the exponent.
inline __m256 exp2_8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-127.f));
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(x, n);
    constexpr float c[7] = {1.f, 0.693147181f, 0.240226507f, 0.0555041087f, 0.00961812911f,
                            0.00133335581f, 0.000154035304f};  // ln2^k / k!
    __m256 p = _mm256_set1_ps(c[6]);
    for (int k = 5; k >= 0; --k) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c[k]));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

struct Shapes {
    int64_t n, num_ctx, lk, heads, kv_heads, group, sq_t, sk_t, sv_t, so_t;
    float scale;
};

// St[j][24] for the 4 key rows kr[j] over the D dimensions of Qt.
template <int D>
inline void scores4(const float* Qt, const float* const* kr, float* St) {
    __m256 a[4][RV];
    for (int j = 0; j < 4; ++j)
        for (int i = 0; i < RV; ++i) a[j][i] = _mm256_setzero_ps();
    for (int d = 0; d < D; ++d) {
        __m256 q[RV];
        for (int i = 0; i < RV; ++i) q[i] = _mm256_load_ps(Qt + d * RT + i * 8);
        for (int j = 0; j < 4; ++j) {
            const __m256 kb = _mm256_broadcast_ss(kr[j] + d);
            for (int i = 0; i < RV; ++i) a[j][i] = _mm256_fmadd_ps(q[i], kb, a[j][i]);
        }
    }
    for (int j = 0; j < 4; ++j)
        for (int i = 0; i < RV; ++i) _mm256_store_ps(St + j * RT + i * 8, a[j][i]);
}

// Ot[d][24] = alpha * Ot[d][24] + sum over nk keys of V[key][d] * Pt[key][24].
template <int D>
inline void weigh(const float* Pt, const float* v0, int64_t sv, int nk, const __m256* alpha,
                  float* Ot) {
    for (int d0 = 0; d0 < D; d0 += 4) {
        __m256 a[4][RV];
        for (int e = 0; e < 4; ++e)
            for (int i = 0; i < RV; ++i)
                a[e][i] = _mm256_mul_ps(_mm256_load_ps(Ot + (d0 + e) * RT + i * 8), alpha[i]);
        for (int j = 0; j < nk; ++j) {
            __m256 p[RV];
            for (int i = 0; i < RV; ++i) p[i] = _mm256_load_ps(Pt + j * RT + i * 8);
            const float* vr = v0 + j * sv + d0;
            for (int e = 0; e < 4; ++e) {
                const __m256 vb = _mm256_broadcast_ss(vr + e);
                for (int i = 0; i < RV; ++i) a[e][i] = _mm256_fmadd_ps(p[i], vb, a[e][i]);
            }
        }
        for (int e = 0; e < 4; ++e)
            for (int i = 0; i < RV; ++i) _mm256_store_ps(Ot + (d0 + e) * RT + i * 8, a[e][i]);
    }
}

// One item: KV head h, flattened rows r0 .. r0 + 24 of (token, head in group).
template <int D>
void item(const float* q, const float* k, const float* v, float* out, const Shapes& s,
          int64_t h, int64_t r0) {
    alignas(32) float Qt[D * RT], Ot[D * RT], St[KB * RT], pos[RT];
    const int64_t rows = s.n * s.group;
    const float qscale = s.scale * 1.44269504f;  // log2(e): the softmax in powers of 2
    int64_t last = 0;
    for (int r = 0; r < RT; ++r) {
        const int64_t row = std::min(r0 + r, rows - 1), t = row / s.group;
        const float* qr = q + t * s.sq_t + (h * s.group + row % s.group) * D;
        for (int d = 0; d < D; ++d) Qt[d * RT + r] = qr[d] * qscale;
        pos[r] = static_cast<float>(s.num_ctx + t);
        last = std::max(last, s.num_ctx + t);
    }
    std::fill(Ot, Ot + D * RT, 0.f);
    __m256 m[RV], l[RV], pv[RV];
    for (int i = 0; i < RV; ++i) {
        m[i] = _mm256_set1_ps(-INFINITY);
        l[i] = _mm256_setzero_ps();
        pv[i] = _mm256_load_ps(pos + i * 8);
    }
    const int64_t first = s.num_ctx + r0 / s.group;  // the smallest position of the item
    const float* kh = k + h * D;
    const float* vh = v + h * D;
    for (int64_t b0 = 0; b0 <= last; b0 += KB) {
        const int nk = static_cast<int>(std::min<int64_t>(KB, last + 1 - b0));
        for (int j = 0; j < nk; j += 4) {  // keys past `last` are masked below
            const float* kr[4];
            for (int x = 0; x < 4; ++x)
                kr[x] = kh + std::min<int64_t>(b0 + j + x, s.lk - 1) * s.sk_t;
            scores4<D>(Qt, kr, St + j * RT);
        }
        const int nk4 = (nk + 3) & ~3;
        __m256 mx[RV];
        for (int i = 0; i < RV; ++i) mx[i] = m[i];
        for (int j = 0; j < nk4; ++j) {
            const __m256 kj = _mm256_set1_ps(static_cast<float>(b0 + j));
            for (int i = 0; i < RV; ++i) {
                __m256 sc = _mm256_load_ps(St + j * RT + i * 8);
                if (b0 + j > first)  // causal: rows before this key do not see it
                    sc = _mm256_blendv_ps(sc, _mm256_set1_ps(-INFINITY),
                                          _mm256_cmp_ps(pv[i], kj, _CMP_LT_OQ));
                _mm256_store_ps(St + j * RT + i * 8, sc);
                mx[i] = _mm256_max_ps(mx[i], sc);
            }
        }
        __m256 alpha[RV];
        for (int i = 0; i < RV; ++i) {
            alpha[i] = exp2_8(_mm256_sub_ps(m[i], mx[i]));  // m = -inf at first: 0
            l[i] = _mm256_mul_ps(l[i], alpha[i]);
            m[i] = mx[i];
        }
        for (int j = 0; j < nk; ++j)
            for (int i = 0; i < RV; ++i) {
                const __m256 p = exp2_8(_mm256_sub_ps(_mm256_load_ps(St + j * RT + i * 8), m[i]));
                l[i] = _mm256_add_ps(l[i], p);
                _mm256_store_ps(St + j * RT + i * 8, p);
            }
        weigh<D>(St, vh + b0 * s.sv_t, s.sv_t, nk, alpha, Ot);
    }
    alignas(32) float inv[RT];
    for (int i = 0; i < RV; ++i)
        _mm256_store_ps(inv + i * 8, _mm256_div_ps(_mm256_set1_ps(1.f), l[i]));
    for (int r = 0; r < RT && r0 + r < rows; ++r) {
        const int64_t row = r0 + r, t = row / s.group;
        float* o = out + t * s.so_t + (h * s.group + row % s.group) * D;
        for (int d = 0; d < D; ++d) o[d] = Ot[d * RT + r] * inv[r];
    }
}

template <int D>
void run(const float* q, const float* k, const float* v, float* out, const Shapes& s) {
    // Causal work grows with the item: pair item i with item ni - 1 - i so that the even
    // split of parallel_for gives every thread the same work.
    const int64_t ni = (s.n * s.group + RT - 1) / RT, npairs = (ni + 1) / 2;
    at::parallel_for(0, s.kv_heads * npairs, 1, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
            const int64_t h = i / npairs, p = i % npairs, other = ni - 1 - p;
            item<D>(q, k, v, out, s, h, p * RT);
            if (other != p) item<D>(q, k, v, out, s, h, other * RT);
        }
    });
}

}  // namespace pdserve_flash_f32

// Causal prefill attention, fp32 in and out (see the top of this file).
//   q [n, H, D], k/v [num_ctx + n, Hkv, D]: fp32, last two dimensions contiguous; query i
//   attends to keys 0 .. num_ctx + i. D in {32, 64, 128}; H a multiple of Hkv.
//   Returns [n, H, D] fp32.
torch::Tensor prefill_attention_f32(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                    int64_t num_ctx, double scale) {
    using namespace pdserve_flash_f32;
    check_prefill_operands(q, k, v, num_ctx, torch::kFloat32, "fp32");  // cpu_prefill_attention.cpp
    const int64_t n = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(1);
    auto out = torch::empty({n, H, D}, q.options());
    if (n == 0) return out;
    const Shapes s{n, num_ctx, num_ctx + n, H, Hkv, H / Hkv, q.stride(0), k.stride(0),
                   v.stride(0), H * D, static_cast<float>(scale)};
    const float *qd = q.data_ptr<float>(), *kd = k.data_ptr<float>(), *vd = v.data_ptr<float>();
    float* od = out.data_ptr<float>();
    if (D == 32) run<32>(qd, kd, vd, od, s);
    else if (D == 64) run<64>(qd, kd, vd, od, s);
    else run<128>(qd, kd, vd, od, s);
    return out;
}
#endif  // __AVX2__ && __FMA__
