// Quantized weights against int8 activations (QuantAct: per block of 32 columns, x = dx *
// xq) with 16 output channels in the lanes: the codes repacked once at load into 16-row
// tiles whose 64-byte pieces are vpdpbusd operands (q8_tiles, q4_tiles), so each block's
// dot product I_b = sum over its 32 columns of code * xq is an exact integer in its row's
// lane (the activations broadcast, 4 columns at a time), and a row's output is accumulated
// over the blocks in order (Q8: fma(float(I_b), dx_b, acc), times the row's scale at the
// end; Q4, w = d * code + m: fma(float(I_b), d_b * dx_b, acc) plus the offsets' fma(m_b,
// s_b, ...) apart, s_b the block's exact activation sum). The same operations whatever the
// number of activation rows and however they are grouped, so a step's rows stay independent
// of the step (speculative verification computes what plain decoding computes). Against the
// per-row kernels (gemv_q8, gemv_q4: columns in the lanes, each activation row's products
// summed per lane, then across the lanes, a weight row read once per chunk of activation
// rows), the weights are read once for up to 8 activation rows and no sum crosses lanes. A
// 2-core Xeon, SmolLM2's 30 layers' GEMMs (30 distinct weight sets, streamed), alternating
// builds: Q8 1 row 7.3 -> 6.2 ms, 4 rows 10.8 -> 8.2, 8 rows 14.9 -> 10.3, 16 rows 28.3 ->
// 14.7, 32 rows 49.2 -> 23.8; Q4 5.3 -> 4.3, 12.1 -> 5.8, 17.8 -> 8.0, 29.7 -> 13.4, 63.2
// -> 24.3; the activations then broadcast from memory, not a register: 32 rows Q8 23.3 ->
// 20.7, Q4 21.5 -> 20.2. (Q8's products in AMX int8 tiles instead, one tile product and one
// tile store per block for its activation scale: no faster, 106 ns a 16 x 16 x 32 block.)
// The tiles are a second copy of the codes (the row-major ones stay for the prefill's
// dequantization): SmolLM2's peak RSS +35 MB with rtn-int8. Compiled after cpu_decode.cpp
// (one translation unit: cpu_decode.py joins the files), which declares these for linear().

#if defined(__AVX512VNNI__)
namespace {

// fn(std::integral_constant<int, MC>{}, m0) over activation rows 0 .. M in groups of MC =
// 8, then 4, then the 1-3 left (each row computed the same way in any group).
template <class Fn>
inline void in_row_groups(int64_t M, const Fn& fn) {
    int64_t m0 = 0;
    for (; m0 + 8 <= M; m0 += 8) fn(std::integral_constant<int, 8>{}, m0);
    if (M - m0 >= 4) {
        fn(std::integral_constant<int, 4>{}, m0);
        m0 += 4;
    }
    if (M - m0 == 3) fn(std::integral_constant<int, 3>{}, m0);
    else if (M - m0 == 2) fn(std::integral_constant<int, 2>{}, m0);
    else if (M - m0 == 1) fn(std::integral_constant<int, 1>{}, m0);
}

// 4 bytes at p in every 32-bit lane (a load the compiler folds into vpdpbusd's broadcast
// operand).
inline __m512i bcast32(const void* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

// Segment g's Q8 codes in the q8_tiles layout, as code + 128 (vpdpbusd's unsigned operand;
// the activations are the signed one, broadcast). Requires rows % 16 == 0, K % 32 == 0.
void q8_tiles(Segment& g, int64_t K) {
    const int64_t groups = g.rows / 16;
    g.wt = torch::empty({groups, K / 4, 64}, torch::kUInt8);
    const int8_t* w = g.w.data_ptr<int8_t>();
    uint8_t* wt = g.wt.data_ptr<uint8_t>();
    at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
        for (int64_t gi = g0; gi < g1; ++gi)
            for (int64_t r = 0; r < 16; ++r) {
                const int8_t* row = w + (gi * 16 + r) * K;
                for (int64_t j = 0; j < K / 4; ++j)
                    for (int64_t i = 0; i < 4; ++i)
                        wt[(gi * (K / 4) + j) * 64 + r * 4 + i] =
                            static_cast<uint8_t>(row[4 * j + i]) ^ 0x80;
            }
    });
}

