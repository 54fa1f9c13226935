// Causal prefill attention in AMX tiles (Intel since Sapphire Rapids), in the manner of
// FlashAttention (Dao et al. 2022: online softmax over key blocks, nothing of size
// [queries, keys] written out), for head_dim 64.
//
// Work items are (chunk, KV head, up to 3 of its query heads, block of 16 queries): each
// tile of keys or values read from L2 serves the item's query heads (a 2-core Xeon, one
// head an item: 81 ms for SmolLM2's 30 layers of a 1,500-token prompt, against 67). Scores
// are computed transposed, S^T = K Q^T: the keys, as they lie in the gathered cache rows,
// are the left tile (16 keys x 32 dimensions, row stride Hkv * D), a head's 16 queries the
// right one (packed once per item into dimension pairs, the layout tdpbf16ps takes). A row
// of S^T is then one key's scores against the 16 queries: one 16-lane register, so the
// softmax's max and sum are lane-wise maxima and sums down the rows (no reduction across
// lanes), and the probabilities go into the right tile of O^T = V^T P^T as pairs of rows
// interleaved. V^T is packed once per chunk, per block of 32 keys ([Hkv][key block][D][32]:
// a tile's 16 rows are 1 KB in a row). Scores, max, sums and O are fp32; probabilities are
// bf16 when they weigh the values (as in torch's bf16 flash kernel and
// cpu_prefill_attention.cpp; here computed as bf16 bits, see MANT_FIX), and the sums add
// those values; the output is rounded to bf16 once.
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

// One item: queries q0 .. q0 + 15 of chunk c (fewer at its end) for the NH (<= 3) query
// heads h0 .. h0 + NH - 1, all of KV head g: each tile of keys and of values is loaded once
// for the NH heads (the caches are read from L2; the queries and probabilities, reloaded
// per head, from L1). Tiles: 0 .. NH - 1 the heads' accumulators, 3 .. 3 + NH - 1 their
// queries (or probabilities), 6 and 7 keys (or values); flash_amx configures them (16 rows of
// 64 bytes) once per run of items.
template <int NH>
void flash_item(const FlashChunk& c, int64_t h0, int64_t q0, int64_t Hkv, int64_t g,
                float scale) {
    constexpr int64_t D = 64;
    const int64_t ldk = Hkv * D, ctx = c.lk - c.n;
    const int64_t nq = std::min<int64_t>(16, c.n - q0), first = ctx + q0;
    const int64_t kend = std::min(c.lk, first + 16);
    const int64_t kend32 = (kend + 31) / 32 * 32;  // <= lkp: the padding rows are zeros
    alignas(64) uint16_t qt[NH][2][16][32];         // [head][dimension half][pair][query, 2]
    alignas(64) float S[NH][FLASH_SUB][16], O[NH][D][16];
    alignas(64) uint16_t pt[NH][FLASH_SB / 2][32];  // P^T: [key pair][query, 2]
    __mmask16 mk[FLASH_SUB];
    for (int64_t h = 0; h < NH; ++h)
        for (int64_t half = 0; half < 2; ++half) {  // the queries' pairs transposed
            alignas(64) float rows[16][16];
            for (int64_t i = 0; i < 16; ++i)
                std::memcpy(rows[i],
                            c.q + (q0 + std::min(i, nq - 1)) * c.ldq + (h0 + h) * D + 32 * half,
                            64);
            transpose16(rows[0], reinterpret_cast<float*>(qt[h][half][0]), 16, 16);
        }
    const __m512 sc = _mm512_set1_ps(scale * 1.44269504f);  // scores to powers of 2
    const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3F80);  // bf16 1.0: pair sums
    const __m512 sc128 = _mm512_mul_ps(sc, _mm512_set1_ps(128.f));  // to 1/128ths
    const __m512i tlo = _mm512_load_si512(MANT_FIX), thi = _mm512_load_si512(MANT_FIX + 64);
    const __m512i fix = _mm512_load_si512(PAIR_WORDS);
    __m512 m[NH], l[NH];  // m: the raw scores' reference max
    for (int h = 0; h < NH; ++h) l[h] = _mm512_setzero_ps();
