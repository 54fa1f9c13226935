// Causal prefill attention in AMX tiles (Intel since Sapphire Rapids), in the manner of
// FlashAttention (Dao et al. 2022: online softmax over key blocks, nothing of size
// [queries, keys] written out), for head_dim 64.
//
// Work items are (chunk, query head, block of 32 queries as two columns of 16): while an
// item takes scores its queries stay in four tiles and each tile of keys serves both
// columns (see flash_item). Scores are computed transposed, S^T = K Q^T: the keys are the
// left tile (16 keys x 32 dimensions, packed once per chunk per KV head and dimension half:
// a tile is 1 KB in a row), a column's 16 queries the right one (packed once per item into
// dimension pairs, the layout tdpbf16ps takes). A row of S^T is then one key's scores
// against the 16 queries: one 16-lane register, so the softmax's max and sum are lane-wise
// maxima and sums down the rows (no reduction across lanes), and the probabilities go into
// the right tile of O^T = V^T P^T as pairs of rows interleaved. V^T is packed once per
// chunk, per dimension half and block of 32 keys ([Hkv][2][key block][32][32]: a tile's 16
// rows are 1 KB in a row, and a pass over one half's values reads them in order: against
// [Hkv][key block][D][32], whose halves interleave every 2 KB, 1,496 queries after 1,504
// positions 4.11 -> 4.05 ms, 512 after 2,496 1.87 -> 1.83, a 2-core Xeon). Scores, max,
// sums and O are fp32; probabilities are bf16 when they weigh the values
// (as in torch's bf16 flash kernel and cpu_prefill_attention.cpp; here computed as bf16
// bits, see MANT_FIX), and the sums add those values; the output is rounded to bf16 once.
//
// Against the first AMX kernel (items of 16 queries for the 3 query heads of a KV head,
// each head's queries reloaded per 16 keys, keys read in place from the gathered rows):
// a 2-core Xeon, alternating builds in one process, one layer of SmolLM2 at 1,496 queries
// after 1,504 context positions 4.19 -> 3.93 ms (first 1,504 queries: 1.60 both). What is
// left is mostly the tiles' memory traffic: a microbenchmark of this kernel's pattern takes
// ~75 ns per 16 keys x 32 queries (~92 with random rather than zero data) for 8 products of
// 4.6 ns, and tile loads and stores keep the AMX and AVX-512 work of one thread from
// overlapping (4 products alone overlap the probabilities fully).
//
// Scores go FLASH_SUB keys at a time (their tiles stored, probabilities packed against the
// max so far, the block's max taken and the block redone only where one passes
// 2^LAZY_LOG2); the probabilities of up to FLASH_SB keys then weigh the values at once, O^T
// loaded into the tiles, accumulated, stored. The max moves lazily (see LAZY_LOG2). Compiled
// in the AMX build after cpu_decode.cpp (one translation unit: cpu_decode.py joins the
// files), whose helpers it uses and which declares flash_amx for the fused decoder.

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
namespace {

constexpr int64_t FLASH_SB = 256;  // keys whose probabilities weigh the values at once
constexpr int64_t FLASH_SUB = 64;  // keys whose scores are taken at once (divides FLASH_SB)

// 2^x for 16 lanes of finite x (the rescaling factors; the probabilities take MANT_FIX
// below): 2^f for f = x - floor(x) in [0, 1) (one vreduceps) by a
// degree-3 polynomial fitted for relative error (< 7.5e-5; the probabilities are rounded
// to bf16 next, 2e-3), scaled by 2^floor(x) with vscalefps, which floors x itself. A 2-core
// Xeon, SmolLM2's 30 layers of a 1,500-token prompt: 94 ms against 104 with the degree-5
// Taylor polynomial around round(x). Results below 2^-126 must be flushed, not computed:
// denormal arithmetic takes microcode assists (scores of standard deviation 30, as a model's
// attention sinks give, made a layer 30 ms, not 3.5), so flash_amx runs its items with
// MXCSR's flush-to-zero and denormals-are-zero set (one compare and mask fewer than a cut
// at -125 here).
inline __m512 pow2_16(__m512 x) {
    const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 p = _mm512_set1_ps(0.078024514f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.226067171f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.695833564f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.999925196f));
    return _mm512_scalef_ps(p, x);
}

