// Causal prefill attention in AMX tiles (Intel since Sapphire Rapids), in the manner of
// FlashAttention (Dao et al. 2022: online softmax over key blocks, nothing of size
// [queries, keys] written out), for head_dim 64.
//
// Work items are (chunk, query head, block of 16 queries). Scores are computed transposed,
// S^T = K Q^T: the keys, as they lie in the gathered cache rows, are the left tile (16 keys x
// 32 dimensions, row stride Hkv * D), the item's 16 queries the right one (packed once per
// item into dimension pairs, the layout tdpbf16ps takes). A row of S^T is then one key's
// scores against the 16 queries: one 16-lane register, so the softmax's running max and sum
// are lane-wise maxima and sums down the rows (no reduction across lanes), and the
// probabilities go into the right tile of O^T = V^T P^T as pairs of rows interleaved. V^T is
// packed once per chunk, per block of 32 keys ([Hkv][key block][D][32]: a tile's 16 rows
// are 1 KB in a row). Scores, the running max/sum and O are fp32;
// probabilities are rounded to bf16 before they weigh the values (as torch's bf16 flash
// kernel and cpu_prefill_attention.cpp do); the output is rounded to bf16 once.
//
// Keys go in superblocks of FLASH_SB: their scores are stored (16 KB), the max taken, the
// probabilities packed, and O^T accumulated in four tiles over the superblock before one
// rescale of O (alpha = e^(m_old - m_new)). Compiled in the AMX build after cpu_decode.cpp
// (one translation unit: cpu_decode.py joins the files), whose helpers it uses and which
// declares flash_amx for the fused decoder.

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
namespace {

constexpr int64_t FLASH_SB = 256;  // keys per superblock (a multiple of 32)

// 2^x for 16 lanes of finite x: 2^f for f = x - floor(x) in [0, 1) (one vreduceps) by a
// degree-3 polynomial fitted for relative error (< 7.5e-5; the probabilities are rounded
// to bf16 next, 2e-3), scaled by 2^floor(x) with vscalefps, which floors x itself; 0 for
// x < -125. A 2-core Xeon, SmolLM2's 30 layers of a 1,500-token prompt: 94 ms against 104
// with the degree-5 Taylor polynomial around round(x). Without the cut, x in [-149, -126]
// gave denormal results, whose arithmetic takes microcode assists: scores of standard
// deviation 30 (a model's attention sinks span that much) made a layer 30 ms, not 3.5.
inline __m512 pow2_16(__m512 x) {
    const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-125.f), _CMP_GE_OQ);
    const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 p = _mm512_set1_ps(0.078024514f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.226067171f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.695833564f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.999925196f));
    return _mm512_maskz_scalef_ps(normal, p, x);
}

// Lanes of a row of S^T (key n) whose queries see key n: queries of the item sit at
// positions first .. first + 15; keys n >= lk are padding.
inline __mmask16 key_mask(int64_t n, int64_t first, int64_t lk) {
    if (n >= lk) return 0;
    const int64_t d = n - first;
    if (d <= 0) return 0xFFFF;
    if (d >= 16) return 0;
    return static_cast<__mmask16>(0xFFFF << d);
}

