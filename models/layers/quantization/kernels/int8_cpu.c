/* W8A8's per-token steps around the int8 GEMM, each one pass over its rows: the
 * activations' dynamic per-token quantisation, and the int32 sums scaled into the
 * output; and the GEMM itself (int8_gemm_s32, exact int32 sums) on AVX2 CPUs, where
 * torch's has no int8 kernel, and on AVX-512 VNNI ones for the few-token products. The
 * contract (dtypes, strides, who calls) is in int8_gemm.py, which compiles this file and
 * is its only caller. The two passes compute what the torch expressions there compute,
 * operation for operation (a division, not a multiplication by the inverse;
 * products in the same order, never fused: -ffp-contract=off), so the results are the
 * same bits; the rounding is nearbyintf's under the default mode (half to even, as
 * torch.round), and bfloat16 outputs round to nearest even, as torch converts. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "../../../../distributed/bf16_convert.h"

#define INT8_MAX_F 127.f
#define MIN_SCALE 1e-12f

static inline float load_x(const void *x, int bf16, int64_t i) {
    return bf16 ? bf16_to_float(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
/* 16 values from float32 or bfloat16 (exact), past n zeros */
static inline __m512 load16(const void *x, int bf16, int64_t i, int64_t n) {
    const __mmask16 mask = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
    if (!bf16) return _mm512_maskz_loadu_ps(mask, (const float *)x + i);
    const __m256i h = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)x + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* bfloat16 of 16 floats, rounded to nearest even; a NaN becomes 0x7fc0 (float_to_bf16's
 * rule, torch's) */
static inline __m256i to_bf16x16(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i one = _mm512_set1_epi32(1);
    __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                        _mm512_and_si512(_mm512_srli_epi32(bits, 16), one)));
    r = _mm512_srli_epi32(r, 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(r);
}
#endif

/* One row: its scale, and its values quantised (see int8_quantize_per_token). */
static void quantize_row(const void *x, int bf16, int64_t off, int64_t k, int8_t *q, float *scale) {
    float amax = 0.f;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    __m512 vmax = _mm512_setzero_ps();
    for (int64_t j = 0; j < k; j += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(load16(x, bf16, off + j, k - j)));
    amax = _mm512_reduce_max_ps(vmax);
#else
    for (int64_t j = 0; j < k; ++j) amax = fmaxf(amax, fabsf(load_x(x, bf16, off + j)));
#endif
    const float s = fmaxf(amax / INT8_MAX_F, MIN_SCALE);
    *scale = s;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512 vs = _mm512_set1_ps(s), lo = _mm512_set1_ps(-INT8_MAX_F), hi = _mm512_set1_ps(INT8_MAX_F);
    for (int64_t j = 0; j < k; j += 16) {
        const __m512 v = _mm512_roundscale_ps(_mm512_div_ps(load16(x, bf16, off + j, k - j), vs),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m128i b = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(v, lo), hi)));
        const int64_t n = k - j;
        _mm_mask_storeu_epi8(q + j, n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u), b);
    }
#else
    for (int64_t j = 0; j < k; ++j)
        q[j] = (int8_t)fminf(fmaxf(nearbyintf(load_x(x, bf16, off + j) / s), -INT8_MAX_F), INT8_MAX_F);
#endif
}

/* xq [m, k] (contiguous) and scale [m] of x [m, k] (float32, or bfloat16 with `bf16`;
 * row stride ldx): scale = max(max|x| / 127, 1e-12), xq = clamp(round(x / scale)). */
void int8_quantize_per_token(const void *x, int bf16, int64_t ldx, int64_t m, int64_t k, int8_t *xq, float *scale,
                             int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (m * k >= (1 << 16))
    for (int64_t i = 0; i < m; ++i) quantize_row(x, bf16, i * ldx, k, xq + i * k, scale + i);
}

/* out[i, j] = (float)acc[i, j] * x_scale[i] * w_scale[j] (+ bias[j]), in float32 or,
 * with `bf16`, bfloat16; acc [m, n] int32 with row stride lda, out row stride ldo. */
