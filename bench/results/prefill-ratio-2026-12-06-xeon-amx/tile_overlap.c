// Microbenchmarks of the AMX prefill attention kernel's instruction patterns (one core):
// tile products (tdpbf16ps), tile loads and stores, and the AVX-512 probabilities of
// cpu_amx_attention.cpp, alone and interleaved in program order. Times per 16 keys x 32
// queries (the kernel's unit: 8 tile products, 16 pairs of score rows). Random bf16 data
// (RND=1; zeros flatter the tile unit by ~20 %). Not part of the build: the eighteenth
// session's evidence for README "Speed on CPU".
//
//   gcc -O2 -march=sapphirerapids tile_overlap.c -o tile_overlap
//   RND=1 taskset -c 1 ./tile_overlap
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    uint8_t palette, start, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define R 200000
#define NS 6144  // rows of 64 B in each K/V window: 384 KB, L2
__attribute__((aligned(64))) static float S[64][16], S2[2][2][64][16], O[2][64][16];
__attribute__((aligned(64))) static uint16_t pt[64][32], pts[4][2][32][32], qt[4][16][32];
__attribute__((aligned(64))) static uint16_t big[2 * NS + 4096][32];
__attribute__((aligned(64))) static uint8_t fixb[64], lut[128];
static __m512 sc128, msc, sum, sum1;
static __m512i top, tlo, thi, fix;
static __m512bh ones;
static float (*SR)[16] = S;

// two rows of scores -> bf16 probabilities (the kernel's probs loop body)
#define PAIR(r)                                                                            \
    {                                                                                      \
        __m512 y0 = _mm512_fmsub_ps(_mm512_load_ps(SR[r]), sc128, msc);                    \
        __m512 y1 = _mm512_fmsub_ps(_mm512_load_ps(SR[r + 1]), sc128, msc);                \
        __m512i w = _mm512_packus_epi32(_mm512_cvtps_epi32(y0), _mm512_cvtps_epi32(y1));   \
        top = _mm512_max_epu16(top, w);                                                    \
        w = _mm512_shuffle_epi8(w, fix);                                                   \
        __m512i pr = _mm512_sub_epi16(                                                     \
            w, _mm512_maskz_permutex2var_epi8(0x5555555555555555ULL, tlo, w, thi));        \
        _mm512_store_si512(pt[(r) / 2], pr);                                               \
        if ((r) & 2) sum1 = _mm512_dpbf16_ps(sum1, (__m512bh)pr, ones);                    \
        else sum = _mm512_dpbf16_ps(sum, (__m512bh)pr, ones);                              \
    }
#define FOUR(r) PAIR(r) PAIR(r + 2) PAIR(r + 4) PAIR(r + 6)
#define EIGHT(r) FOUR(r) FOUR(r + 8)
#define P(a, b, c) _tile_dpbf16ps(a, b, c)
// one 16-key step of scores (queries resident in tiles 0-3), and its stores
#define QK(k) _tile_zero(6); _tile_zero(7); _tile_loadd(4, k, 64); _tile_loadd(5, (k) + 512, 64); \
    P(6, 4, 0); P(7, 4, 2); P(6, 5, 1); P(7, 5, 3);
#define QKST(s) _tile_stored(6, (s)[0], 64); _tile_stored(7, (s)[16], 64);
// one 32-key step of value products (O^T of one dimension half in tiles 0-3)
#define PV(p, v) _tile_loadd(4, (p)[0], 64); _tile_loadd(5, (p)[32], 64); _tile_loadd(6, v, 64); \
    _tile_loadd(7, (v) + 512, 64); P(0, 6, 4); P(1, 6, 5); P(2, 7, 4); P(3, 7, 5);
#define OLD(dp) _tile_loadd(0, O[0][32 * dp], 64); _tile_loadd(2, O[0][32 * dp + 16], 64); \
    _tile_loadd(1, O[1][32 * dp], 64); _tile_loadd(3, O[1][32 * dp + 16], 64);
#define OST(dp) _tile_stored(0, O[0][32 * dp], 64); _tile_stored(2, O[0][32 * dp + 16], 64); \
    _tile_stored(1, O[1][32 * dp], 64); _tile_stored(3, O[1][32 * dp + 16], 64);
