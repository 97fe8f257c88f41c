/* GGUF block products with int8 activations on AVX2 CPUs without AVX-512 VNNI: the same
 * entry point and contract as gguf_vnni.c's (gguf_gemm_q8_groups, described in
 * gguf_kernels.py; gguf_vnni.c's gguf_gemm_q8_shards, its one-input form, calls this
 * one), built instead of it where the compiler targets AVX2, FMA and F16C but not
 * AVX-512 VNNI (Zen 2/3, Intel before Ice Lake); gguf_vnni.c then computes none.
 *
 * x is quantised to int8 per token as llama.cpp quantises it for these rows, with a float
 * scale dx = amax / 127 (rounded to nearest even): per 32 values for Q4_0 and Q8_0 (its
 * Q8_0), per 256 for the K-quants (its Q8_K), in natural order, with the sums of xq that
 * the offsets and mins multiply. From KQ_PER32_TOKENS tokens on (a prefill, a concurrent
 * decode's batches) the K-quants' too are quantised per 32, as the int8 tiles
 * (gguf_avx2_tiles.c, which gguf_kernels.py routes such calls to) quantise them: finer
 * rounding where an error reaches every later token's attention.
 *
 * The blocks' integers meet them in vpmaddubsw (unsigned weight byte times signed
 * activation byte, pairs summed to 16 bits: at most 2 * 63 * 127, no saturation) and
 * vpmaddwd (pairs to 32 bits, times the K-quants' integer group scales, or 1), so a
 * super-block's sums stay in integers and are converted to float once, times d * dx
 * (once per 32-group where x is quantised per 32). Q8_0's signed weights go through the
 * sign trick (|w| times x with w's sign). Offsets and mins are one float term per group:
 * Q4_0's 8 * d per 32 values, Q4_K/Q5_K's dmin * min per 32, Q6_K's 32 * d * scale per
 * 16, times dx * sum(xq).
 *
 * Error against float activations: at most sum_i |w_i| * dx_i / 2 per output (the
 * activations' rounding), plus float rounding: the bound gguf_vnni.c's products meet.
 * Each output is one thread's sum in a fixed order: results do not depend on the thread
 * count. Against llama.cpp's AVX2 build on its own files (2026-12-05, the Zen 3 VM,
 * docs/benchmarks.md): batch-1 decode 1.48x (Q8_0) and 1.26x (Q4_K_M). */

#include "gguf_blocks.h"

#ifdef GGUF_INT8_AVX2
#include <immintrin.h>
#include <omp.h>
#include <stdlib.h>

#include "gguf_groups.h"

/* Every block's line is prefetched this far ahead (a one-token Q8_0 product read from
 * memory went 17 -> 34 GB/s against one prefetch per four blocks; 2 and 8 KiB were
 * slower; Q4_K 23 -> 27 GB/s against none; 2026-12-05, the Zen 3 VM). */
#define PREFETCH_BYTES 4096
#define KQ_PER32_TOKENS 8 /* gguf_kernels.py's INT8_TILE_MIN_TOKENS */

/* One token's activations, quantised for one group size (32 or 256). */
typedef struct {
    int8_t *xq;  /* [k] natural order */
    float *dx;   /* [k / group] */
    float *xs16; /* [k / 16]: dx * sum of xq per 16 values */
    float *xs32; /* [k / 32]: dx * sum of xq per 32 values */
} ax_t;

/* A token's k values (row x, of x_dtype) quantised per `group` (32 or 256): one pass for
 * each group's amax, one that rounds x * (127 / amax) to nearest even (cvtps2dq in the
 * default rounding mode, as nearbyintf) 16 values at a time and sums them. */