void int8_scale_output(const int32_t *acc, int64_t lda, int64_t m, int64_t n, const float *x_scale,
                       const float *w_scale, const float *bias, void *out, int bf16, int64_t ldo, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (m * n >= (1 << 16))
    for (int64_t i = 0; i < m; ++i) {
        int64_t j = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        const __m512 xs = _mm512_set1_ps(x_scale[i]);
        for (; j + 16 <= n; j += 16) {
            __m512 y = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(acc + i * lda + j)), xs);
            y = _mm512_mul_ps(y, _mm512_loadu_ps(w_scale + j));
            if (bias) y = _mm512_add_ps(y, _mm512_loadu_ps(bias + j));
            if (bf16)
                _mm256_storeu_si256((__m256i *)((uint16_t *)out + i * ldo + j), to_bf16x16(y));
            else
                _mm512_storeu_ps((float *)out + i * ldo + j, y);
        }
#endif
        for (; j < n; ++j) {
            float y = (float)acc[i * lda + j] * x_scale[i];
            y = y * w_scale[j];
            if (bias) y = y + bias[j];
            if (bf16)
                ((uint16_t *)out)[i * ldo + j] = float_to_bf16(y);
            else
                ((float *)out)[i * ldo + j] = y;
        }
    }
}

#if defined(__AVX2__)
#include <immintrin.h>
#include <stdlib.h>

#define GEMM_ROWS 4         /* weight rows per register block */
#define GEMM_TOKENS 2       /* tokens per register block */
#define GEMM_CHUNK_BYTES (128 << 10) /* widened activations per pass over the weight: L2 */

/* acc[t][j] for rows j0 .. j0 + rb - 1 and tokens t0 .. t0 + tb - 1 (rb <= 4, tb <= 2; x's
 * and w's rows ldx and ldw apart): 16 values of k at a time, each row's int8 widened to 16
 * bits and met by each token's (widened once per call) in vpmaddwd, 32-bit sums; the
 * k % 16 tail in scalars. Inlined with constant rb and tb for full blocks, so that the 8
 * sums are registers. */
static inline __attribute__((always_inline)) void gemm_block(const int rb, const int tb, const int16_t *x16,
                                                              int64_t kp, const int8_t *x, int64_t ldx, const int8_t *w,
                                                              int64_t ldw, int64_t k, int64_t j0, int64_t t0,
                                                              int32_t *acc, int64_t lda) {
    __m256i a[GEMM_ROWS][GEMM_TOKENS];
    for (int r = 0; r < rb; ++r)
        for (int t = 0; t < tb; ++t) a[r][t] = _mm256_setzero_si256();
    const int64_t k16 = k & ~(int64_t)15;
    for (int64_t kk = 0; kk < k16; kk += 16) {
        __m256i xv[GEMM_TOKENS];
        for (int t = 0; t < tb; ++t) xv[t] = _mm256_loadu_si256((const __m256i *)(x16 + (t0 + t) * kp + kk));
        for (int r = 0; r < rb; ++r) {
            const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + (j0 + r) * ldw + kk)));
            for (int t = 0; t < tb; ++t) a[r][t] = _mm256_add_epi32(a[r][t], _mm256_madd_epi16(wv, xv[t]));
        }
    }
    for (int r = 0; r < rb; ++r)
        for (int t = 0; t < tb; ++t) {
            __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a[r][t]), _mm256_extracti128_si256(a[r][t], 1));
            s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
            s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
            int32_t sum = _mm_cvtsi128_si32(s);
            for (int64_t kk = k16; kk < k; ++kk) sum += (int32_t)w[(j0 + r) * ldw + kk] * (int32_t)x[(t0 + t) * ldx + kk];
            acc[(t0 + t) * lda + j0 + r] = sum;
        }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define INT8_GEMM_VNNI 1