#define QLD _tile_loadd(0, qt[0], 64); _tile_loadd(1, qt[1], 64); _tile_loadd(2, qt[2], 64); \
    _tile_loadd(3, qt[3], 64);
#define TIME(name, units, body)                                                           \
    {                                                                                      \
        double best = 1e9;                                                                 \
        for (int o = 0; o < 3; ++o) {                                                      \
            long off = 0;                                                                  \
            double t = now();                                                              \
            for (int i = 0; i < R / (units); ++i) {                                        \
                uint16_t* k = big[off];                                                    \
                uint16_t* v = big[NS + off];                                               \
                off = (off + 128) % NS;                                                    \
                body __asm__ volatile("" ::: "memory");  /* nothing hoisted across */     \
            }                                                                              \
            double dt = (now() - t) / R * 1e9;                                             \
            if (dt < best) best = dt;                                                      \
        }                                                                                  \
        printf("%-58s %6.1f ns\n", name, best);                                            \
    }

static uint16_t rnd_bf16(void) {
    float f = (rand() / (float)RAND_MAX - 0.5f) * 3.f;
    uint32_t u;
    memcpy(&u, &f, 4);
    return u >> 16;
}

int main(void) {
    syscall(SYS_arch_prctl, 0x1023, 18);  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; ++i) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = 16;
    }
    _tile_loadconfig(&cfg);
    if (getenv("RND")) {
        srand(1);
        for (size_t i = 0; i < sizeof big / 2; ++i) ((uint16_t*)big)[i] = rnd_bf16();
        for (size_t i = 0; i < sizeof qt / 2; ++i) ((uint16_t*)qt)[i] = rnd_bf16();
        for (size_t i = 0; i < sizeof pts / 2; ++i) ((uint16_t*)pts)[i] = rnd_bf16();
    }
    for (int i = 0; i < 64 * 16; ++i) ((float*)S)[i] = (i % 37) * 0.01f;
    sc128 = _mm512_set1_ps(1.3f);
    msc = _mm512_set1_ps(-16000.f);
    tlo = _mm512_load_si512(lut);
    thi = _mm512_load_si512(lut + 64);
    fix = _mm512_load_si512(fixb);
    ones = (__m512bh)_mm512_set1_epi16(0x3F80);
    sum = sum1 = _mm512_setzero_ps();
    top = _mm512_setzero_si512();
    QLD _tile_loadd(4, pts[0][0], 64); _tile_loadd(5, pts[0][1], 64);
    _tile_loadd(6, big[0], 64); _tile_loadd(7, big[16], 64);

    TIME("8 tile products (operands resident)", 1,
         P(0, 6, 4); P(1, 6, 5); P(2, 7, 4); P(3, 7, 5); P(0, 6, 4); P(1, 6, 5); P(2, 7, 4);
         P(3, 7, 5);)
    TIME("16 pairs of probabilities", 1, EIGHT(0) EIGHT(16))
    TIME("both, a product after each of the first 8 pairs", 1,
         PAIR(0) P(0, 6, 4); PAIR(2) P(1, 6, 5); PAIR(4) P(2, 7, 4); PAIR(6) P(3, 7, 5);
         PAIR(8) P(0, 6, 4); PAIR(10) P(1, 6, 5); PAIR(12) P(2, 7, 4); PAIR(14) P(3, 7, 5);
         EIGHT(16))
    TIME("8 products with their loads, then the 16 pairs", 1,
         PV(pts[0][0], k) PV(pts[1][0], k + 1024) EIGHT(0) EIGHT(16))
    TIME("16 pairs + 1 tile store (data ready long before)", 1,
         EIGHT(0) _tile_stored(6, S2[0][0][0], 64); EIGHT(16))
    TIME("16 pairs + 4 tile stores", 1,
         EIGHT(0) _tile_stored(6, S2[0][0][0], 64); _tile_stored(7, S2[0][0][16], 64);
         EIGHT(16) _tile_stored(6, S2[0][1][0], 64); _tile_stored(7, S2[0][1][16], 64);)
    // per 64-key block (4 units): the current kernel's order and the interleaved ones
    TIME("blocks, no stores: scores/pairs then values/pairs", 4,
         QLD QK(k) EIGHT(0) QK(k + 1024) EIGHT(16) QK(k + 2048) EIGHT(32) QK(k + 3072) EIGHT(48)
         PV(pts[0][0], v) EIGHT(0) PV(pts[0][0] + 512, v + 1024) EIGHT(16)
         PV(pts[1][0], v + 2048) EIGHT(32) PV(pts[1][0] + 512, v + 3072) EIGHT(48))
    TIME("the same with the score stores", 4,
         QLD QK(k) EIGHT(0) QKST(S2[1][0]) QK(k + 1024) EIGHT(16) QKST(S2[1][0] + 16)
         QK(k + 2048) EIGHT(32) QKST(S2[1][0] + 32) QK(k + 3072) EIGHT(48) QKST(S2[1][0] + 48)
         PV(pts[0][0], v) EIGHT(0) PV(pts[0][0] + 512, v + 1024) EIGHT(16)
         PV(pts[1][0], v + 2048) EIGHT(32) PV(pts[1][0] + 512, v + 3072) EIGHT(48))
    TIME("the same with O^T loaded and stored every block", 4,
         QLD QK(k) EIGHT(0) QKST(S2[1][0]) QK(k + 1024) EIGHT(16) QKST(S2[1][0] + 16)
         QK(k + 2048) EIGHT(32) QKST(S2[1][0] + 32) QK(k + 3072) EIGHT(48) QKST(S2[1][0] + 48)
         OLD(0) PV(pts[0][0], v) EIGHT(0) PV(pts[0][0] + 512, v + 1024) EIGHT(16) OST(0)
         OLD(1) PV(pts[1][0], v + 2048) EIGHT(32) PV(pts[1][0] + 512, v + 3072) EIGHT(48) OST(1))
    TIME("the current kernel's phases (scores, pairs, values; 256 keys)", 16,
         QLD QK(k) QKST(S2[1][0]) QK(k + 1024) QKST(S2[1][0] + 16) QK(k + 2048)
         QKST(S2[1][0] + 32) QK(k + 3072) QKST(S2[1][0] + 48) EIGHT(0) EIGHT(16) EIGHT(32)
         EIGHT(48) EIGHT(0) EIGHT(16) EIGHT(32) EIGHT(48)
         QK(k + 4096) QKST(S2[1][0]) QK(k + 5120) QKST(S2[1][0] + 16) QK(k + 6144)
         QKST(S2[1][0] + 32) QK(k + 7168) QKST(S2[1][0] + 48) EIGHT(0) EIGHT(16) EIGHT(32)
         EIGHT(48) EIGHT(0) EIGHT(16) EIGHT(32) EIGHT(48)
         QK(k + 8192) QKST(S2[1][0]) QK(k + 9216) QKST(S2[1][0] + 16) QK(k + 10240)
         QKST(S2[1][0] + 32) QK(k + 11264) QKST(S2[1][0] + 48) EIGHT(0) EIGHT(16) EIGHT(32)
         EIGHT(48) EIGHT(0) EIGHT(16) EIGHT(32) EIGHT(48)
         QK(k + 12288) QKST(S2[1][0]) QK(k + 13312) QKST(S2[1][0] + 16) QK(k + 14336)
         QKST(S2[1][0] + 32) QK(k + 15360) QKST(S2[1][0] + 48) EIGHT(0) EIGHT(16) EIGHT(32)
         EIGHT(48) EIGHT(0) EIGHT(16) EIGHT(32) EIGHT(48)
         OLD(0) PV(pts[0][0], v) PV(pts[0][0] + 512, v + 1024) PV(pts[1][0], v + 2048)
         PV(pts[1][0] + 512, v + 3072) PV(pts[2][0], v + 4096) PV(pts[2][0] + 512, v + 5120)
         PV(pts[3][0], v + 6144) PV(pts[3][0] + 512, v + 7168) OST(0)
         OLD(1) PV(pts[0][0], v + 8192) PV(pts[0][0] + 512, v + 9216) PV(pts[1][0], v + 10240)
         PV(pts[1][0] + 512, v + 11264) PV(pts[2][0], v + 12288) PV(pts[2][0] + 512, v + 13312)
         PV(pts[3][0], v + 14336) PV(pts[3][0] + 512, v + 15360) OST(1))
    float o[16];
    _mm512_storeu_ps(o, _mm512_add_ps(sum, sum1));
    printf("(checksum %g %d)\n", o[0], pt[3][5]);
    return 0;
}