#define PD_QK(H, T, HALF, KT)                                  \
    if constexpr (NH > H) {                                    \
        _tile_loadd(T, qt[H][HALF], 64);                       \
        _tile_dpbf16ps(H, KT, T);                              \
    }
    // O^T (16 dimensions at a time, each head) += V^T P^T over keys [j0, j1) (P^T rows
    // from j0 / 2 on)
    auto pv = [&](int64_t j0, int64_t j1) {
        const uint16_t* vb = c.vt + (g * (c.lkp / 32) + j0 / 32) * D * 32;
        for (int64_t db = 0; db < D / 16; ++db) {
            if (j0 == 0) {  // O's first keys: the accumulators start at 0
                _tile_zero(0);
                if constexpr (NH > 1) _tile_zero(1);
                if constexpr (NH > 2) _tile_zero(2);
            } else {
                _tile_loadd(0, O[0][16 * db], 64);
                if constexpr (NH > 1) _tile_loadd(1, O[1][16 * db], 64);
                if constexpr (NH > 2) _tile_loadd(2, O[2][16 * db], 64);
            }
            for (int64_t j = 0; j < j1 - j0; j += 32) {
                _tile_loadd(6, vb + (j / 32) * D * 32 + 16 * db * 32, 64);
#define PD_PV(H, T)                                        \
    if constexpr (NH > H) {                                \
        _tile_loadd(T, pt[H][j / 2], 64);                  \
        _tile_dpbf16ps(H, 6, T);                           \
    }
                PD_PV(0, 3) PD_PV(1, 4) PD_PV(2, 5)
            }
            _tile_stored(0, O[0][16 * db], 64);
            if constexpr (NH > 1) _tile_stored(1, O[1][16 * db], 64);
            if constexpr (NH > 2) _tile_stored(2, O[2][16 * db], 64);
        }
    };
    int64_t pv0 = 0;  // the first key whose probabilities wait in pt (at pt[..][0])
    // head h's probabilities of the block's nk keys (rows of S[h]) against m[h], as bf16
    // pairs into pt from row p0r (see MANT_FIX), their sum added to l[h]; returns the largest
    // before MANT_FIX (16-bit words: above 18,304 = 127 * 128 + 128 * LAZY_LOG2, a probability
    // passed 2^LAZY_LOG2)
    auto probs = [&](int h, int64_t nk, int64_t p0r, bool open) -> __m512i {
        const __m512 msc = _mm512_fmsub_ps(m[h], sc128, _mm512_set1_ps(16256.f));
        __m512 sum = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
        __m512i top = _mm512_setzero_si512();
        for (int64_t r = 0; r < nk; r += 2) {
            __m512 y0, y1;
            if (open) {
                y0 = _mm512_fmsub_ps(_mm512_load_ps(S[h][r]), sc128, msc);
                y1 = _mm512_fmsub_ps(_mm512_load_ps(S[h][r + 1]), sc128, msc);
            } else {
                y0 = _mm512_maskz_fmsub_ps(mk[r], _mm512_load_ps(S[h][r]), sc128, msc);
                y1 = _mm512_maskz_fmsub_ps(mk[r + 1], _mm512_load_ps(S[h][r + 1]), sc128, msc);
            }
            __m512i w = _mm512_packus_epi32(_mm512_cvtps_epi32(y0), _mm512_cvtps_epi32(y1));
            top = _mm512_max_epu16(top, w);
            w = _mm512_shuffle_epi8(w, fix);
            // MANT_FIX by each word's low byte (the high bytes' lookups zeroed)
            const __m512i pr = _mm512_sub_epi16(
                w, _mm512_maskz_permutex2var_epi8(0x5555555555555555ULL, tlo, w, thi));
            _mm512_store_si512(pt[h][p0r + r / 2], pr);
            if (r & 2) sum1 = _mm512_dpbf16_ps(sum1, (__m512bh)pr, ones);
            else sum = _mm512_dpbf16_ps(sum, (__m512bh)pr, ones);
        }
        l[h] = _mm512_add_ps(l[h], _mm512_add_ps(sum, sum1));
        return top;
    };
    // the block's max of each head's scores (keys kb0 .. kb0 + nk: rows of S) moves m where
    // it passes m by more than LAZY_LOG2 powers of 2 (m set at the first block)
    auto move_max = [&](int64_t kb0, int64_t nk, bool open) {
        __m512 mnew[NH];
        __mmask16 up[NH];
        bool any_up = false;
        for (int h = 0; h < NH; ++h) {
            mnew[h] = _mm512_set1_ps(-INFINITY);
            if (open) {  // four chains: a max's latency is 4 cycles
                __m512 m1 = mnew[h], m2 = mnew[h], m3 = mnew[h];
                for (int64_t r = 0; r < nk; r += 4) {
                    mnew[h] = _mm512_max_ps(mnew[h], _mm512_load_ps(S[h][r]));
                    m1 = _mm512_max_ps(m1, _mm512_load_ps(S[h][r + 1]));
                    m2 = _mm512_max_ps(m2, _mm512_load_ps(S[h][r + 2]));
                    m3 = _mm512_max_ps(m3, _mm512_load_ps(S[h][r + 3]));
                }
                mnew[h] = _mm512_max_ps(_mm512_max_ps(mnew[h], m1), _mm512_max_ps(m2, m3));
            } else {
                for (int64_t r = 0; r < nk; ++r)
                    mnew[h] = _mm512_mask_max_ps(mnew[h], mk[r], mnew[h],
                                                 _mm512_load_ps(S[h][r]));
            }
            if (kb0 == 0) {  // key 0 is here and every query sees it: finite
                m[h] = mnew[h];
                up[h] = 0;
            } else {  // lanes past m by more than 2^LAZY_LOG2 move it
                up[h] = _mm512_cmp_ps_mask(_mm512_mul_ps(_mm512_sub_ps(mnew[h], m[h]), sc),
                                           _mm512_set1_ps(LAZY_LOG2), _CMP_GT_OQ);
                any_up |= up[h] != 0;
            }
        }
        if (any_up) {  // the waiting probabilities weigh the values first, then O and l
            if (pv0 < kb0) pv(pv0, kb0);  // rescale
            pv0 = kb0;
            for (int h = 0; h < NH; ++h) {
                if (!up[h]) continue;
                const __m512 alpha = _mm512_mask_blend_ps(
                    up[h], _mm512_set1_ps(1.f),
                    pow2_16(_mm512_mul_ps(_mm512_sub_ps(m[h], mnew[h]), sc)));
                m[h] = _mm512_mask_mov_ps(m[h], up[h], mnew[h]);
                l[h] = _mm512_mul_ps(l[h], alpha);
                for (int64_t d = 0; d < D; ++d)
                    _mm512_store_ps(O[h][d], _mm512_mul_ps(_mm512_load_ps(O[h][d]), alpha));
            }
        }
    };
    for (int64_t kb0 = 0; kb0 < kend32; kb0 += FLASH_SUB) {
        const int64_t nk = std::min(FLASH_SUB, kend32 - kb0);
        for (int64_t r = 0; r < nk; r += 16) {  // S^T rows kb0 + r .. + 16, each head
            const uint16_t* k0 = c.k + (kb0 + r) * ldk + g * D;
            _tile_loadd(6, k0, ldk * 2);
            _tile_loadd(7, k0 + 32, ldk * 2);
            _tile_zero(0);
            if constexpr (NH > 1) _tile_zero(1);
            if constexpr (NH > 2) _tile_zero(2);
            PD_QK(0, 3, 0, 6) PD_QK(1, 4, 0, 6) PD_QK(2, 5, 0, 6)
            PD_QK(0, 3, 1, 7) PD_QK(1, 4, 1, 7) PD_QK(2, 5, 1, 7)
            _tile_stored(0, S[0][r], 64);
            if constexpr (NH > 1) _tile_stored(1, S[1][r], 64);
            if constexpr (NH > 2) _tile_stored(2, S[2][r], 64);
        }
        // every lane sees every key of the block, or masks per key
        const bool open = kb0 + nk - 1 <= first && kb0 + nk <= c.lk;
        if (!open)
            for (int64_t r = 0; r < nk; ++r) mk[r] = key_mask(kb0 + r, first, c.lk);
        // probabilities against the current max (after the first block nearly always the
        // last one: no max pass), redone after moving the max where any passes 2^LAZY_LOG2
        // (a probability past 2^(2^24), scores ~10^8 above m, would overflow vcvtps2dq to a
        // negative integer and count as 0 instead)
        bool fits = kb0 > 0;
        if (fits) {
            __m512 lsave[NH];
            __m512i top = _mm512_setzero_si512();
            for (int h = 0; h < NH; ++h) {
                lsave[h] = l[h];
                top = _mm512_max_epu16(top, probs(h, nk, (kb0 - pv0) / 2, open));
            }
            fits = !_mm512_cmpgt_epu16_mask(top, _mm512_set1_epi16(18304));
            if (!fits)
                for (int h = 0; h < NH; ++h) l[h] = lsave[h];
        }
        if (!fits) {
            move_max(kb0, nk, open);
            for (int h = 0; h < NH; ++h) probs(h, nk, (kb0 - pv0) / 2, open);
        }
        if (kb0 + nk - pv0 >= FLASH_SB || kb0 + nk >= kend32) {
            pv(pv0, kb0 + nk);
            pv0 = kb0 + nk;
        }
    }