// 2^x as bf16 for the probabilities, without a polynomial: y = 128 x + 127 * 128 rounded to
// an integer n is 2^x's bf16 bits (8 exponent bits, 7 mantissa bits) to within the
// mantissa: 2^(i / 128) for i = n mod 128 is 1 + T_i / 128 with T_i = round(128 (2^(i / 128)
// - 1)) <= i, so the bits are n - MANT_FIX[i] with MANT_FIX[i] = i - T_i (0 .. 11: no
// borrow from the exponent). One vcvtps2dq a 16 lanes, then per 32 lanes a vpackusdw (which
// also turns y < 0, 2^x below bf16's normal range, into 0), a vpshufb into the key pairs
// the value tiles take, a vpermi2b for MANT_FIX and a vpsubw: against the polynomial's
// ~13 instructions per 32 lanes, SmolLM2's 30 layers of a 3,000-token prompt 194 -> 178 ms
// (real q/k/v, alternating builds in one process). The cost: x is rounded to 1/128 first,
// so a probability is within 0.65 % of 2^x instead of bf16's rounding's 0.39 % (unbiased:
// outputs differ from a softmax in double by ~20 % more on average, 9e-5 against 7e-5 for
// unit-scale q/k/v).
alignas(64) constexpr uint8_t MANT_FIX[128] = {
    0, 0, 1, 1, 1, 1, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6,
    6, 6, 7, 7, 7, 7, 7, 8, 8, 8, 8, 8, 8, 9, 9, 9, 9, 9, 9, 9, 10, 10, 10, 10,
    10, 10, 10, 10, 10, 10, 11, 11, 11, 11, 11, 11, 11, 11, 11, 11, 11, 11, 11, 11, 11, 11, 11, 11,
    11, 11, 11, 11, 11, 11, 11, 11, 11, 11, 10, 10, 10, 10, 10, 10, 10, 10, 10, 9, 9, 9, 9, 9,
    9, 9, 8, 8, 8, 8, 8, 7, 7, 7, 7, 7, 6, 6, 6, 6, 5, 5, 5, 4, 4, 4, 3, 3,
    3, 3, 2, 2, 1, 1, 1, 0,
};
// vpackusdw(a, b) leaves words a0-3 b0-3 | a4-7 b4-7 | ... per 128-bit lane; P^T's tile rows
// want a key pair's two words per query side by side: a0 b0 a1 b1 ...
alignas(64) constexpr uint8_t PAIR_WORDS[64] = {
    0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15,
    0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15,
    0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15,
    0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15,
};

// Lanes of a row of S^T (key n) whose queries see key n: queries of the item sit at
// positions first .. first + 15; keys n >= lk are padding.
inline __mmask16 key_mask(int64_t n, int64_t first, int64_t lk) {
    if (n >= lk) return 0;
    const int64_t d = n - first;
    if (d <= 0) return 0xFFFF;
    if (d >= 16) return 0;
    return static_cast<__mmask16>(0xFFFF << d);
}


// Lazy rescaling (as FlashAttention-4 does): the max m a query's probabilities are taken
// against moves only where a block's scores pass it by more than LAZY_LOG2 powers of 2, so
// the probabilities stay at most 2^LAZY_LOG2, far inside fp32 and bf16, and O and the sum
// are rescaled only then (rarely after a prompt's first blocks): O^T accumulates straight
// through the tiles, and the probabilities waiting for the values first weigh them.
constexpr float LAZY_LOG2 = 16.f;

