// Causal attention of a prefill (a prompt, or a chunk after its context) over bf16 Q/K/V on
// x86 CPUs with AVX512-BF16, in the manner of FlashAttention (Dao et al. 2022, online
// softmax over key blocks; nothing of size [queries, keys] is ever written out).
//
// Work items are (KV head, block of QT query tokens); the rows of an item are its tokens
// times the query heads that share the KV head (grouped-query attention without repeating
// K/V). K and V are first repacked per KV head into key blocks of KB keys laid out for
// vdpbf16ps (pairs of bf16 summed into one fp32 lane):
//   Kp[block][D/2][KB][2]  lanes = 16 keys, a pair = two adjacent dimensions of one key
//   Vp[block][KB/2][D][2]  lanes = 16 dimensions, a pair = one dimension of two adjacent keys
// so that S = Q K^T takes a broadcast pair of a query row against 16 keys, and O += P V a
// broadcast pair of probabilities against 16 dimensions. Scores and the running max/sum
// are fp32; probabilities are rounded to bf16 for P V (as torch's bf16 flash kernel does);
// the output accumulates in fp32 and is rounded to bf16 once.
//
// It is compiled with cpu_decode.cpp as one translation unit (cpu_decode.py puts this text
// first), which binds prefill_attention in the AVX512-BF16 build.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

// The checks both prefill kernels make of their operands (this one and cpu_flash_f32.cpp):
// q [n, H, D], k/v [num_ctx + n, Hkv, D] of `dtype` (named in the error), D in {32, 64,
// 128}, H a multiple of Hkv, last two dimensions contiguous. Raises c10::Error.
inline void check_prefill_operands(const torch::Tensor& q, const torch::Tensor& k,
                                   const torch::Tensor& v, int64_t num_ctx,
                                   c10::ScalarType dtype, const char* dtype_name) {
    TORCH_CHECK(q.scalar_type() == dtype && k.scalar_type() == dtype &&
                v.scalar_type() == dtype, "q, k, v must be ", dtype_name);
    TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be 3-D");
    const int64_t n = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(1);
    TORCH_CHECK(k.sizes() == v.sizes() && k.size(2) == D && k.size(0) == num_ctx + n &&
                num_ctx >= 0 && Hkv > 0 && H % Hkv == 0, "shapes do not match");
    TORCH_CHECK(D == 32 || D == 64 || D == 128, "head_dim must be 32, 64 or 128");
    for (const auto& t : {q, k, v})
        TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == D, "last two dimensions must be contiguous");
}

#if defined(__AVX512BF16__)
namespace pdserve_prefill_attention {

constexpr int KB = 64;   // keys per block (4 vectors of 16)
constexpr int QT = 16;   // query tokens per work item

inline uint16_t to_bf16(float f) {  // round to nearest even (values here are finite)
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += 0x7fff + ((u >> 16) & 1);
    return static_cast<uint16_t>(u >> 16);
}

// e^x for 16 lanes, clamped to fp32's range: x = n ln2 + r with |r| <= ln2 / 2 (ln 2 in two
// parts), e^r by its degree-DEG Taylor polynomial (Horner), times 2^n built in the exponent
// field. DEG 5: relative error < 3e-6; DEG 6 (the fused kernel's SiLU, as its 8-lane exp8):
// about 1 ulp.
template <int DEG>
inline __m512 exp16_taylor(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
    float inv_factorial[DEG + 1];  // 1 / k!, k! exact in an int: the literals 1.f / 720.f ...
    for (int k = 0, f = 1; k <= DEG; ++k, f *= k) inv_factorial[k] = 1.f / static_cast<float>(f);
    __m512 p = _mm512_set1_ps(inv_factorial[DEG]);
    for (int k = DEG - 1; k >= 0; --k) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(inv_factorial[k]));
    const __m512i e = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// e^x for the softmax: degree 5; x below -87 (masked scores: -inf) gives 0.
inline __m512 exp16(__m512 x) {
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_LT_OQ);
    return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), exp16_taylor<5>(x));
}

inline __m512bh pair_of(const uint16_t* p) {  // two bf16 as one 32-bit lane, broadcast
    uint32_t u;
    std::memcpy(&u, p, 4);
    return (__m512bh)_mm512_set1_epi32(static_cast<int>(u));
}

struct Shapes {
    int64_t n, num_ctx, lk, heads, kv_heads, group, dim, nkb;
    int64_t sq_t, sk_t, sv_t, so_t;  // token strides (elements)
    float scale;
};