static void quantize_groups(const void *x, int x_dtype, int64_t k, int group, ax_t *q) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t g = 0; g < k / group; ++g) {
        const int64_t g0 = g * group;
        __m256 amax = _mm256_setzero_ps();
        for (int i = 0; i < group; i += 8) amax = _mm256_max_ps(amax, _mm256_and_ps(x_load8(x, x_dtype, g0 + i), abs_mask));
        const float a = hmax8(amax), dx = a / 127.f;
        const __m256 inv = _mm256_set1_ps(a > 0.f ? 127.f / a : 0.f);
        q->dx[g] = dx;
        for (int64_t i0 = g0; i0 < g0 + group; i0 += 16) {
            const __m256i r0 = _mm256_cvtps_epi32(_mm256_mul_ps(x_load8(x, x_dtype, i0), inv));
            const __m256i r1 = _mm256_cvtps_epi32(_mm256_mul_ps(x_load8(x, x_dtype, i0 + 8), inv));
            const __m256i w16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(r0, r1), 0xd8); /* 16 in order */
            _mm_storeu_si128((__m128i *)(q->xq + i0),
                             _mm_packs_epi16(_mm256_castsi256_si128(w16), _mm256_extracti128_si256(w16, 1)));
            q->xs16[i0 / 16] = dx * (float)hsum8_epi32(_mm256_add_epi32(r0, r1));
        }
    }
    for (int64_t j = 0; j < k / 32; ++j) q->xs32[j] = q->xs16[2 * j] + q->xs16[2 * j + 1];
}

static inline __m256i load256(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
/* Eight 16-bit values e[0..8) (both 128-bit lanes of `e` hold them) -> the 16-bit lanes
 * of the result: the low 8 lanes all e[a], the high 8 all e[b]. One vpshufb, where eight
 * set1s from scalars took three instructions each. */
static inline __m256i pick16(__m256i e, int a, int b) {
    const __m256i idx = _mm256_setr_epi8(2 * a, 2 * a + 1, 2 * a, 2 * a + 1, 2 * a, 2 * a + 1, 2 * a, 2 * a + 1,
                                         2 * a, 2 * a + 1, 2 * a, 2 * a + 1, 2 * a, 2 * a + 1, 2 * a, 2 * a + 1,
                                         2 * b, 2 * b + 1, 2 * b, 2 * b + 1, 2 * b, 2 * b + 1, 2 * b, 2 * b + 1,
                                         2 * b, 2 * b + 1, 2 * b, 2 * b + 1, 2 * b, 2 * b + 1, 2 * b, 2 * b + 1);
    return _mm256_shuffle_epi8(e, idx);
}

/* A K-quant super-block's scales: e, from which k_multipliers picks the 16-bit multipliers
 * of each vector of 32 values; off16 the offsets of its 16 groups of 16 values (Q6_K: 32 d
 * scale) or 8 of 32 (Q4_K/Q5_K: dmin min); returns d. */
static inline __attribute__((always_inline)) float k_scales(int qtype, const uint8_t *b, __m256i e[2],
                                                             __m256 off16[2]) {
    if (qtype == T_Q6_K) { /* per 128 values: 8 int8 scales of 16 values each */
        const __m128i s16 = _mm_loadu_si128((const __m128i *)(b + 192));
        const float d = load_fp16(b + 208);
        for (int n = 0; n < 2; ++n) /* this half's 8 scales as 16 bits, in both lanes */
            e[n] = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(n ? _mm_srli_si128(s16, 8) : s16));
        const __m256 off = _mm256_set1_ps(32.f * d);
        off16[0] = _mm256_mul_ps(off, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s16)));
        off16[1] = _mm256_mul_ps(off, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(s16, 8))));
        return d;
    }
    /* the eight 6-bit (scale, min) pairs (scale_min_k4's rule) */
    uint32_t u0, u1, u2;
    memcpy(&u0, b + 4, 4);
    memcpy(&u1, b + 8, 4);
    memcpy(&u2, b + 12, 4);
    const uint32_t six = 0x3f3f3f3fu, lo4 = 0x0f0f0f0fu, two = 0x03030303u;
    const uint64_t scs = (uint64_t)(u0 & six) | (uint64_t)((u2 & lo4) | (((u0 >> 6) & two) << 4)) << 32;
    const uint64_t mns = (uint64_t)(u1 & six) | (uint64_t)(((u2 >> 4) & lo4) | (((u1 >> 6) & two) << 4)) << 32;
    off16[0] = _mm256_mul_ps(_mm256_set1_ps(load_fp16(b + 2)),
                             _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mns))));
    e[0] = e[1] = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)scs)));
    return load_fp16(b);
}