// One item: query head h (of KV head g) for queries q0 .. q0 + 16 NC - 1 of chunk c (fewer
// at its end), as NC (1 or 2) columns of 16 queries. While scores are taken the queries stay
// in tiles 0 .. 3 (column col's dimension halves in 2 col and 2 col + 1), each 16 keys' two
// tiles (4, 5) serve both columns, into tiles 6 and 7; while the values are weighed, tiles
// 0 .. 3 hold O^T for two blocks of 16 dimensions (block b of column col in 2 (b % 2) + col),
// 4 and 5 the columns' probabilities, 6 and 7 the two value blocks: each tile loaded serves
// two products (a 2-core Xeon, a microbenchmark of the tile patterns: scores 9.4 -> 6.6 ns
// a product against three heads of one column, each head's queries reloaded per 16 keys).
// The scores and probabilities go through L1, O^T every FLASH_SB keys. flash_amx configures
// the tiles (16 rows of 64 bytes) once per run of items.
template <int NC>
void flash_item(const FlashChunk& c, int64_t h, int64_t q0, int64_t g, float scale) {
    constexpr int64_t D = 64;
    const int64_t ctx = c.lk - c.n;
    const int64_t nq = std::min<int64_t>(16 * NC, c.n - q0), first = ctx + q0;
    const int64_t kend = std::min(c.lk, first + 16 * NC);
    const int64_t kend32 = (kend + 31) / 32 * 32;  // <= lkp: the padding rows are zeros
    alignas(64) uint16_t qt[NC][2][16][32];         // [column][dimension half][pair][query, 2]
    alignas(64) float S[NC][FLASH_SUB][16], O[NC][D][16];
    alignas(64) uint16_t pt[NC][FLASH_SB / 2][32];  // P^T: [key pair][query, 2]
    __mmask16 mk[NC][FLASH_SUB];
    for (int64_t col = 0; col < NC; ++col)
        for (int64_t half = 0; half < 2; ++half) {  // the queries' pairs transposed
            alignas(64) float rows[16][16];
            for (int64_t i = 0; i < 16; ++i)
                std::memcpy(rows[i],
                            c.q + (q0 + std::min(16 * col + i, nq - 1)) * c.ldq + h * D +
                                32 * half,
                            64);
            transpose16(rows[0], reinterpret_cast<float*>(qt[col][half][0]), 16, 16);
        }
    auto load_q = [&] {
        _tile_loadd(0, qt[0][0], 64);
        _tile_loadd(1, qt[0][1], 64);
        if constexpr (NC > 1) {
            _tile_loadd(2, qt[1][0], 64);
            _tile_loadd(3, qt[1][1], 64);
        }
    };
    load_q();
    const __m512 sc = _mm512_set1_ps(scale * 1.44269504f);  // scores to powers of 2
    const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3F80);  // bf16 1.0: pair sums
    const __m512 sc128 = _mm512_mul_ps(sc, _mm512_set1_ps(128.f));  // to 1/128ths
    const __m512i tlo = _mm512_load_si512(MANT_FIX), thi = _mm512_load_si512(MANT_FIX + 64);
    const __m512i fix = _mm512_load_si512(PAIR_WORDS);
    __m512 m[NC], l[NC];  // m: the raw scores' reference max
    for (int col = 0; col < NC; ++col) l[col] = _mm512_setzero_ps();
    // O^T (both columns) += V^T P^T over keys [j0, j1) (P^T rows from j0 / 2 on); the
    // queries go back into tiles 0 .. 3 after
    auto pv = [&](int64_t j0, int64_t j1) {
        const uint16_t* vb = c.vt + j0 / 32 * 32 * 32;
        for (int64_t dp = 0; dp < D / 32; ++dp) {
            float* o0 = O[0][32 * dp];
            float* o1 = O[NC - 1][32 * dp];
            if (j0 == 0) {  // O's first keys: the accumulators start at 0
                _tile_zero(0);
                _tile_zero(2);
                if constexpr (NC > 1) {
                    _tile_zero(1);
                    _tile_zero(3);
                }
            } else {
                _tile_loadd(0, o0, 64);
                _tile_loadd(2, o0 + 16 * 16, 64);
                if constexpr (NC > 1) {
                    _tile_loadd(1, o1, 64);
                    _tile_loadd(3, o1 + 16 * 16, 64);
                }
            }
            for (int64_t j = 0; j < j1 - j0; j += 32) {
                _tile_loadd(4, pt[0][j / 2], 64);
                if constexpr (NC > 1) _tile_loadd(5, pt[NC - 1][j / 2], 64);
                const uint16_t* v = vb + ((2 * g + dp) * (c.lkp / 32) + j / 32) * 32 * 32;
                _tile_loadd(6, v, 64);
                _tile_loadd(7, v + 16 * 32, 64);
                _tile_dpbf16ps(0, 6, 4);
                if constexpr (NC > 1) _tile_dpbf16ps(1, 6, 5);
                _tile_dpbf16ps(2, 7, 4);
                if constexpr (NC > 1) _tile_dpbf16ps(3, 7, 5);
            }
            _tile_stored(0, o0, 64);
            _tile_stored(2, o0 + 16 * 16, 64);
            if constexpr (NC > 1) {
                _tile_stored(1, o1, 64);
                _tile_stored(3, o1 + 16 * 16, 64);
            }
        }
        load_q();
    };
    int64_t pv0 = 0;  // the first key whose probabilities wait in pt (at pt[..][0])
    // column col's probabilities of the block's nk keys (rows of S[col]) against m[col], as
    // bf16 pairs into pt from row p0r (see MANT_FIX), their sum added to l[col]; returns the
    // largest before MANT_FIX (16-bit words: above 18,304 = 127 * 128 + 128 * LAZY_LOG2, a
    // probability passed 2^LAZY_LOG2)
    auto probs = [&](int col, int64_t nk, int64_t p0r, bool open) -> __m512i {
        const __m512 msc = _mm512_fmsub_ps(m[col], sc128, _mm512_set1_ps(16256.f));
        __m512 sum = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
        __m512i top = _mm512_setzero_si512();
        for (int64_t r = 0; r < nk; r += 2) {
            __m512 y0, y1;
            if (open) {
                y0 = _mm512_fmsub_ps(_mm512_load_ps(S[col][r]), sc128, msc);
                y1 = _mm512_fmsub_ps(_mm512_load_ps(S[col][r + 1]), sc128, msc);
            } else {
                y0 = _mm512_maskz_fmsub_ps(mk[col][r], _mm512_load_ps(S[col][r]), sc128, msc);
                y1 = _mm512_maskz_fmsub_ps(mk[col][r + 1], _mm512_load_ps(S[col][r + 1]), sc128,
                                           msc);
            }
            __m512i w = _mm512_packus_epi32(_mm512_cvtps_epi32(y0), _mm512_cvtps_epi32(y1));
            top = _mm512_max_epu16(top, w);
            w = _mm512_shuffle_epi8(w, fix);
            // MANT_FIX by each word's low byte (the high bytes' lookups zeroed)
            const __m512i pr = _mm512_sub_epi16(
                w, _mm512_maskz_permutex2var_epi8(0x5555555555555555ULL, tlo, w, thi));
            _mm512_store_si512(pt[col][p0r + r / 2], pr);
            if (r & 2) sum1 = _mm512_dpbf16_ps(sum1, (__m512bh)pr, ones);
            else sum = _mm512_dpbf16_ps(sum, (__m512bh)pr, ones);
        }
        l[col] = _mm512_add_ps(l[col], _mm512_add_ps(sum, sum1));
        return top;
    };
    // the block's max of each column's scores (keys kb0 .. kb0 + nk: rows of S) moves m
    // where it passes m by more than LAZY_LOG2 powers of 2 (m set at the first block)
    auto move_max = [&](int64_t kb0, int64_t nk, const bool* open) {
        __m512 mnew[NC];
        __mmask16 up[NC];
        bool any_up = false;
        for (int col = 0; col < NC; ++col) {
            mnew[col] = _mm512_set1_ps(-INFINITY);
            if (open[col]) {  // four chains: a max's latency is 4 cycles
                __m512 m1 = mnew[col], m2 = mnew[col], m3 = mnew[col];
                for (int64_t r = 0; r < nk; r += 4) {
                    mnew[col] = _mm512_max_ps(mnew[col], _mm512_load_ps(S[col][r]));
                    m1 = _mm512_max_ps(m1, _mm512_load_ps(S[col][r + 1]));
                    m2 = _mm512_max_ps(m2, _mm512_load_ps(S[col][r + 2]));
                    m3 = _mm512_max_ps(m3, _mm512_load_ps(S[col][r + 3]));
                }
                mnew[col] =
                    _mm512_max_ps(_mm512_max_ps(mnew[col], m1), _mm512_max_ps(m2, m3));
            } else {
                for (int64_t r = 0; r < nk; ++r)
                    mnew[col] = _mm512_mask_max_ps(mnew[col], mk[col][r], mnew[col],
                                                   _mm512_load_ps(S[col][r]));
            }
            if (kb0 == 0) {  // key 0 is here and every query sees it: finite
                m[col] = mnew[col];
                up[col] = 0;
            } else {  // lanes past m by more than 2^LAZY_LOG2 move it
                up[col] = _mm512_cmp_ps_mask(_mm512_mul_ps(_mm512_sub_ps(mnew[col], m[col]), sc),
                                             _mm512_set1_ps(LAZY_LOG2), _CMP_GT_OQ);
                any_up |= up[col] != 0;
            }
        }
        if (any_up) {  // the waiting probabilities weigh the values first, then O and l
            if (pv0 < kb0) pv(pv0, kb0);  // rescale
            pv0 = kb0;
            for (int col = 0; col < NC; ++col) {
                if (!up[col]) continue;
                const __m512 alpha = _mm512_mask_blend_ps(
                    up[col], _mm512_set1_ps(1.f),
                    pow2_16(_mm512_mul_ps(_mm512_sub_ps(m[col], mnew[col]), sc)));
                m[col] = _mm512_mask_mov_ps(m[col], up[col], mnew[col]);
                l[col] = _mm512_mul_ps(l[col], alpha);
                for (int64_t d = 0; d < D; ++d)
                    _mm512_store_ps(O[col][d], _mm512_mul_ps(_mm512_load_ps(O[col][d]), alpha));
            }
        }
    };
    for (int64_t kb0 = 0; kb0 < kend32; kb0 += FLASH_SUB) {
        const int64_t nk = std::min(FLASH_SUB, kend32 - kb0);
        for (int64_t r = 0; r < nk; r += 16) {  // S^T rows kb0 + r .. + 16, each column
            const uint16_t* k0 = c.k + (g * (c.lkp / 16) + (kb0 + r) / 16) * 1024;
            _tile_loadd(4, k0, 64);
            _tile_loadd(5, k0 + 512, 64);
            _tile_zero(6);
            if constexpr (NC > 1) _tile_zero(7);
            _tile_dpbf16ps(6, 4, 0);
            if constexpr (NC > 1) _tile_dpbf16ps(7, 4, 2);
            _tile_dpbf16ps(6, 5, 1);
            if constexpr (NC > 1) _tile_dpbf16ps(7, 5, 3);
            _tile_stored(6, S[0][r], 64);
            if constexpr (NC > 1) _tile_stored(7, S[NC - 1][r], 64);
        }
        // per column: every lane sees every key of the block, or masks per key
        bool open[NC];
        for (int col = 0; col < NC; ++col) {
            open[col] = kb0 + nk - 1 <= first + 16 * col && kb0 + nk <= c.lk;
            if (!open[col])
                for (int64_t r = 0; r < nk; ++r)
                    mk[col][r] = key_mask(kb0 + r, first + 16 * col, c.lk);
        }
        // probabilities against the current max (after the first block nearly always the
        // last one: no max pass), redone after moving the max where any passes 2^LAZY_LOG2
        // (a probability past 2^(2^24), scores ~10^8 above m, would overflow vcvtps2dq to a
        // negative integer and count as 0 instead)
        bool fits = kb0 > 0;
        if (fits) {
            __m512 lsave[NC];
            __m512i top = _mm512_setzero_si512();
            for (int col = 0; col < NC; ++col) {
                lsave[col] = l[col];
                top = _mm512_max_epu16(top, probs(col, nk, (kb0 - pv0) / 2, open[col]));
            }
            fits = !_mm512_cmpgt_epu16_mask(top, _mm512_set1_epi16(18304));
            if (!fits)
                for (int col = 0; col < NC; ++col) l[col] = lsave[col];
        }
        if (!fits) {
            move_max(kb0, nk, open);
            for (int col = 0; col < NC; ++col) probs(col, nk, (kb0 - pv0) / 2, open[col]);
        }
        if (kb0 + nk - pv0 >= FLASH_SB || kb0 + nk >= kend32) {
            pv(pv0, kb0 + nk);
            pv0 = kb0 + nk;
        }
    }
    for (int col = 0; col < NC; ++col) {
        const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), l[col]);
        for (int64_t d = 0; d < D; ++d)
            _mm512_store_ps(O[col][d], _mm512_mul_ps(_mm512_load_ps(O[col][d]), inv));
        alignas(64) float rows[16][D];  // O^T -> rows of queries -> bf16 out rows
        for (int64_t b = 0; b < D / 16; ++b)
            transpose16(O[col][16 * b], rows[0] + 16 * b, D, 16);
        for (int64_t i = 0; i < std::min<int64_t>(16, nq - 16 * col); ++i) {
            uint16_t* dst = c.out + (q0 + 16 * col + i) * c.ldo + h * D;
            for (int64_t d = 0; d < D; d += 32)
                _mm512_storeu_si512(dst + d, (__m512i)_mm512_cvtne2ps_pbh(
                                                 _mm512_load_ps(rows[i] + d + 16),
                                                 _mm512_load_ps(rows[i] + d)));
        }
    }
}