#include "../../tile_sum.h"
#define VNNI_ROWS 4   /* weight rows per register tile */
#define VNNI_TOKENS 4 /* tokens per register tile: 16 accumulators and 8 operands */
/* The weight rows a tile asks for ahead of its own, in bytes: a tile of a few tokens
 * streams its 4 rows faster than the hardware prefetchers fetch them (a W8A8 experts
 * step of 8 tokens from memory, 2026-12-07, the Zen 4 VM: 2.4-2.5 ms a layer without,
 * 1.5-1.6 with; see docs/benchmarks.md). */
#define PREFETCH_BYTES (64 << 10)

/* The 16 int32 totals of a[r][t] (r, t < 4) in one vector, lane 4t + r (tile_sum.h). */
static inline __m512i sum_tile(__m512i a[VNNI_ROWS][VNNI_TOKENS]) {
    __m512 v[VNNI_ROWS][VNNI_TOKENS];
    for (int r = 0; r < VNNI_ROWS; r++)
        for (int t = 0; t < VNNI_TOKENS; t++) v[r][t] = _mm512_castsi512_ps(a[r][t]);
    return _mm512_castps_si512(tile_sum16(v, 1));
}

/* acc for rows j0 .. j0 + rb - 1 and tokens t0 .. t0 + tb - 1 (rb, tb <= 4): 64 values of
 * k a step, each weight vector made unsigned for vpdpbusd (w + 128: its sign bits
 * flipped) and met by every token's int8 vector, then 128 * sum(x) (xsum) taken off. The
 * k % 64 tail is read through a mask (zeros on both sides). Inlined with constant rb and
 * tb, so that the sums are registers. */
static inline __attribute__((always_inline)) void vnni_block(const int rb, const int tb, const int8_t *x, int64_t ldx,
                                                              const int32_t *xsum, const int8_t *w, int64_t ldw,
                                                              int64_t k, int64_t j0, int64_t t0, int32_t *acc,
                                                              int64_t lda) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const int64_t ahead = (PREFETCH_BYTES / ldw + VNNI_ROWS) & ~(int64_t)(VNNI_ROWS - 1); /* rows, >= one tile */
    __m512i a[VNNI_ROWS][VNNI_TOKENS];
    for (int r = 0; r < VNNI_ROWS; ++r)
        for (int t = 0; t < VNNI_TOKENS; ++t) a[r][t] = _mm512_setzero_si512();
    for (int64_t kk = 0; kk < k; kk += 64) {
        const __mmask64 mask = k - kk >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (k - kk)) - 1);
        __m512i xv[VNNI_TOKENS], wv[VNNI_ROWS];
        for (int t = 0; t < tb; ++t) xv[t] = _mm512_maskz_loadu_epi8(mask, x + (t0 + t) * ldx + kk);
        for (int r = 0; r < rb; ++r)
            wv[r] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, w + (j0 + r) * ldw + kk), flip);
        if (t0 == 0) /* once per row tile, by its first token group */
            for (int r = 0; r < VNNI_ROWS; ++r)
                _mm_prefetch((const char *)(w + (j0 + ahead + r) * ldw + kk), _MM_HINT_T1);
        for (int r = 0; r < rb; ++r)
            for (int t = 0; t < tb; ++t) a[r][t] = _mm512_dpbusd_epi32(a[r][t], wv[r], xv[t]);
    }
    int32_t out[VNNI_ROWS * VNNI_TOKENS];
    _mm512_storeu_si512(out, sum_tile(a));
    for (int t = 0; t < tb; ++t)
        for (int r = 0; r < rb; ++r) acc[(t0 + t) * lda + j0 + r] = out[4 * t + r] - 128 * xsum[t0 + t];
}

/* acc for rows [j_begin, j_end) of w against all m tokens, in 4-row tiles, each met by
 * every 4-token group while its rows are in L1; xsum [m] holds each token's sum of x.
 * One thread: int8_gemm_s32 shares the tiles out over its threads, and int8_moe.c the
 * row blocks of a step's experts over its own. */