// MC activation rows (from m0) against one group of 16 weight rows (w: its K / 4 x 64
// bytes of code + 128); xs: 128 * each activation block's sum of codes, which the unsigned
// codes' products carry on top of the block's dot product; y: the group's first column.
template <int MC>
inline void q8t_group(const uint8_t* w, const int8_t* xq, const int32_t* xs, const float* xd,
                      int64_t K, int64_t m0, __m512 sv, float* y, int64_t ldy) {
    const int64_t nb = K / QBLOCK;
    __m512 acc[MC];
    for (int mc = 0; mc < MC; ++mc) acc[mc] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        __m512i dot[MC], dot2[MC];  // even and odd column quads: two chains, summed exactly
        for (int mc = 0; mc < MC; ++mc) dot[mc] = dot2[mc] = _mm512_setzero_si512();
        for (int64_t j = 0; j < QBLOCK / 4; j += 2) {
            const __m512i wv = _mm512_loadu_si512(w + (b * 8 + j) * 64);
            const __m512i wv2 = _mm512_loadu_si512(w + (b * 8 + j + 1) * 64);
            for (int mc = 0; mc < MC; ++mc) {
                const int8_t* x = xq + (m0 + mc) * K + b * QBLOCK + 4 * j;
                dot[mc] = _mm512_dpbusd_epi32(dot[mc], wv, bcast32(x));
                dot2[mc] = _mm512_dpbusd_epi32(dot2[mc], wv2, bcast32(x + 4));
            }
        }
        for (int mc = 0; mc < MC; ++mc) {
            const __m512i dots = _mm512_sub_epi32(_mm512_add_epi32(dot[mc], dot2[mc]),
                                                  _mm512_set1_epi32(xs[(m0 + mc) * nb + b]));
            acc[mc] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots),
                                      _mm512_set1_ps(xd[(m0 + mc) * nb + b]), acc[mc]);
        }
    }
    for (int mc = 0; mc < MC; ++mc)
        _mm512_storeu_ps(y + (m0 + mc) * ldy, _mm512_mul_ps(acc[mc], sv));
}

// Y [M, ldy] columns 0 .. g.rows = X W^T for a Q8 segment with q8_tiles (the file comment),
// on AVX512-VNNI: up to eight activation rows per pass over a group's codes.
void gemv_q8t(const Segment& g, int64_t K, const QuantAct& a, int64_t M, float* Y, int64_t ldy) {
    const uint8_t* wt = g.wt.data_ptr<uint8_t>();
    const float* S = g.s.data_ptr<float>();
    at::parallel_for(0, g.rows / 16, 4, [&](int64_t g0, int64_t g1) {
        for (int64_t gi = g0; gi < g1; ++gi) {
            const uint8_t* w = wt + gi * (K / 4) * 64;
            const __m512 sv = _mm512_loadu_ps(S + gi * 16);
            float* y = Y + gi * 16;
            in_row_groups(M, [&](auto mc, int64_t m0) {
                q8t_group<decltype(mc)::value>(w, a.q.data(), a.qs.data(), a.d.data(), K, m0, sv,
                                               y, ldy);
            });
        }
    });
}

// Segment g's Q4 codes in 16-row tiles, wt uint8 [rows / 16][K / 8][16][4]: each 64 bytes
// the columns 8j .. 8j + 7 of 16 rows, byte i of a row holding column 8j + i (low nibble)
// and 8j + 4 + i (high); dm fp32 [rows / 16][K / 32][2][16]: each block's d, then m, of the
// 16 rows. Requires rows % 16 == 0 and K % 32 == 0.
void q4_tiles(Segment& g, int64_t K) {
    const int64_t groups = g.rows / 16, nb = K / QBLOCK;
    g.wt = torch::empty({groups, K / 8, 64}, torch::kUInt8);
    g.tdm = torch::empty({groups, nb, 2, 16}, torch::kFloat32);
    const uint8_t* w = g.w.data_ptr<uint8_t>();
    const at::Half* ds = g.s.data_ptr<at::Half>();
    uint8_t* wt = g.wt.data_ptr<uint8_t>();
    float* dm = g.tdm.data_ptr<float>();
    at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
        for (int64_t gi = g0; gi < g1; ++gi)
            for (int64_t r = 0; r < 16; ++r) {
                const int64_t n = gi * 16 + r;
                auto code = [&](int64_t k) {  // the row-major layout: see Segment
                    const uint8_t byte = w[n * (K / 2) + k / 32 * 16 + k % 16];
                    return k % 32 < 16 ? byte & 15 : byte >> 4;
                };
                for (int64_t j = 0; j < K / 8; ++j)
                    for (int64_t i = 0; i < 4; ++i)
                        wt[(gi * (K / 8) + j) * 64 + r * 4 + i] =
                            static_cast<uint8_t>(code(8 * j + i) | code(8 * j + 4 + i) << 4);
                for (int64_t b = 0; b < nb; ++b) {
                    dm[((gi * nb + b) * 2) * 16 + r] = static_cast<float>(ds[n * nb * 2 + b]);
                    dm[((gi * nb + b) * 2 + 1) * 16 + r] =
                        static_cast<float>(ds[n * nb * 2 + nb + b]);
                }
            }
    });
}

