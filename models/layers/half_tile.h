/* 16-bit (bfloat16 or float16) weight rows against float32 token rows in 16-lane sums
 * (AVX-512 F, BW and VL): up to 6 weight rows by 4 token rows, each weight vector widened
 * once and used by every token, each token vector used by every weight row (24 512-bit
 * sums, six widened weight vectors and one token vector in the 32 zmm registers; 4 weight
 * rows while the weight streams from memory, `half_tile_width`). Products on AVX-512
 * CPUs with no GEMM of their own for the weight's dtype: float16 on every AVX-512 CPU
 * without AVX-512 FP16 (all of AMD's, Intel's before Sapphire Rapids), and bfloat16
 * where AVX-512 BF16 is missing too (Skylake-X to Ice Lake). Their callers:
 * cpu_sgemm.c's 2-32-row product of a dense weight (half_gemm) and fused_moe/cpu_moe.c's
 * experts of two or more tokens (float16 ones; bfloat16 ones without AVX-512 BF16).
 *
 * Each output is one 16-lane sum of exact float32 products (each lane the row's tail
 * first, then in k order), reduced across its lanes in a fixed order: the same whatever
 * tile, group of tokens or thread computes it. Static inline: each includer compiles its
 * own copy; empty where the build lacks AVX-512 F, BW or VL (the callers keep
 * half_dot.h's AVX2 dot products there). */
#ifndef HALF_TILE_H
#define HALF_TILE_H

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#include <stdint.h>

#define HALF_TILE_W 6 /* weight rows per tile */
#define HALF_TILE_R 4 /* token rows per tile */

/* 16 16-bit values at p (bf16: bfloat16, else float16) widened exactly to float32; `mask`
 * selects the leading values of a row's tail (the rest read as zero). */
static inline __attribute__((always_inline)) __m512 half_widen16(const uint16_t *p, __mmask16 mask, const int bf16) {
    const __m256i h = mask == 0xFFFF ? _mm256_loadu_si256((const __m256i *)p) : _mm256_maskz_loadu_epi16(mask, p);
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* o[r * HALF_TILE_W + i] = sum over k < K of w[i * ldw + k] * x[r * ldx + k], for the W <= 6
 * weight rows at w and the R <= 4 token rows at x. While it runs it prefetches into L2
 * the 6 weight rows at pf (rows ldw apart; NULL: none), which the caller points at the
 * tile it will run two tiles later: without it a 16-row product waited on memory
 * (the dense product at 2-16 rows ran 1.2-1.35x slower, 2026-12-07, the Zen 4 VM). */
static inline __attribute__((always_inline)) void half_tile(const int W, const int R, const float *x, int64_t ldx,
                                                            const uint16_t *w, int64_t ldw, int64_t K, float *o,
                                                            const uint16_t *pf, const int bf16) {
    __m512 acc[HALF_TILE_W][HALF_TILE_R];
    const int64_t K16 = K & ~(int64_t)15;
    { /* The row's tail first (zeros where there is none), once: masked loads are slow on
       * Zen 4 (2x the time in the loop below), and a tail after the loop made GCC keep
       * the sums on the stack. */
        const __mmask16 mask = (__mmask16)((1u << (K - K16)) - 1u);
        __m512 v[HALF_TILE_W];
        for (int i = 0; i < W; i++) v[i] = half_widen16(w + i * ldw + K16, mask, bf16);
        for (int r = 0; r < R; r++) {
            const __m512 a = _mm512_maskz_loadu_ps(mask, x + r * ldx + K16);
            for (int i = 0; i < W; i++) acc[i][r] = _mm512_mul_ps(v[i], a);
        }
    }
    for (int64_t k = 0; k < K16; k += 16) {
        __m512 v[HALF_TILE_W];
        for (int i = 0; i < W; i++) v[i] = half_widen16(w + i * ldw + k, 0xFFFF, bf16);
        if (pf && !(k & 31)) /* one 64-byte line of each row every 32 values */
            for (int i = 0; i < HALF_TILE_W; i++) _mm_prefetch((const char *)(pf + i * ldw + k), _MM_HINT_T1);
        for (int r = 0; r < R; r++) {
            const __m512 a = _mm512_loadu_ps(x + r * ldx + k);
            for (int i = 0; i < W; i++) acc[i][r] = _mm512_fmadd_ps(v[i], a, acc[i][r]);
        }
    }
    for (int i = 0; i < W; i++)
        for (int r = 0; r < R; r++) o[r * HALF_TILE_W + i] = _mm512_reduce_add_ps(acc[i][r]);
}

/* Weight rows per tile for a dense product of m token rows: 4 while the weight streams
 * from memory (up to 8 rows: 6 concurrent row streams ran 0.9x), 6 where the FMA units
 * bound it (1.05x at 16 rows, 1.1-1.2x at 24-32, 2026-12-07, the Zen 4 VM). The experts
 * (cpu_moe.c) take 6 at any count: their tiles run every token group in turn. */
static inline int half_tile_width(int64_t m) { return m <= 8 ? 4 : HALF_TILE_W; }

/* half_tile for any W in [1, 6] and R in [1, 4], each pair compiled with its sums in registers. */
#define HALF_TILE_CASE(W, R, BF)                                                                                      \
    case ((W) * 8 + (R)) * 2 + (BF): half_tile(W, R, x, ldx, w, ldw, K, o, pf, BF); break;
#define HALF_TILE_CASES(W, BF)                                                                                        \
    HALF_TILE_CASE(W, 1, BF) HALF_TILE_CASE(W, 2, BF) HALF_TILE_CASE(W, 3, BF) HALF_TILE_CASE(W, 4, BF)
static inline void half_tile_run(int W, int R, const float *x, int64_t ldx, const uint16_t *w, int64_t ldw, int64_t K,
                                 float *o, const uint16_t *pf, int bf16) {
    switch ((W * 8 + R) * 2 + !!bf16) {
        HALF_TILE_CASES(1, 0) HALF_TILE_CASES(2, 0) HALF_TILE_CASES(3, 0)
        HALF_TILE_CASES(4, 0) HALF_TILE_CASES(5, 0) HALF_TILE_CASES(6, 0)
        HALF_TILE_CASES(1, 1) HALF_TILE_CASES(2, 1) HALF_TILE_CASES(3, 1)
        HALF_TILE_CASES(4, 1) HALF_TILE_CASES(5, 1) HALF_TILE_CASES(6, 1)
    }
}
#undef HALF_TILE_CASES
#undef HALF_TILE_CASE

#endif /* AVX-512 F, BW, VL */
#endif