// One item: queries q0 .. q0 + 15 of chunk c (fewer at its end), query head h.
void flash_item(const FlashChunk& c, int64_t h, int64_t q0, int64_t Hkv, int64_t group,
                float scale) {
    constexpr int64_t D = 64;
    const int64_t g = h / group, ldk = Hkv * D, ctx = c.lk - c.n;
    const int64_t nq = std::min<int64_t>(16, c.n - q0), first = ctx + q0;
    const int64_t kend = std::min(c.lk, first + 16);
    const int64_t kend32 = (kend + 31) / 32 * 32;  // <= lkp: the padding rows are zeros
    alignas(64) uint16_t qt[2][16][32];             // [dimension half][pair][query, 2]
    alignas(64) float S[FLASH_SB][16], O[D][16], T[D][16];
    alignas(64) uint16_t pt[FLASH_SB / 2][32];      // P^T: [key pair][query, 2]
    __mmask16 mk[FLASH_SB];
    for (int64_t half = 0; half < 2; ++half) {  // qt[half] = the queries' pairs transposed
        alignas(64) float rows[16][16];
        for (int64_t i = 0; i < 16; ++i)
            std::memcpy(rows[i], c.q + (q0 + std::min(i, nq - 1)) * c.ldq + h * D + 32 * half, 64);
        transpose16(rows[0], reinterpret_cast<float*>(qt[half][0]), 16, 16);
    }
    std::memset(O, 0, sizeof(O));
    // interleave two rows of 16 bf16 lanes into pairs: [a0 b0 a1 b1 ...]
    alignas(64) static const uint16_t pairs[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21,
                                                   6, 22, 7, 23, 8, 24, 9, 25, 10, 26, 11, 27,
                                                   12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i interleave = _mm512_load_si512(pairs);
    const __m512 sc = _mm512_set1_ps(scale * 1.44269504f);  // scores to powers of 2
    __m512 m = _mm512_setzero_ps(), l = _mm512_setzero_ps();  // m: raw scores' running max
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
    for (int64_t kb0 = 0; kb0 < kend32; kb0 += FLASH_SB) {
        const int64_t nk = std::min(FLASH_SB, kend32 - kb0);
        // S^T rows kb0 .. kb0 + nk: tiles 0, 1 the queries; 2, 3 / 5, 6 keys; 4 / 7 scores
        _tile_loadd(0, qt[0], 64);
        _tile_loadd(1, qt[1], 64);
        for (int64_t r = 0; r < nk; r += 32) {
            const uint16_t* k0 = c.k + (kb0 + r) * ldk + g * D;
            const uint16_t* k1 = k0 + 16 * ldk;
            _tile_loadd(2, k0, ldk * 2);
            _tile_loadd(3, k0 + 32, ldk * 2);
            _tile_zero(4);
            _tile_dpbf16ps(4, 2, 0);
            _tile_dpbf16ps(4, 3, 1);
            _tile_loadd(5, k1, ldk * 2);
            _tile_loadd(6, k1 + 32, ldk * 2);
            _tile_zero(7);
            _tile_dpbf16ps(7, 5, 0);
            _tile_dpbf16ps(7, 6, 1);
            _tile_stored(4, S[r], 64);
            _tile_stored(7, S[r + 16], 64);
        }
        // every lane sees every key of the superblock, or masks per key
        const bool open = kb0 + nk - 1 <= first && kb0 + nk <= c.lk;
        __m512 mnew = kb0 ? m : _mm512_set1_ps(-INFINITY);
        if (open) {  // four chains: a max's latency is 4 cycles
            __m512 m1 = mnew, m2 = mnew, m3 = mnew;
            for (int64_t r = 0; r < nk; r += 4) {
                mnew = _mm512_max_ps(mnew, _mm512_load_ps(S[r]));
                m1 = _mm512_max_ps(m1, _mm512_load_ps(S[r + 1]));
                m2 = _mm512_max_ps(m2, _mm512_load_ps(S[r + 2]));
                m3 = _mm512_max_ps(m3, _mm512_load_ps(S[r + 3]));
            }
            mnew = _mm512_max_ps(_mm512_max_ps(mnew, m1), _mm512_max_ps(m2, m3));
        } else {
            for (int64_t r = 0; r < nk; ++r) {
                mk[r] = key_mask(kb0 + r, first, c.lk);
                mnew = _mm512_mask_max_ps(mnew, mk[r], mnew, _mm512_load_ps(S[r]));
            }
        }
        // key 0 is in the first superblock and every query sees it: mnew is finite; O and l
        // are still zero there
        const __m512 alpha = kb0 ? pow2_16(_mm512_mul_ps(_mm512_sub_ps(m, mnew), sc))
                                 : _mm512_setzero_ps();
        m = mnew;
        const __m512 msc = _mm512_mul_ps(m, sc);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t r = 0; r < nk; r += 2) {
            __m512 p0 = pow2_16(_mm512_fmsub_ps(_mm512_load_ps(S[r]), sc, msc));
            __m512 p1 = pow2_16(_mm512_fmsub_ps(_mm512_load_ps(S[r + 1]), sc, msc));
            if (!open) {
                p0 = _mm512_maskz_mov_ps(mk[r], p0);
                p1 = _mm512_maskz_mov_ps(mk[r + 1], p1);
            }
            sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
            const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);  // [p0 | p1]
            _mm512_store_si512(pt[r / 2], _mm512_permutexvar_epi16(interleave, both));
        }
        l = _mm512_fmadd_ps(l, alpha, sum);
        // O^T (4 tiles of 16 dimensions x 16 queries) += V^T P^T over the superblock
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t j = 0; j < nk; j += 32) {  // vt: [Hkv][key block][D][32 keys]
            const uint16_t* v = c.vt + (g * (c.lkp / 32) + (kb0 + j) / 32) * D * 32;
            _tile_loadd(4, pt[j / 2], 64);
            _tile_loadd(5, v, 64);
            _tile_dpbf16ps(0, 5, 4);
            _tile_loadd(6, v + 16 * 32, 64);
            _tile_dpbf16ps(1, 6, 4);
            _tile_loadd(7, v + 32 * 32, 64);
            _tile_dpbf16ps(2, 7, 4);
            _tile_loadd(5, v + 48 * 32, 64);
            _tile_dpbf16ps(3, 5, 4);
        }
        _tile_stored(0, T[0], 64);
        _tile_stored(1, T[16], 64);
        _tile_stored(2, T[32], 64);
        _tile_stored(3, T[48], 64);
        for (int64_t d = 0; d < D; ++d)
            _mm512_store_ps(O[d], _mm512_fmadd_ps(_mm512_load_ps(O[d]), alpha,
                                                  _mm512_load_ps(T[d])));
    }
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), l);
    for (int64_t d = 0; d < D; ++d)
        _mm512_store_ps(O[d], _mm512_mul_ps(_mm512_load_ps(O[d]), inv));
    alignas(64) float rows[16][D];  // O^T -> rows of queries -> bf16 out rows
    for (int64_t b = 0; b < D / 16; ++b) transpose16(O[16 * b], rows[0] + 16 * b, D, 16);
    for (int64_t i = 0; i < nq; ++i) {
        uint16_t* dst = c.out + (q0 + i) * c.ldo + h * D;
        for (int64_t d = 0; d < D; d += 32)
            _mm512_storeu_si512(dst + d, (__m512i)_mm512_cvtne2ps_pbh(
                                             _mm512_load_ps(rows[i] + d + 16),
                                             _mm512_load_ps(rows[i] + d)));
    }
}