void flash_amx(const std::vector<FlashChunk>& chunks, int64_t Hq, int64_t Hkv, float scale) {
    struct Item {
        int64_t cost, c, g, h, nc, q0;
    };
    const int64_t group = Hq / Hkv;
    std::vector<Item> items;
    for (int64_t c = 0; c < static_cast<int64_t>(chunks.size()); ++c) {
        const FlashChunk& ch = chunks[c];
        for (int64_t q0 = 0; q0 < ch.n; q0 += 32)
            for (int64_t h = 0; h < Hq; ++h)
                items.push_back({std::min(ch.lk, ch.lk - ch.n + q0 + 32), c, h / group, h,
                                 ch.n - q0 > 16 ? 2 : 1, q0});
    }
    // one KV head's items after another (a 3,000-token chunk's keys and values are 0.75 MB
    // a KV head: all of them thrashed a core's L2), each KV head's longest first
    std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
        return a.g != b.g ? a.g < b.g : a.cost > b.cost;
    });
    dynamic_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
        const unsigned csr = _mm_getcsr();
        _mm_setcsr(csr | 0x8040);
        TileConfig cfg;  // every tile 16 x 64 bytes (flash_item)
        for (int t = 0; t < 8; ++t) {
            cfg.rows[t] = 16;
            cfg.colsb[t] = 64;
        }
        _tile_loadconfig(&cfg);
        for (int64_t i = begin; i < end; ++i) {
            const Item& it = items[i];
            const FlashChunk& ch = chunks[it.c];
            if (it.nc == 2) flash_item<2>(ch, it.h, it.q0, it.g, scale);
            else flash_item<1>(ch, it.h, it.q0, it.g, scale);
        }
        _mm_setcsr(csr);
    });
}