/* Vector v's multipliers from k_scales' e: Q6_K's two scales of 16 values, else one of 32. */
static inline __attribute__((always_inline)) __m256i k_multipliers(int qtype, const __m256i e[2], int v) {
    return qtype == T_Q6_K ? pick16(e[v / 4], 2 * (v % 4), 2 * (v % 4) + 1) : pick16(e[0], v, v);
}

/* The corrections of one token's super-block s: its group sums times the offsets. */
static inline __attribute__((always_inline)) __m256 k_correction(int qtype, const __m256 off16[2], const ax_t *a,
                                                                 int64_t s, __m256 corr) {
    if (qtype == T_Q6_K) {
        corr = _mm256_fmadd_ps(off16[0], _mm256_loadu_ps(a->xs16 + 16 * s), corr);
        return _mm256_fmadd_ps(off16[1], _mm256_loadu_ps(a->xs16 + 16 * s + 8), corr);
    }
    return _mm256_fmadd_ps(off16[0], _mm256_loadu_ps(a->xs32 + 8 * s), corr);
}

/* One K-quant row (Q4_K, Q5_K, Q6_K) times nt tokens of per-32 int8 x (from
 * KQ_PER32_TOKENS tokens), into column col of y's rows t0 .. t0 + nt - 1: each 32-group's
 * sum in float, times its own d * dx. Each super-block's eight 32-value weight vectors
 * are unpacked once and serve every token. Inlined per constant qtype and nt. */
static inline __attribute__((always_inline)) void row_k32_n(int qtype, const uint8_t *row, int64_t k, const ax_t *ax,
                                                            const int nt, const out_t *y, int64_t t0, int64_t col) {
    const int bb = block_bytes(qtype);
    /* A token's eight group products would be one chain of dependent fused multiply-adds:
     * U running sums per token break it where few tokens interleave. */
    const int U = nt == 1 ? 4 : nt < 4 ? 2 : 1;
    __m256 acc[4][MAX_TOKENS], corr[MAX_TOKENS];
    for (int t = 0; t < nt; ++t) {
        corr[t] = _mm256_setzero_ps();
        for (int u = 0; u < U; ++u) acc[u][t] = _mm256_setzero_ps();
    }
    for (int64_t s = 0; s < k / 256; ++s) {
        const uint8_t *b = row + s * bb;
        for (int off = 0; off < bb; off += 64) _mm_prefetch((const char *)b + PREFETCH_BYTES + off, _MM_HINT_T0);
        __m256i w[8], e[2]; /* weight vector v holds values [32v, 32v + 32) */
        __m256 off16[2];
        k_codes_avx2(qtype, b, w);
        const float d = k_scales(qtype, b, e, off16);
        for (int t = 0; t < nt; ++t) {
            const int8_t *xq = ax[t].xq + 256 * s;
            for (int v = 0; v < 8; ++v) {
                const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(w[v], load256((const uint8_t *)xq + 32 * v)),
                                                      k_multipliers(qtype, e, v));
                acc[v % U][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * ax[t].dx[8 * s + v]),
                                                acc[v % U][t]);
            }
            corr[t] = k_correction(qtype, off16, &ax[t], s, corr[t]);
        }
    }
    for (int t = 0; t < nt; ++t) {
        for (int u = 1; u < U; ++u) acc[0][t] = _mm256_add_ps(acc[0][t], acc[u][t]);
        out_store(y, t0 + t, col, hsum8(_mm256_sub_ps(acc[0][t], corr[t])));
    }
}

/* Weight vector v (values [32v, 32v + 32)) of a K-quant super-block, straight from its
 * bytes (k_codes_from_raw's layout, one vector: the loads hit L1 after the first). */
