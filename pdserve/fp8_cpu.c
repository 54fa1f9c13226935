/* FP8 e4m3 block (de)quantization of KV rows in one pass each, AVX2 + F16C.
 *
 * Bit-identical to the torch reference in pdserve/fp8.py (same operations in the same
 * fp32 order):
 *   scale = absmax / 448           (fp32 division; 1.0 where scale < FLT_MIN)
 *   code  = e4m3_rne(x * (1/scale)) (fp32 reciprocal, fp32 product, round to nearest even)
 *   x_hat = fp16bits(code) * (scale * 256)  rounded to the output dtype (nearest even)
 *
 * A "row" is one (layer, K/V, block): [block_size, num_kv_heads, head_dim] elements,
 * contiguous; one scale per (row, head). Rows are found through per-row element offsets,
 * so the same loops gather straight out of (or scatter straight into) a paged cache
 *   cache [num_layers, 2, num_cache_blocks, block_size, H, D]   row (l, kv, b) at
 *   ((l * 2 + kv) * num_cache_blocks + b) * block_size * H * D
 * without an intermediate copy. Called through ctypes, which releases the GIL.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

#define ABS_MASK 0x7fffffff
#define NONFINITE_BITS 0x7f800000
#define E4M3_NAN_FROM 0x43F00000   /* 480.0f: at or above, torch writes the NaN code */
#define E4M3_MIN_NORMAL 0x3C800000 /* 2^-6 */
#define SUBNORMAL_MAGIC 16384.0f  /* 2^14: adding it rounds to multiples of 2^-9 */
#define SUBNORMAL_MAGIC_BITS 0x46800000
#define REBIAS_AND_HALF 0xC407FFFFu /* ((7 - 127) << 23) + 0x7FFFF, mod 2^32 */

static inline float bits_to_f32(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
static inline uint32_t f32_to_bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }

/* --- scalar conversions (row tails) ----------------------------------------------- */

static inline float load1(const void *base, int64_t i, int dt) {
    if (dt == DT_F32) return ((const float *)base)[i];
    if (dt == DT_BF16) return bits_to_f32((uint32_t)((const uint16_t *)base)[i] << 16);
    return _cvtsh_ss(((const uint16_t *)base)[i]);
}

static inline uint8_t e4m3_rne(float y) {
    uint32_t bits = f32_to_bits(y), a = bits & ABS_MASK;
    uint32_t code;
    if (a >= E4M3_NAN_FROM) {
        code = 0x7f;
    } else if (a < E4M3_MIN_NORMAL) {
        code = f32_to_bits(bits_to_f32(a) + SUBNORMAL_MAGIC) - SUBNORMAL_MAGIC_BITS;
    } else {
        code = (a + REBIAS_AND_HALF + ((a >> 20) & 1)) >> 20;
    }
    return (uint8_t)(code | ((bits >> 24) & 0x80));
}

static inline float e4m3_times_2m8(uint8_t code) { /* the fp16 view: value * 2^-8 */
    uint16_t h = (uint16_t)(((int16_t)(int8_t)code << 7) & 0xBFFF);
    return _cvtsh_ss(h);
}

static inline void store1(void *base, int64_t i, float v, int dt) {
    if (dt == DT_F32) {
        ((float *)base)[i] = v;
    } else if (dt == DT_BF16) {
        uint32_t b = f32_to_bits(v);
        if ((b & ABS_MASK) > NONFINITE_BITS) {
            ((uint16_t *)base)[i] = 0x7FC0;  /* NaN, as torch writes it */
        } else {
            ((uint16_t *)base)[i] = (uint16_t)((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
        }
    } else {
        ((uint16_t *)base)[i] = _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);
    }
}

/* --- 8-lane conversions ------------------------------------------------------------ */

static inline __attribute__((always_inline)) __m256 load8(const void *base, int64_t i,
                                                            int dt) {
    if (dt == DT_F32) return _mm256_loadu_ps((const float *)base + i);
    __m128i raw = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
    if (dt == DT_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
    return _mm256_cvtph_ps(raw);
}

static inline __attribute__((always_inline)) __m256i e4m3_rne8(__m256 y) {
    const __m256i bits = _mm256_castps_si256(y);
    const __m256i a = _mm256_and_si256(bits, _mm256_set1_epi32(ABS_MASK));
    const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(bits, 24), _mm256_set1_epi32(0x80));
    const __m256i sub = _mm256_sub_epi32(
        _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a),
                                          _mm256_set1_ps(SUBNORMAL_MAGIC))),
        _mm256_set1_epi32(SUBNORMAL_MAGIC_BITS));
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, 20), _mm256_set1_epi32(1));
    const __m256i nor = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(a, _mm256_set1_epi32((int)REBIAS_AND_HALF)), odd),
        20);
    const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(E4M3_MIN_NORMAL), a);
    const __m256i is_nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(E4M3_NAN_FROM - 1));
    __m256i code = _mm256_blendv_epi8(nor, sub, is_sub);
    code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7f), is_nan);
    return _mm256_or_si256(code, sign);
}