void flash_amx(const std::vector<FlashChunk>& chunks, int64_t Hq, int64_t Hkv, float scale) {
    struct Item {
        int64_t cost, c, h, q0;
    };
    std::vector<Item> items;
    for (int64_t c = 0; c < static_cast<int64_t>(chunks.size()); ++c) {
        const FlashChunk& ch = chunks[c];
        for (int64_t q0 = 0; q0 < ch.n; q0 += 16)
            for (int64_t h = 0; h < Hq; ++h)
                items.push_back({std::min(ch.lk, ch.lk - ch.n + q0 + 16), c, h, q0});
    }
    // one KV head's items after another (a 3,000-token chunk's keys and values are 0.75 MB
    // a KV head: all of them thrashed a core's L2), each head's longest first
    const int64_t group = Hq / Hkv;
    std::stable_sort(items.begin(), items.end(), [group](const Item& a, const Item& b) {
        return a.h / group != b.h / group ? a.h / group < b.h / group : a.cost > b.cost;
    });
    dynamic_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i)
            flash_item(chunks[items[i].c], items[i].h, items[i].q0, Hkv, group, scale);
    });
}

void pack_kv(const uint16_t* const* krows, const uint16_t* const* vrows, int64_t lk,
             int64_t lkp, int64_t kv_size, int64_t b0, int64_t b1, uint16_t* k, uint16_t* vt) {
    for (int64_t b = b0; b < b1; ++b) {
        for (int64_t n = b * 32; n < (b + 1) * 32; ++n) {
            if (n < lk) std::memcpy(k + n * kv_size, krows[n], kv_size * sizeof(uint16_t));
            else std::memset(k + n * kv_size, 0, kv_size * sizeof(uint16_t));
        }
        for (int64_t g = 0; g < kv_size / 64; ++g) {  // V^T block: [g][b][d][32 keys]
            uint16_t* dst = vt + (g * (lkp / 32) + b) * 64 * 32;
            for (int64_t n = 0; n < 32; ++n) {
                const int64_t key = b * 32 + n;
                const uint16_t* src = key < lk ? vrows[key] + g * 64 : nullptr;
                for (int64_t d = 0; d < 64; ++d) dst[d * 32 + n] = src ? src[d] : 0;
            }
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