// Repack the K/V rows of one KV head into Kp/Vp blocks (zeros past the last key).
void pack_head(const uint16_t* k, const uint16_t* v, const Shapes& s, int64_t h,
               uint16_t* kp, uint16_t* vp) {
    const int64_t D = s.dim, block = D * KB;
    for (int64_t b = 0; b < s.nkb; ++b) {
        uint16_t* kb = kp + b * block;
        uint16_t* vb = vp + b * block;
        for (int64_t j = 0; j < KB; ++j) {
            const int64_t key = b * KB + j;
            const bool valid = key < s.lk;
            const uint16_t* kr = k + key * s.sk_t + h * D;
            const uint16_t* vr = v + key * s.sv_t + h * D;
            for (int64_t d = 0; d < D; ++d) {
                kb[((d >> 1) * KB + j) * 2 + (d & 1)] = valid ? kr[d] : 0;
                vb[((j >> 1) * D + d) * 2 + (j & 1)] = valid ? vr[d] : 0;
            }
        }
    }
}

// S[MR rows][KB keys] = Q rows . keys of one block (unscaled).
template <int MR>
inline void scores(const uint16_t* const* q, const uint16_t* kb, int64_t D, float* S) {
    __m512 acc[MR][4];
    for (int r = 0; r < MR; ++r)
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t dp = 0; dp < D / 2; ++dp) {
        __m512bh kv[4];
        for (int c = 0; c < 4; ++c)
            kv[c] = (__m512bh)_mm512_loadu_si512(kb + (dp * KB + c * 16) * 2);
        for (int r = 0; r < MR; ++r) {
            const __m512bh qp = pair_of(q[r] + dp * 2);
            for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], qp, kv[c]);
        }
    }
    for (int r = 0; r < MR; ++r)
        for (int c = 0; c < 4; ++c) _mm512_storeu_ps(S + r * KB + c * 16, acc[r][c]);
}

// O[MR rows][DV * 16] += P[MR rows][KB keys] (bf16) . V block.
template <int MR, int DV>
inline void weigh(const uint16_t* P, const uint16_t* vb, float* O) {
    constexpr int D = DV * 16;
    __m512 acc[MR][DV];
    for (int r = 0; r < MR; ++r)
        for (int c = 0; c < DV; ++c) acc[r][c] = _mm512_loadu_ps(O + r * D + c * 16);
    for (int jp = 0; jp < KB / 2; ++jp) {
        __m512bh vv[DV];
        for (int c = 0; c < DV; ++c)
            vv[c] = (__m512bh)_mm512_loadu_si512(vb + (jp * D + c * 16) * 2);
        for (int r = 0; r < MR; ++r) {
            const __m512bh pp = pair_of(P + r * KB + jp * 2);
            for (int c = 0; c < DV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pp, vv[c]);
        }
    }
    for (int r = 0; r < MR; ++r)
        for (int c = 0; c < DV; ++c) _mm512_storeu_ps(O + r * D + c * 16, acc[r][c]);
}

// Online-softmax update of one row with its scores S[KB] (keys past `last` masked):
// returns the factor its output must be multiplied by, writes P[KB] in bf16. The row's
// running sum stays 16 lanes wide (l[16], summed once at the end).
inline float softmax_step(float* S, int64_t last, float scale, float& m, float* l,
                          uint16_t* P) {
    for (int64_t j = std::max<int64_t>(last + 1, 0); j < KB; ++j) S[j] = -INFINITY;
    __m512 s[4];
    for (int c = 0; c < 4; ++c) s[c] = _mm512_loadu_ps(S + c * 16);
    const __m512 mx = _mm512_max_ps(_mm512_max_ps(s[0], s[1]), _mm512_max_ps(s[2], s[3]));
    const float m_new = std::max(m, _mm512_reduce_max_ps(mx) * scale);
    const float alpha = m_new == m ? 1.f : std::exp(m - m_new);  // m = -inf at first: 0
    const __m512 sc = _mm512_set1_ps(scale), mn = _mm512_set1_ps(m_new);
    __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(l), _mm512_set1_ps(alpha));
    for (int c = 0; c < 4; ++c) {
        const __m512 p = exp16(_mm512_fmsub_ps(s[c], sc, mn));
        sum = _mm512_add_ps(sum, p);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(P + c * 16),
                            (__m256i)_mm512_cvtneps_pbh(p));
    }
    _mm512_storeu_ps(l, sum);
    m = m_new;
    return alpha;
}

// The rows r0 .. r0 + MR of one work item against key block b.
template <int MR, int DV>
inline void rows_step(const uint16_t* const* q, const int64_t* pos, const uint16_t* kb,
                      const uint16_t* vb, int64_t b, float scale, float* m, float* l,
                      float* O) {
    constexpr int D = DV * 16;
    alignas(64) float S[MR * KB];
    alignas(64) uint16_t P[MR * KB];
    scores<MR>(q, kb, D, S);
    for (int r = 0; r < MR; ++r) {
        const float alpha = softmax_step(S + r * KB, pos[r] - b * KB, scale, m[r],
                                         l + r * 16, P + r * KB);
        if (alpha != 1.f) {
            const __m512 a = _mm512_set1_ps(alpha);
            for (int c = 0; c < DV; ++c)
                _mm512_storeu_ps(O + r * D + c * 16,
                                 _mm512_mul_ps(a, _mm512_loadu_ps(O + r * D + c * 16)));
        }
    }
    weigh<MR, DV>(P, vb, O);
}