void pack_kv(const uint16_t* const* krows, const uint16_t* const* vrows, int64_t lk,
             int64_t lkp, int64_t kv_size, int64_t b0, int64_t b1, uint16_t* k, uint16_t* vt) {
    // V^T by pairs of keys: their rows' 16-bit lanes interleaved (one vpermt2w per 16
    // dimensions) make 32-bit lanes (key 2p, key 2p + 1) at each dimension, then 16 x 16
    // transposes of those lanes give rows of 32 keys per dimension
    alignas(64) uint16_t lo[32], hi[32];
    for (int i = 0; i < 32; ++i) {
        lo[i] = static_cast<uint16_t>((i % 2 ? 32 : 0) + i / 2);  // dims 0-15 of a and b
        hi[i] = static_cast<uint16_t>(lo[i] + 16);                // dims 16-31
    }
    const __m512i ilo = _mm512_load_si512(lo), ihi = _mm512_load_si512(hi);
    alignas(64) uint32_t pairs[4][16][16];  // [dimension block][key pair][dimension]
    for (int64_t b = b0; b < b1; ++b) {
        for (int64_t n = b * 32; n < (b + 1) * 32; ++n)  // K: [g][n / 16][half][n % 16][32]
            for (int64_t g = 0; g < kv_size / 64; ++g)
                for (int64_t h = 0; h < 2; ++h) {
                    uint16_t* dst = k + ((g * (lkp / 16) + n / 16) * 2 + h) * 512 + n % 16 * 32;
                    if (n < lk) std::memcpy(dst, krows[n] + g * 64 + h * 32, 64);
                    else std::memset(dst, 0, 64);
                }
        for (int64_t g = 0; g < kv_size / 64; ++g) {  // V^T block: [g][b][d][32 keys]
            for (int64_t p = 0; p < 16; ++p) {
                const int64_t key = b * 32 + 2 * p;
                __m512i a[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
                __m512i c[2] = {a[0], a[1]};
                if (key < lk) {
                    a[0] = _mm512_loadu_si512(vrows[key] + g * 64);
                    a[1] = _mm512_loadu_si512(vrows[key] + g * 64 + 32);
                }
                if (key + 1 < lk) {
                    c[0] = _mm512_loadu_si512(vrows[key + 1] + g * 64);
                    c[1] = _mm512_loadu_si512(vrows[key + 1] + g * 64 + 32);
                }
                for (int64_t h = 0; h < 2; ++h) {
                    _mm512_store_si512(pairs[2 * h][p], _mm512_permutex2var_epi16(a[h], ilo, c[h]));
                    _mm512_store_si512(pairs[2 * h + 1][p],
                                       _mm512_permutex2var_epi16(a[h], ihi, c[h]));
                }
            }
            for (int64_t db = 0; db < 4; ++db)  // V^T: [g][dimension half][b][32][32 keys]
                transpose16(reinterpret_cast<const float*>(pairs[db][0]),
                            reinterpret_cast<float*>(vt + ((2 * g + db / 2) * (lkp / 32) + b) *
                                                              32 * 32 + db % 2 * 16 * 32),
                            16, 16);
        }
    }
}

torch::Tensor amx_prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                    int64_t num_context, double scale) {
    TORCH_CHECK(amx_usable(), "AMX tiles are unavailable here");
    TORCH_CHECK(q.scalar_type() == torch::kBFloat16 && k.scalar_type() == torch::kBFloat16 &&
                    v.scalar_type() == torch::kBFloat16,
                "q, k and v must be bf16");
    TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && q.size(2) == 64 &&
                    k.size(2) == 64 && q.size(1) % k.size(1) == 0,
                "q [n, H, 64], k/v [lk, Hkv, 64] with H % Hkv == 0");
    const int64_t n = q.size(0), Hq = q.size(1), Hkv = k.size(1), lk = k.size(0);
    TORCH_CHECK(n >= 1 && num_context >= 0 && lk == num_context + n,
                "k/v must hold the context then the chunk");
    const int64_t kv_size = Hkv * 64, lkp = (lk + 31) / 32 * 32;
    auto qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
    auto kp = torch::empty({Hkv, lkp, 64}, k.options());  // FlashChunk::k
    auto vt = torch::empty({kv_size, lkp}, k.options());
    std::vector<const uint16_t*> krows(lk), vrows(lk);
    const auto* K = reinterpret_cast<const uint16_t*>(kc.data_ptr<at::BFloat16>());
    const auto* V = reinterpret_cast<const uint16_t*>(vc.data_ptr<at::BFloat16>());
    for (int64_t j = 0; j < lk; ++j) {
        krows[j] = K + j * kv_size;
        vrows[j] = V + j * kv_size;
    }
    at::parallel_for(0, lkp / 32, 4, [&](int64_t b0, int64_t b1) {
        pack_kv(krows.data(), vrows.data(), lk, lkp, kv_size, b0, b1,
                reinterpret_cast<uint16_t*>(kp.data_ptr<at::BFloat16>()),
                reinterpret_cast<uint16_t*>(vt.data_ptr<at::BFloat16>()));
    });
    auto out = torch::empty({n, Hq * 64}, torch::kBFloat16);
    FlashChunk c{reinterpret_cast<const uint16_t*>(qc.data_ptr<at::BFloat16>()), Hq * 64,
                 reinterpret_cast<const uint16_t*>(kp.data_ptr<at::BFloat16>()),
                 reinterpret_cast<const uint16_t*>(vt.data_ptr<at::BFloat16>()), n, lk, lkp,
                 reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), Hq * 64};
    flash_amx({c}, Hq, Hkv, static_cast<float>(scale));
    return out.view({n, Hq, 64});
}

}  // namespace
#endif