static inline __attribute__((always_inline)) __m256i k_code(int qtype, const uint8_t *b, int v) {
    const __m256i m4 = _mm256_set1_epi8(15);
    if (qtype == T_Q6_K) {
        static const int ql[8] = {0, 32, 0, 32, 64, 96, 64, 96};
        const int i = v % 4, n = v / 4;
        const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(load256(b + ql[v]), 4 * (i / 2)), m4);
        const __m256i top = _mm256_and_si256(_mm256_srli_epi16(load256(b + 128 + 32 * n), 2 * i), _mm256_set1_epi8(3));
        return _mm256_or_si256(lo, _mm256_slli_epi16(top, 4));
    }
    const int q5 = qtype == T_Q5_K;
    __m256i w = _mm256_and_si256(_mm256_srli_epi16(load256(b + 16 + 32 * q5 + 32 * (v / 2)), 4 * (v % 2)), m4);
    if (q5)
        w = _mm256_or_si256(w, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(load256(b + 16), v),
                                                                  _mm256_set1_epi8(1)), 4));
    return w;
}

/* One K-quant row times nt < KQ_PER32_TOKENS tokens of per-256 int8 x (a decode's few
 * tokens, an expert's share of a batch): each super-block's integer sum per token, times
 * d * dx once. Vector after vector, each unpacked as it is needed and met by every
 * token, its products added in order: few values live at once. The loop it replaced
 * (all eight vectors unpacked first, the sums left for GCC to reassociate, which spilled
 * every product) took 1.06x as long at 1 token and 1.46x at 4 (Q4_K; Q6_K 1.16x and
 * 1.37x; 2026-12-06, the Zen 3 VM), for the same outputs bit for bit. */
static inline __attribute__((always_inline)) void row_k256_n(int qtype, const uint8_t *row, int64_t k, const ax_t *ax,
                                                             const int nt, const out_t *y, int64_t t0, int64_t col) {
    const int bb = block_bytes(qtype);
    __m256 acc[MAX_TOKENS], corr[MAX_TOKENS];
    for (int t = 0; t < nt; ++t) acc[t] = corr[t] = _mm256_setzero_ps();
    for (int64_t s = 0; s < k / 256; ++s) {
        const uint8_t *b = row + s * bb;
        for (int off = 0; off < bb; off += 64) _mm_prefetch((const char *)b + PREFETCH_BYTES + off, _MM_HINT_T0);
        __m256i e[2], isum[MAX_TOKENS];
        __m256 off16[2];
        const float d = k_scales(qtype, b, e, off16);
        for (int t = 0; t < nt; ++t) isum[t] = _mm256_setzero_si256();
#pragma GCC unroll 8 /* constant shifts and shuffle controls per vector */
        for (int v = 0; v < 8; ++v) {
            const __m256i w = k_code(qtype, b, v), sc = k_multipliers(qtype, e, v);
            for (int t = 0; t < nt; ++t) {
                isum[t] = _mm256_add_epi32(
                    isum[t], _mm256_madd_epi16(
                                 _mm256_maddubs_epi16(w, load256((const uint8_t *)ax[t].xq + 256 * s + 32 * v)), sc));
                /* added here, in this order: GCC would otherwise reassociate the sums and hold
                 * all 8 nt products (spilling them) until the super-block's end */
                __asm__("" : "+x"(isum[t]));
            }
        }
        for (int t = 0; t < nt; ++t) {
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_set1_ps(d * ax[t].dx[s]), acc[t]);
            corr[t] = k_correction(qtype, off16, &ax[t], s, corr[t]);
        }
    }
    for (int t = 0; t < nt; ++t) out_store(y, t0 + t, col, hsum8(_mm256_sub_ps(acc[t], corr[t])));
}

/* Either of the above, as x was quantised. */
static inline __attribute__((always_inline)) void row_k_n(int qtype, const int per32, const uint8_t *row, int64_t k,
                                                          const ax_t *ax, const int nt, const out_t *y, int64_t t0,
                                                          int64_t col) {
    if (per32)
        row_k32_n(qtype, row, k, ax, nt, y, t0, col);
    else
        row_k256_n(qtype, row, k, ax, nt, y, t0, col);
}