// Every row of one work item (KV head h, query tokens q0 .. q0 + ntok) over its keys.
template <int DV, int MR>
void item(const uint16_t* q, uint16_t* out, const uint16_t* kp, const uint16_t* vp,
          const Shapes& s, int64_t h, int64_t q0, int64_t ntok) {
    constexpr int D = DV * 16;
    const int64_t R = ntok * s.group, block = D * KB;
    std::vector<float> O(R * D, 0.f), m(R, -INFINITY), l(R * 16, 0.f);
    std::vector<const uint16_t*> qrow(R);
    std::vector<int64_t> pos(R);
    for (int64_t r = 0; r < R; ++r) {
        const int64_t t = r / s.group, head = h * s.group + r % s.group;
        qrow[r] = q + (q0 + t) * s.sq_t + head * D;
        pos[r] = s.num_ctx + q0 + t;
    }
    const int64_t last_block = (s.num_ctx + q0 + ntok - 1) / KB;
    for (int64_t b = 0; b <= last_block; ++b) {
        const uint16_t* kb = kp + b * block;
        const uint16_t* vb = vp + b * block;
        int64_t r0 = 0;
        for (; r0 + MR <= R; r0 += MR)
            rows_step<MR, DV>(&qrow[r0], &pos[r0], kb, vb, b, s.scale, &m[r0], &l[r0 * 16],
                              &O[r0 * D]);
        for (; r0 < R; ++r0)
            rows_step<1, DV>(&qrow[r0], &pos[r0], kb, vb, b, s.scale, &m[r0], &l[r0 * 16],
                             &O[r0 * D]);
    }
    for (int64_t r = 0; r < R; ++r) {
        const int64_t t = r / s.group, head = h * s.group + r % s.group;
        uint16_t* o = out + (q0 + t) * s.so_t + head * D;
        const float inv = 1.f / _mm512_reduce_add_ps(_mm512_loadu_ps(&l[r * 16]));
        for (int64_t d = 0; d < D; ++d) o[d] = to_bf16(O[r * D + d] * inv);
    }
}

template <int DV, int MR>
void run(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out,
         const Shapes& s) {
    const int64_t block = s.dim * KB, per_head = s.nkb * block;
    std::vector<uint16_t> kp(s.kv_heads * per_head), vp(s.kv_heads * per_head);
    at::parallel_for(0, s.kv_heads * s.nkb, 1, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {  // one key block of one head per index
            const int64_t h = i / s.nkb, b = i % s.nkb;
            Shapes one = s;
            one.nkb = 1;
            one.lk = s.lk - b * KB;
            pack_head(k + b * KB * s.sk_t, v + b * KB * s.sv_t, one, h,
                      kp.data() + h * per_head + b * block, vp.data() + h * per_head + b * block);
        }
    });
    // Causal work grows with the query block: pair block i with block nqb - 1 - i so that
    // the even split of parallel_for gives every thread the same work.
    const int64_t nqb = (s.n + QT - 1) / QT, npairs = (nqb + 1) / 2;
    at::parallel_for(0, s.kv_heads * npairs, 1, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
            const int64_t h = i / npairs, p = i % npairs, other = nqb - 1 - p;
            for (int64_t qb : {p, other}) {
                item<DV, MR>(q, out, kp.data() + h * per_head, vp.data() + h * per_head, s, h,
                             qb * QT, std::min<int64_t>(QT, s.n - qb * QT));
                if (other == p) break;
            }
        }
    });
}

// The kernel for s.dim (32, 64 or 128; checked by the callers) over raw bf16 pointers.
inline void causal(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out,
                   const Shapes& s) {
    if (s.dim == 32) run<2, 4>(q, k, v, out, s);
    else if (s.dim == 64) run<4, 6>(q, k, v, out, s);
    else run<8, 2>(q, k, v, out, s);
}

}  // namespace pdserve_prefill_attention

// Causal prefill attention, bf16 in and out (see the top of this file).
//   q [n, H, D], k/v [num_ctx + n, Hkv, D]: bf16, last two dimensions contiguous; query i
//   attends to keys 0 .. num_ctx + i. D in {32, 64, 128}; H a multiple of Hkv.
//   Returns [n, H, D] bf16.
torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                int64_t num_ctx, double scale) {
    using namespace pdserve_prefill_attention;
    check_prefill_operands(q, k, v, num_ctx, torch::kBFloat16, "bf16");
    const int64_t n = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(1);
    auto out = torch::empty({n, H, D}, q.options());
    if (n == 0) return out;
    Shapes s{n, num_ctx, num_ctx + n, H, Hkv, H / Hkv, D, (num_ctx + n + KB - 1) / KB,
             q.stride(0), k.stride(0), v.stride(0), H * D, static_cast<float>(scale)};
    auto* qd = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
    auto* kd = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
    auto* vd = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
    auto* od = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
    causal(qd, kd, vd, od, s);
    return out;
}
#endif  // __AVX512BF16__