#undef PD_QK
#undef PD_PV
    for (int h = 0; h < NH; ++h) {
        const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), l[h]);
        for (int64_t d = 0; d < D; ++d)
            _mm512_store_ps(O[h][d], _mm512_mul_ps(_mm512_load_ps(O[h][d]), inv));
        alignas(64) float rows[16][D];  // O^T -> rows of queries -> bf16 out rows
        for (int64_t b = 0; b < D / 16; ++b) transpose16(O[h][16 * b], rows[0] + 16 * b, D, 16);
        for (int64_t i = 0; i < nq; ++i) {
            uint16_t* dst = c.out + (q0 + i) * c.ldo + (h0 + h) * D;
            for (int64_t d = 0; d < D; d += 32)
                _mm512_storeu_si512(dst + d, (__m512i)_mm512_cvtne2ps_pbh(
                                                 _mm512_load_ps(rows[i] + d + 16),
                                                 _mm512_load_ps(rows[i] + d)));
        }
    }
}

void flash_amx(const std::vector<FlashChunk>& chunks, int64_t Hq, int64_t Hkv, float scale) {
    struct Item {
        int64_t cost, c, g, h0, nh, q0;
    };
    // a KV head's query heads in groups of at most 3, as even as they go (7: 3, 2, 2)
    const int64_t group = Hq / Hkv, parts = (group + 2) / 3;
    std::vector<Item> items;
    for (int64_t c = 0; c < static_cast<int64_t>(chunks.size()); ++c) {
        const FlashChunk& ch = chunks[c];
        for (int64_t q0 = 0; q0 < ch.n; q0 += 16)
            for (int64_t g = 0; g < Hkv; ++g)
                for (int64_t p = 0, h = 0; p < parts; ++p) {
                    const int64_t nh = group / parts + (p < group % parts);
                    items.push_back({std::min(ch.lk, ch.lk - ch.n + q0 + 16), c, g,
                                     g * group + h, nh, q0});
                    h += nh;
                }
    }
    // one KV head's items after another (a 3,000-token chunk's keys and values are 0.75 MB
    // a KV head: all of them thrashed a core's L2), each head's longest first
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
            if (it.nh == 3) flash_item<3>(ch, it.h0, it.q0, Hkv, it.g, scale);
            else if (it.nh == 2) flash_item<2>(ch, it.h0, it.q0, Hkv, it.g, scale);
            else flash_item<1>(ch, it.h0, it.q0, Hkv, it.g, scale);
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
        for (int64_t n = b * 32; n < (b + 1) * 32; ++n) {
            if (n < lk) std::memcpy(k + n * kv_size, krows[n], kv_size * sizeof(uint16_t));
            else std::memset(k + n * kv_size, 0, kv_size * sizeof(uint16_t));
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
            uint16_t* dst = vt + (g * (lkp / 32) + b) * 64 * 32;
            for (int64_t db = 0; db < 4; ++db)
                transpose16(reinterpret_cast<const float*>(pairs[db][0]),
                            reinterpret_cast<float*>(dst + 16 * db * 32), 16, 16);
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
    auto kp = torch::empty({lkp, Hkv, 64}, k.options());
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