static inline __attribute__((always_inline)) void store8(void *base, int64_t i, __m256 v,
                                                          int dt) {
    if (dt == DT_F32) {
        _mm256_storeu_ps((float *)base + i, v);
    } else if (dt == DT_F16) {
        _mm_storeu_si128((__m128i *)((uint16_t *)base + i),
                         _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    } else {
        __m256i b = _mm256_castps_si256(v);
        __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
        __m256i r = _mm256_srli_epi32(
            _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), odd), 16);
        __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(b, _mm256_set1_epi32(ABS_MASK)),
                                            _mm256_set1_epi32(NONFINITE_BITS));
        r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), is_nan);
        __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r),
                                          _mm256_extracti128_si256(r, 1));
        _mm_storeu_si128((__m128i *)((uint16_t *)base + i), packed);
    }
}

/* --- one row ----------------------------------------------------------------------- */

/* The fp32 bits of max |x| over bs segments of D elements, `stride` apart. */
static inline __attribute__((always_inline)) uint32_t absmax_bits_f32(
        const void *src, int64_t base, int64_t stride, int64_t bs, int64_t D) {
    const float *p = (const float *)src;
    __m256i vmax = _mm256_setzero_si256();
    uint32_t smax = 0;
    for (int64_t t = 0; t < bs; t++) {
        const float *row = p + base + t * stride;
        int64_t d = 0;
        for (; d + 8 <= D; d += 8) {
            __m256i b = _mm256_castps_si256(_mm256_loadu_ps(row + d));
            vmax = _mm256_max_epu32(vmax, _mm256_and_si256(b, _mm256_set1_epi32(ABS_MASK)));
        }
        for (; d < D; d++) {
            uint32_t b = f32_to_bits(row[d]) & ABS_MASK;
            smax = b > smax ? b : smax;
        }
    }
    uint32_t lanes[8];
    _mm256_storeu_si256((__m256i *)lanes, vmax);
    for (int k = 0; k < 8; k++) smax = lanes[k] > smax ? lanes[k] : smax;
    return smax;
}

/* The same for bf16/fp16, 16 lanes at a time on the 16-bit patterns (their order is the
   float order too), widened to fp32 bits at the end. */
static inline __attribute__((always_inline)) uint32_t absmax_bits_16(
        const void *src, int64_t base, int64_t stride, int64_t bs, int64_t D, int dt) {
    const uint16_t *p = (const uint16_t *)src;
    __m256i vmax = _mm256_setzero_si256();
    uint16_t smax = 0;
    for (int64_t t = 0; t < bs; t++) {
        const uint16_t *row = p + base + t * stride;
        int64_t d = 0;
        for (; d + 16 <= D; d += 16) {
            __m256i b = _mm256_loadu_si256((const __m256i *)(row + d));
            vmax = _mm256_max_epu16(vmax, _mm256_and_si256(b, _mm256_set1_epi16(0x7FFF)));
        }
        for (; d < D; d++) {
            uint16_t b = row[d] & 0x7FFF;
            smax = b > smax ? b : smax;
        }
    }
    uint16_t lanes[16];
    _mm256_storeu_si256((__m256i *)lanes, vmax);
    for (int k = 0; k < 16; k++) smax = lanes[k] > smax ? lanes[k] : smax;
    return dt == DT_BF16 ? (uint32_t)smax << 16 : f32_to_bits(_cvtsh_ss(smax));
}