void int8_vnni_rows(const int8_t *x, int64_t ldx, int64_t m, const int32_t *xsum, const int8_t *w, int64_t ldw,
                    int64_t k, int64_t j_begin, int64_t j_end, int32_t *acc, int64_t lda) {
    for (int64_t j0 = j_begin; j0 < j_end; j0 += VNNI_ROWS) {
        const int rb = j_end - j0 < VNNI_ROWS ? (int)(j_end - j0) : VNNI_ROWS;
        for (int64_t t0 = 0; t0 < m; t0 += VNNI_TOKENS) {
            const int tb = m - t0 < VNNI_TOKENS ? (int)(m - t0) : VNNI_TOKENS;
            if (rb < VNNI_ROWS) /* the last tile */
                vnni_block(rb, tb, x, ldx, xsum, w, ldw, k, j0, t0, acc, lda);
            else if (tb == 4)
                vnni_block(VNNI_ROWS, 4, x, ldx, xsum, w, ldw, k, j0, t0, acc, lda);
            else if (tb == 3)
                vnni_block(VNNI_ROWS, 3, x, ldx, xsum, w, ldw, k, j0, t0, acc, lda);
            else if (tb == 2)
                vnni_block(VNNI_ROWS, 2, x, ldx, xsum, w, ldw, k, j0, t0, acc, lda);
            else
                vnni_block(VNNI_ROWS, 1, x, ldx, xsum, w, ldw, k, j0, t0, acc, lda);
        }
    }
}

/* int8_gemm_s32 with AVX-512 VNNI: each thread a contiguous range of 4-row tiles
 * (int8_vnni_rows); the weight streamed once. Returns 0, or 1 when the token sums cannot
 * be allocated. */
static int gemm_s32_vnni(const int8_t *x, int64_t ldx, int64_t m, const int8_t *w, int64_t ldw, int64_t n, int64_t k,
                         int32_t *acc, int64_t lda, int num_threads) {
    int32_t *xsum = malloc((size_t)m * sizeof(int32_t));
    if (!xsum) return 1;
    for (int64_t t = 0; t < m; ++t) {
        int32_t s = 0;
        for (int64_t kk = 0; kk < k; ++kk) s += x[t * ldx + kk];
        xsum[t] = s;
    }
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t j0 = 0; j0 < n; j0 += VNNI_ROWS)
        int8_vnni_rows(x, ldx, m, xsum, w, ldw, k, j0, j0 + VNNI_ROWS < n ? j0 + VNNI_ROWS : n, acc, lda);
    free(xsum);
    return 0;
}
#endif

/* acc [m, n] int32 (row stride lda) = x [m, k] (rows ldx apart) times w [n, k]^T (rows ldw
 * apart; both unit stride along k: a shard's view is read in place), exact (|sum| <= k *
 * 128 * 128 < 2^31 for k < 2^17): int8_gemm.py's GEMM on CPUs whose
 * torch._int_mm has no int8 kernel (AVX2 without VNNI, where it ran at 0.6 GOP/s), and
 * on AVX-512 VNNI CPUs for the few-token products where oneDNN's slows down (there
 * gemm_s32_vnni computes it). On AVX2, the activations are widened to 16 bits once, a
 * chunk of tokens at a time (GEMM_CHUNK_BYTES, so that a chunk stays in L2 while every
 * weight row passes it); the weight is read as stored. Returns 0, or 1 when the scratch
 * could not be allocated. */
