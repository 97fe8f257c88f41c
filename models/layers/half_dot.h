/* Dot products of float32 activation rows with 16-bit (bfloat16 or float16) weight rows
 * read where they lie, widened to float32 8 values at a time, with AVX2 and FMA: the
 * 2-16-row product of cpu_sgemm.c (its `half_gemm`, whose comment has the numbers)
 * and the float16 experts of fused_moe/cpu_moe.c (bfloat16 ones too on CPUs without
 * AVX-512 BF16) on builds without AVX-512 (half_tile.h's 16-lane tiles take those on
 * AVX-512), and on every build one row of x a weight row at a time (`dot_row1`). Each output is
 * one dot product in k order, summed in 8 lanes and then across, so it does not depend
 * on how a caller splits its rows among threads (`hsum`, the sum across, serves the
 * one-row products of cpu_sgemm.c and cpu_bf16_gemm.c too). Static inline: each includer
 * compiles its own copy. */
#ifndef HALF_DOT_H
#define HALF_DOT_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define DOT_ROWS 6      /* rows of x per register tile of dot products */
#define DOT_BLOCK 24     /* weight rows per task: a multiple of every tile's W (8, 6, 4, 3, 2) */

static inline __attribute__((always_inline)) __m256 widen8(const uint16_t *p, const int bf16) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (bf16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

static inline float widen1(uint16_t v, const int bf16) {
    if (bf16) {
        uint32_t bits = (uint32_t)v << 16;
        float f;
        memcpy(&f, &bits, sizeof f);
        return f;
    }
    return _cvtsh_ss(v);
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Outputs [n0, n0 + nw) (nw <= W) of the R rows of x at x (rows k apart), into out
 * (rows ldo apart): W x R running sums of 8 lanes, 8 values a step. W * R <= 12 keeps them
 * in registers with the widened weight vectors and one row of x; enough independent sums
 * to hide the FMA latency even for one row of x. */
static inline __attribute__((always_inline)) void dot_tile(const int W, const int R, const float *x, int64_t k,
                                                           const uint16_t *w, int64_t ldw, int64_t n0, int64_t nw,
                                                           const float *bias, float *out, int64_t ldo,
                                                           const int bf16) {
    __m256 acc[8][6];
    const uint16_t *rows[8];
    for (int i = 0; i < W; i++) {
        rows[i] = w + (n0 + (i < nw ? i : 0)) * ldw; /* rows past nw repeat row n0: computed, not stored */
        for (int r = 0; r < R; r++)
            acc[i][r] = _mm256_setzero_ps();
    }
    int64_t kk = 0;
    for (; kk + 8 <= k; kk += 8) {
        __m256 v[8];
        for (int i = 0; i < W; i++)
            v[i] = widen8(rows[i] + kk, bf16);
        for (int r = 0; r < R; r++) {
            __m256 a = _mm256_loadu_ps(x + r * k + kk);
            for (int i = 0; i < W; i++)
                acc[i][r] = _mm256_fmadd_ps(v[i], a, acc[i][r]);
        }
    }
    for (int i = 0; i < nw; i++)
        for (int r = 0; r < R; r++) {
            float sum = hsum(acc[i][r]);
            for (int64_t t = kk; t < k; t++)
                sum += widen1(rows[i][t], bf16) * x[r * k + t];
            out[r * ldo + n0 + i] = sum + (bias ? bias[n0 + i] : 0.0f);
        }
}

/* The R rows of x at x against weight rows [n0, n1), W rows a tile (W * R <= 12). */
static inline __attribute__((always_inline)) void dot_rows(const int R, const float *x, int64_t k, const uint16_t *w,
                                                           int64_t ldw, int64_t n0, int64_t n1, const float *bias,
                                                           float *out, int64_t ldo, const int bf16) {
    const int W = R == 1 ? 8 : R == 2 ? 6 : R == 3 ? 4 : R == 4 ? 3 : 2;
    for (int64_t j = n0; j < n1; j += W)
        dot_tile(W, R, x, k, w, ldw, j, n1 - j < W ? n1 - j : W, bias, out, ldo, bf16);
}

static inline void dot_group(int R, const float *x, int64_t k, const uint16_t *w, int64_t ldw, int64_t n0, int64_t n1,
                      const float *bias, float *out, int64_t ldo, const int bf16) {
    switch (R) {
    case 1: dot_rows(1, x, k, w, ldw, n0, n1, bias, out, ldo, bf16); break;
    case 2: dot_rows(2, x, k, w, ldw, n0, n1, bias, out, ldo, bf16); break;
    case 3: dot_rows(3, x, k, w, ldw, n0, n1, bias, out, ldo, bf16); break;
    case 4: dot_rows(4, x, k, w, ldw, n0, n1, bias, out, ldo, bf16); break;
    case 5: dot_rows(5, x, k, w, ldw, n0, n1, bias, out, ldo, bf16); break;
    default: dot_rows(6, x, k, w, ldw, n0, n1, bias, out, ldo, bf16); break;
    }
}

/* One row of x (a batch-1 decode, an expert's lone token) against weight row w: four
 * 8-lane sums, 32 values a step, then the tail, in a fixed order, so the same whatever
 * the thread count. One weight row at a time, each thread's rows one sequential stream:
 * 8 rows interleaved (dot_rows' tile for one row of x) read an 853M Llama's float16
 * weights at 0.86x the rate of the bf16 kernel's one-token rows on the Zen 4 VM
 * (2026-12-06, paired), where 2 or 4 interleaved rows of 256-bit loads read at
 * 0.68-0.85x one. cpu_sgemm.c's one-row product and fused_moe/cpu_moe.c's experts of one
 * token. */
static inline __attribute__((always_inline)) float dot_row1(const float *x, int64_t k, const uint16_t *w,
                                                           const int bf16) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t kk = 0;
    for (; kk + 32 <= k; kk += 32) {
        a0 = _mm256_fmadd_ps(widen8(w + kk, bf16), _mm256_loadu_ps(x + kk), a0);
        a1 = _mm256_fmadd_ps(widen8(w + kk + 8, bf16), _mm256_loadu_ps(x + kk + 8), a1);
        a2 = _mm256_fmadd_ps(widen8(w + kk + 16, bf16), _mm256_loadu_ps(x + kk + 16), a2);
        a3 = _mm256_fmadd_ps(widen8(w + kk + 24, bf16), _mm256_loadu_ps(x + kk + 24), a3);
    }
    for (; kk + 8 <= k; kk += 8) a0 = _mm256_fmadd_ps(widen8(w + kk, bf16), _mm256_loadu_ps(x + kk), a0);
    float sum = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; kk < k; kk++) sum += widen1(w[kk], bf16) * x[kk];
    return sum;
}

#endif