/* Returns 0, or 1 if the row holds inf or NaN (then its outputs are unspecified). */
static inline __attribute__((always_inline)) int quantize_row(
        const void *src, int64_t off, int dt, int64_t bs, int64_t H, int64_t D,
        uint8_t *out, float *scales) {
    const int64_t stride = H * D;
    int has_nonfinite = 0;
    for (int64_t h = 0; h < H; h++) {
        /* absmax as integer max of |x|'s bits: the float order for finite values, and
           inf/NaN bits sort above every finite one */
        uint32_t smax = dt == DT_F32 ? absmax_bits_f32(src, off + h * D, stride, bs, D)
                                     : absmax_bits_16(src, off + h * D, stride, bs, D, dt);
        if (smax >= NONFINITE_BITS) has_nonfinite = 1;
        float scale = bits_to_f32(smax) / 448.0f;
        if (!(scale >= 1.17549435e-38f)) scale = 1.0f;  /* zeros, and 1/scale overflowing */
        scales[h] = scale;
        const float inv = 1.0f / scale;
        const __m256 vinv = _mm256_set1_ps(inv);
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for (int64_t t = 0; t < bs; t++) {
            const int64_t base = off + t * stride + h * D;
            uint8_t *o = out + t * stride + h * D;
            int64_t d = 0;
            for (; d + 32 <= D; d += 32) {
                __m256i c0 = e4m3_rne8(_mm256_mul_ps(load8(src, base + d, dt), vinv));
                __m256i c1 = e4m3_rne8(_mm256_mul_ps(load8(src, base + d + 8, dt), vinv));
                __m256i c2 = e4m3_rne8(_mm256_mul_ps(load8(src, base + d + 16, dt), vinv));
                __m256i c3 = e4m3_rne8(_mm256_mul_ps(load8(src, base + d + 24, dt), vinv));
                __m256i p = _mm256_packus_epi16(_mm256_packus_epi32(c0, c1),
                                                _mm256_packus_epi32(c2, c3));
                _mm256_storeu_si256((__m256i *)(o + d), _mm256_permutevar8x32_epi32(p, order));
            }
            for (; d < D; d++) o[d] = e4m3_rne(load1(src, base + d, dt) * inv);
        }
    }
    return has_nonfinite;
}

static inline __attribute__((always_inline)) void dequantize_row(
        const uint8_t *codes, const float *scales, int64_t bs, int64_t H, int64_t D,
        void *dst, int64_t off, int dt) {
    const int64_t stride = H * D;
    for (int64_t h = 0; h < H; h++) {
        const float s256 = scales[h] * 256.0f;
        const __m256 vs = _mm256_set1_ps(s256);
        for (int64_t t = 0; t < bs; t++) {
            const uint8_t *c = codes + t * stride + h * D;
            const int64_t base = off + t * stride + h * D;
            int64_t d = 0;
            for (; d + 8 <= D; d += 8) {
                __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(c + d)));
                b = _mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16((short)0xBFFF));
                store8(dst, base + d, _mm256_mul_ps(_mm256_cvtph_ps(b), vs), dt);
            }
            for (; d < D; d++) store1(dst, base + d, e4m3_times_2m8(c[d]) * s256, dt);
        }
    }
}

/* --- entry points (ctypes) --------------------------------------------------------- */

#define ROW_OFFSET(offsets, r, row_elems) ((offsets) ? (offsets)[r] : (r) * (row_elems))

/* src rows (dtype dt) at src_offsets[r] elements (NULL: r * row_elems) -> codes
 * [num_rows, bs, H, D] uint8 and scales [num_rows, H] fp32, both contiguous.
 * Returns the number of rows holding inf or NaN (0 when all are finite). */
int64_t pdserve_fp8_quantize_rows(const void *src, int dt, const int64_t *src_offsets,
                                  int64_t num_rows, int64_t bs, int64_t H, int64_t D,
                                  uint8_t *codes, float *scales) {
    const int64_t row_elems = bs * H * D;
    int64_t num_bad = 0;
    for (int64_t r = 0; r < num_rows; r++) {
        const int64_t off = ROW_OFFSET(src_offsets, r, row_elems);
        uint8_t *out = codes + r * row_elems;
        float *sc = scales + r * H;
        if (dt == DT_BF16) num_bad += quantize_row(src, off, DT_BF16, bs, H, D, out, sc);
        else if (dt == DT_F16) num_bad += quantize_row(src, off, DT_F16, bs, H, D, out, sc);
        else num_bad += quantize_row(src, off, DT_F32, bs, H, D, out, sc);
    }
    return num_bad;
}

/* codes [num_rows, bs, H, D] uint8 and scales [num_rows, H] fp32 (contiguous) -> dst rows
 * (dtype dt) at dst_offsets[r] elements (NULL: r * row_elems). */
void pdserve_fp8_dequantize_rows(const uint8_t *codes, const float *scales, int64_t num_rows,
                                 int64_t bs, int64_t H, int64_t D, void *dst, int dt,
                                 const int64_t *dst_offsets) {
    const int64_t row_elems = bs * H * D;
    for (int64_t r = 0; r < num_rows; r++) {
        const int64_t off = ROW_OFFSET(dst_offsets, r, row_elems);
        const uint8_t *c = codes + r * row_elems;
        const float *sc = scales + r * H;
        if (dt == DT_BF16) dequantize_row(c, sc, bs, H, D, dst, off, DT_BF16);
        else if (dt == DT_F16) dequantize_row(c, sc, bs, H, D, dst, off, DT_F16);
        else dequantize_row(c, sc, bs, H, D, dst, off, DT_F32);
    }
}