/* One Q4_0 or Q8_0 row times nt tokens of per-32 int8 x: per block, the integer dot
 * product of each token, times d * dx; Q4_0's offset 8 * d * (dx * sum xq) subtracted. */
static inline __attribute__((always_inline)) void row_legacy_n(int qtype, const int per32, const uint8_t *row,
                                                               int64_t k, const ax_t *ax, const int nt, const out_t *y,
                                                               int64_t t0, int64_t col) {
    (void)per32; /* always per 32 */
    const __m256i m4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    const int bb = qtype == T_Q4_0 ? 18 : 34;
    const int U = nt == 1 ? 4 : nt < 4 ? 2 : 1; /* running sums per token: see row_k32_n */
    __m256 acc[4][MAX_TOKENS];
    float corr[MAX_TOKENS];
    for (int t = 0; t < nt; ++t) {
        for (int u = 0; u < U; ++u) acc[u][t] = _mm256_setzero_ps();
        corr[t] = 0.f;
    }
    const int64_t nb = k / 32;
    for (int64_t g0 = 0; g0 < nb; g0 += U) {
#pragma GCC unroll 4
        for (int u = 0; u < U; ++u) {
            const int64_t g = g0 + u;
            if (g >= nb) break;
            const uint8_t *b = row + g * bb;
            _mm_prefetch((const char *)b + PREFETCH_BYTES, _MM_HINT_T0);
            const float d = load_fp16(b);
            __m256i w;
            if (qtype == T_Q4_0) {
                const __m128i q = _mm_loadu_si128((const __m128i *)(b + 2));
                w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), m4);
            } else {
                w = load256(b + 2);
            }
            for (int t = 0; t < nt; ++t) {
                __m256i x = load256((const uint8_t *)ax[t].xq + 32 * g), p;
                if (qtype == T_Q4_0) {
                    p = _mm256_maddubs_epi16(w, x);
                    corr[t] += 8.f * d * ax[t].xs32[g];
                } else { /* |w| times x with w's sign */
                    p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
                }
                acc[u][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones)),
                                            _mm256_set1_ps(d * ax[t].dx[g]), acc[u][t]);
            }
        }
    }
    for (int t = 0; t < nt; ++t) {
        for (int u = 1; u < U; ++u) acc[0][t] = _mm256_add_ps(acc[0][t], acc[u][t]);
        out_store(y, t0 + t, col, hsum8(acc[0][t]) - corr[t]);
    }
}

/* Rows [r0, r1) of one shard (row r at w + r * row_bytes, its outputs column c0 + r of
 * y's rows t0 .. t0 + nt - 1) times nt tokens: one loop compiled per type and count. */
#define ROWS(call) for (int64_t r = r0; r < r1; ++r) call; break;
#define CASE(fn, qt, p, n) case n: ROWS(fn(qt, p, w + r * row_bytes, k, ax, n, y, t0, c0 + r))
#define COUNTS(fn, qt, p) \
    switch (nt) { CASE(fn, qt, p, 1) CASE(fn, qt, p, 2) CASE(fn, qt, p, 3) CASE(fn, qt, p, 4) CASE(fn, qt, p, 5) \
                  CASE(fn, qt, p, 6) CASE(fn, qt, p, 7) CASE(fn, qt, p, 8) }
#define TYPE(fn, qt) \
    case qt: if (per32) { COUNTS(fn, qt, 1) } else { COUNTS(fn, qt, 0) } break;

static void rows_times_ax(int qtype, int per32, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1,
                          int64_t k, const ax_t *ax, int nt, const out_t *y, int64_t t0, int64_t c0) {
    switch (qtype) {
    TYPE(row_k_n, T_Q4_K)
    TYPE(row_k_n, T_Q5_K)
    TYPE(row_k_n, T_Q6_K)
    case T_Q4_0: COUNTS(row_legacy_n, T_Q4_0, 1) break;
    case T_Q8_0: COUNTS(row_legacy_n, T_Q8_0, 1) break;
    }
}
#undef TYPE
#undef COUNTS
#undef CASE
#undef ROWS

