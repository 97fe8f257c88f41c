/* The register tile of our bf16 products (cpu_bf16_gemm.c; gguf_kernels.c's
 * dequantised tiles): R <= 4 weight rows by T <= 4 tokens, each output a dot product of
 * two contiguous bfloat16 runs (a weight row and an activation row), 32 values a
 * VDPBF16PS into 16 float32 partial sums, summed across once at the end. Needs AVX-512
 * BF16 and BW (each includer checks). Static inline: each includer compiles its own copy.
 */
#ifndef BF16_TILE_H
#define BF16_TILE_H

#include <immintrin.h>
#include <stdint.h>

#include "../../distributed/bf16_convert.h"
#include "tile_sum.h"

#define BF16_TILE_ROWS 4
#define BF16_TILE_TOKENS 4

typedef uint16_t bf16;

static inline __m512i bf16_load32(const bf16 *p, __mmask32 mask) {
    return _mm512_maskz_loadu_epi16(mask, p);
}

static inline __m512 bf16_dot(__m512 acc, __m512i a, __m512i b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

/* The 16 sums of acc[r][t] (r, t < 4), summed across: one register whose lane 4t + r is
 * acc[r][t]'s total, which is the tile's output laid out token by token (tile_sum.h). */
static inline __m512 bf16_reduce_tile(__m512 acc[BF16_TILE_ROWS][BF16_TILE_TOKENS]) { return tile_sum16(acc, 0); }

/* The R x T dot products of rows w[0..R) (stride ldw) with tokens x[0..T) (stride ldx),
 * lane 4t + r of the result (the other lanes 0). R and T are constants where it is
 * inlined, so the loops unroll and the sums stay in registers. While it runs it
 * prefetches (into L2) rows pf_first, pf_first + pf_step, ... (< BF16_TILE_ROWS) of the
 * weight tile at `pf` (NULL: none), so that a later tile's rows arrive while this one
 * computes. */
static inline __attribute__((always_inline)) __m512 bf16_tile(const bf16 *w, int64_t ldw, const bf16 *x,
                                                              int64_t ldx, int64_t K, const int R, const int T,
                                                              const bf16 *pf, int pf_first, int pf_step) {
    __m512 acc[BF16_TILE_ROWS][BF16_TILE_TOKENS];
    for (int r = 0; r < BF16_TILE_ROWS; r++)
        for (int t = 0; t < BF16_TILE_TOKENS; t++)
            acc[r][t] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512i wv[BF16_TILE_ROWS], xv[BF16_TILE_TOKENS];
        for (int r = 0; r < R; r++)
            wv[r] = _mm512_loadu_si512((const void *)(w + r * ldw + k));
        if (pf)
            for (int r = pf_first; r < BF16_TILE_ROWS; r += pf_step)
                _mm_prefetch((const char *)(pf + r * ldw + k), _MM_HINT_T1);
        for (int t = 0; t < T; t++)
            xv[t] = _mm512_loadu_si512((const void *)(x + t * ldx + k));
        for (int r = 0; r < R; r++)
            for (int t = 0; t < T; t++)
                acc[r][t] = bf16_dot(acc[r][t], wv[r], xv[t]);
    }
    if (k < K) { /* the last K % 32 values; the masked-off lanes read as zero */
        __mmask32 mask = (__mmask32)((1ull << (K - k)) - 1);
        __m512i wv[BF16_TILE_ROWS], xv[BF16_TILE_TOKENS];
        for (int r = 0; r < R; r++)
            wv[r] = bf16_load32(w + r * ldw + k, mask);
        for (int t = 0; t < T; t++)
            xv[t] = bf16_load32(x + t * ldx + k, mask);
        for (int r = 0; r < R; r++)
            for (int t = 0; t < T; t++)
                acc[r][t] = bf16_dot(acc[r][t], wv[r], xv[t]);
    }
    return bf16_reduce_tile(acc);
}

#define BF16_TILE_CASE(R, T) \
    case (R) * 8 + (T): return bf16_tile(w, ldw, x, ldx, K, R, T, pf, pf_first, pf_step);

static __m512 bf16_run_tile(const bf16 *w, int64_t ldw, const bf16 *x, int64_t ldx, int64_t K, int rows,
                            int tokens, const bf16 *pf, int pf_first, int pf_step) {
    switch (rows * 8 + tokens) {
        BF16_TILE_CASE(4, 4) BF16_TILE_CASE(4, 3) BF16_TILE_CASE(4, 2) BF16_TILE_CASE(4, 1)
        BF16_TILE_CASE(3, 4) BF16_TILE_CASE(3, 3) BF16_TILE_CASE(3, 2) BF16_TILE_CASE(3, 1)
        BF16_TILE_CASE(2, 4) BF16_TILE_CASE(2, 3) BF16_TILE_CASE(2, 2) BF16_TILE_CASE(2, 1)
        BF16_TILE_CASE(1, 4) BF16_TILE_CASE(1, 3) BF16_TILE_CASE(1, 2) BF16_TILE_CASE(1, 1)
        default: return _mm512_setzero_ps();
    }
}

#endif