// MC activation rows (from m0) against one group of 16 Q4 weight rows (w: its K / 8 x 64
// bytes, dm: its d and m per block): y = sum over blocks of fma(float(I_b), d * dx_b) plus,
// apart, sum of fma(m, s_b) (s_b: the block's exact activation sum), in block order.
template <int MC>
inline void q4t_group(const uint8_t* w, const float* dm, const QuantAct& a, int64_t K,
                      int64_t m0, float* y, int64_t ldy) {
    const int64_t nb = K / QBLOCK;
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    __m512 acc[MC], macc[MC];
    for (int mc = 0; mc < MC; ++mc) acc[mc] = macc[mc] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        __m512i dot[MC], dot2[MC];  // low and high nibbles' columns: summed exactly
        for (int mc = 0; mc < MC; ++mc) dot[mc] = dot2[mc] = _mm512_setzero_si512();
        for (int64_t j = 0; j < QBLOCK / 8; ++j) {
            const __m512i v = _mm512_loadu_si512(w + (b * 4 + j) * 64);
            const __m512i lo = _mm512_and_si512(v, low4);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            for (int mc = 0; mc < MC; ++mc) {
                const int8_t* x = a.q.data() + (m0 + mc) * K + b * QBLOCK + 8 * j;
                dot[mc] = _mm512_dpbusd_epi32(dot[mc], lo, bcast32(x));
                dot2[mc] = _mm512_dpbusd_epi32(dot2[mc], hi, bcast32(x + 4));
            }
        }
        const __m512 d = _mm512_loadu_ps(dm + b * 32), m = _mm512_loadu_ps(dm + b * 32 + 16);
        for (int mc = 0; mc < MC; ++mc) {
            const __m512i dots = _mm512_add_epi32(dot[mc], dot2[mc]);
            acc[mc] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots),
                                      _mm512_mul_ps(d, _mm512_set1_ps(a.d[(m0 + mc) * nb + b])),
                                      acc[mc]);
            macc[mc] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.s[(m0 + mc) * nb + b]), macc[mc]);
        }
    }
    for (int mc = 0; mc < MC; ++mc)
        _mm512_storeu_ps(y + (m0 + mc) * ldy, _mm512_add_ps(acc[mc], macc[mc]));
}

// Y [M, ldy] columns 0 .. g.rows = X W^T for a Q4 segment with q4_tiles, on AVX512-VNNI:
// up to eight activation rows per pass over a group's codes.
void gemv_q4t(const Segment& g, int64_t K, const QuantAct& a, int64_t M, float* Y, int64_t ldy) {
    const uint8_t* wt = g.wt.data_ptr<uint8_t>();
    const float* dm = g.tdm.data_ptr<float>();
    const int64_t nb = K / QBLOCK;
    at::parallel_for(0, g.rows / 16, 4, [&](int64_t g0, int64_t g1) {
        for (int64_t gi = g0; gi < g1; ++gi) {
            const uint8_t* w = wt + gi * (K / 8) * 64;
            const float* dmg = dm + gi * nb * 32;
            float* y = Y + gi * 16;
            in_row_groups(M, [&](auto mc, int64_t m0) {
                q4t_group<decltype(mc)::value>(w, dmg, a, K, m0, y, ldy);
            });
        }
    });
}

}  // namespace
#endif