/* See gguf_vnni.c's gguf_gemm_q8_groups: the same contract; -2 is never returned here.
 * The K-quants' activations are quantised per 256 values for a group of fewer than
 * KQ_PER32_TOKENS tokens (decode), per 32 from there on (prefill, batches), as the int8
 * tiles (gguf_avx2_tiles.c) quantise them. */
int gguf_gemm_q8_groups(int n, const int *qtypes, const uint8_t *const *w, const int64_t *rows,
                        const int64_t *row_bytes, int64_t k, const void *const *x, const int64_t *m, int x_dtype,
                        int64_t ldx, void *const *y, int y_dtype, int64_t ldy, int num_threads) {
    for (int i = 0; i < n; ++i)
        if (block_bytes(qtypes[i]) == 0) return -1;
    if (x_dtype < 0 || x_dtype > 2 || y_dtype < 0 || y_dtype > 2) return -1;
    if (n <= 0) return 0;
    const size_t per_token = (size_t)k + ((size_t)k / 32 + (size_t)k / 16 + (size_t)k / 32) * sizeof(float);
    int64_t *slot = malloc(2 * sizeof(int64_t) * (size_t)n + 2 * sizeof(int) * (size_t)n);
    if (!slot) return -3;
    int64_t *work = slot + n; /* where each group's work starts */
    int *group = (int *)(work + n), *owner = group + n; /* group[i]: 32 or 256 values a scale */
    int64_t total = 0, rows_total = 0;
    for (int i = 0; i < n; ++i) {
        group[i] = block_size(qtypes[i]) == 256 && m[i] < KQ_PER32_TOKENS ? 256 : 32;
        work[i] = total;
        total += rows[i] * group_row_cost(m[i]);
        rows_total += rows[i];
    }
    const int64_t slots = group_slots(n, x, m, group, slot, owner);
    uint8_t *scratch = malloc(per_token * (size_t)slots + 64);
    ax_t *ax = malloc(sizeof(ax_t) * (size_t)(slots ? slots : 1));
    if (!scratch || !ax) {
        free(scratch);
        free(ax);
        free(slot);
        return -3;
    }
    const size_t x_bytes = x_dtype == 0 ? sizeof(float) : sizeof(uint16_t);
    for (int i = 0; i < n; ++i) {
        if (!owner[i]) continue;
        for (int64_t t = 0; t < m[i]; ++t) {
            uint8_t *base = scratch + (size_t)(slot[i] + t) * per_token;
            float *f = (float *)(base + k); /* k is a multiple of 32: aligned enough for floats */
            ax[slot[i] + t] = (ax_t){(int8_t *)base, f, f + k / 32, f + k / 32 + k / 16};
            quantize_groups((const uint8_t *)x[i] + (size_t)(t * ldx) * x_bytes, x_dtype, k, group[i],
                            &ax[slot[i] + t]);
        }
    }
#pragma omp parallel num_threads(num_threads) if (rows_total * k >= (1 << 15))
    {
        const int64_t nth = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t w0 = total * id / nth, w1 = total * (id + 1) / nth;
        for (int i = 0; i < n; ++i) {
            int64_t r0, r1;
            group_rows(w0, w1, work[i], group_row_cost(m[i]), rows[i], &r0, &r1);
            const out_t out = {y[i], y_dtype, ldy};
            for (int64_t t0 = 0; t0 < m[i] && r0 < r1; t0 += MAX_TOKENS)
                rows_times_ax(qtypes[i], group[i] == 32, w[i], row_bytes[i], r0, r1, k, ax + slot[i] + t0,
                              (int)(m[i] - t0 < MAX_TOKENS ? m[i] - t0 : MAX_TOKENS), &out, t0, 0);
        }
    }
    free(scratch);
    free(ax);
    free(slot);
    return 0;
}
#endif