int int8_gemm_s32(const int8_t *x, int64_t ldx, int64_t m, const int8_t *w, int64_t ldw, int64_t n, int64_t k,
                  int32_t *acc, int64_t lda, int num_threads) {
    if (m <= 0 || n <= 0) return 0;
    if (k <= 0) {
        for (int64_t t = 0; t < m; ++t) memset(acc + t * lda, 0, (size_t)n * sizeof(int32_t));
        return 0;
    }
#ifdef INT8_GEMM_VNNI
    return gemm_s32_vnni(x, ldx, m, w, ldw, n, k, acc, lda, num_threads);
#else
    const int64_t kp = (k + 15) & ~(int64_t)15;
    int64_t chunk = GEMM_CHUNK_BYTES / (2 * kp);
    chunk = chunk < GEMM_TOKENS ? GEMM_TOKENS : chunk - chunk % GEMM_TOKENS;
    const size_t bytes = (size_t)((chunk < m ? chunk : m) * kp) * sizeof(int16_t);
    int16_t *x16 = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!x16) return 1;
    for (int64_t c0 = 0; c0 < m; c0 += chunk) {
        const int64_t mc = m - c0 < chunk ? m - c0 : chunk;
        const int8_t *xc = x + c0 * ldx; /* this chunk's tokens and sums */
        int32_t *ac = acc + c0 * lda;
#pragma omp parallel num_threads(num_threads)
        {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < mc; ++t) {
                int64_t kk = 0;
                for (; kk + 16 <= k; kk += 16)
                    _mm256_storeu_si256((__m256i *)(x16 + t * kp + kk),
                                        _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(xc + t * ldx + kk))));
                for (; kk < kp; ++kk) x16[t * kp + kk] = kk < k ? xc[t * ldx + kk] : 0;
            }
#pragma omp for schedule(static)
            for (int64_t j0 = 0; j0 < n; j0 += GEMM_ROWS) {
                const int rb = n - j0 < GEMM_ROWS ? (int)(n - j0) : GEMM_ROWS;
                int64_t t0 = 0;
                for (; t0 + GEMM_TOKENS <= mc; t0 += GEMM_TOKENS) {
                    if (rb == GEMM_ROWS)
                        gemm_block(GEMM_ROWS, GEMM_TOKENS, x16, kp, xc, ldx, w, ldw, k, j0, t0, ac, lda);
                    else
                        gemm_block(rb, GEMM_TOKENS, x16, kp, xc, ldx, w, ldw, k, j0, t0, ac, lda);
                }
                if (t0 < mc) gemm_block(rb, 1, x16, kp, xc, ldx, w, ldw, k, j0, t0, ac, lda);
            }
        }
    }
    free(x16);
    return 0;
#endif
}

/* Whether this build has int8_gemm_s32: 2 with AVX-512 VNNI, 1 with AVX2 alone, or 0. */
#ifdef INT8_GEMM_VNNI
int int8_has_gemm(void) { return 2; }
#else
int int8_has_gemm(void) { return 1; }
void int8_vnni_rows(const int8_t *x, int64_t ldx, int64_t m, const int32_t *xsum, const int8_t *w, int64_t ldw,
                    int64_t k, int64_t j_begin, int64_t j_end, int32_t *acc, int64_t lda) {
    (void)x, (void)ldx, (void)m, (void)xsum, (void)w, (void)ldw, (void)k, (void)j_begin, (void)j_end, (void)acc;
    (void)lda; /* without VNNI: never called (int8_has_gemm() != 2) */
}
#endif
#else
int int8_gemm_s32(const int8_t *x, int64_t ldx, int64_t m, const int8_t *w, int64_t ldw, int64_t n, int64_t k,
                  int32_t *acc, int64_t lda, int num_threads) {
    (void)x, (void)ldx, (void)m, (void)w, (void)ldw, (void)n, (void)k, (void)acc, (void)lda, (void)num_threads;
    return 2;
}
int int8_has_gemm(void) { return 0; }
void int8_vnni_rows(const int8_t *x, int64_t ldx, int64_t m, const int32_t *xsum, const int8_t *w, int64_t ldw,
                    int64_t k, int64_t j_begin, int64_t j_end, int32_t *acc, int64_t lda) {
    (void)x, (void)ldx, (void)m, (void)xsum, (void)w, (void)ldw, (void)k, (void)j_begin, (void)j_end, (void)acc;
    (void)lda; /* without AVX2: never called (int8_has_gemm() == 0) */
}
#endif
