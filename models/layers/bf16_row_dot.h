/* The one-token product of our bf16 layers (cpu_bf16_gemm.c's one-row GEMV,
 * fused_moe/cpu_moe.c's experts of one token): the dot product of one weight row with
 * one token, both K contiguous bfloat16 values, with AVX-512 BF16's VDPBF16PS on 256-bit
 * vectors into four 8-lane float32 sums (64 values a step), the tail masked, summed
 * across at the end (half_dot.h's hsum). Callers stream their rows one at a time, with no
 * software prefetch: each thread's rows are one sequential stream, which the hardware
 * prefetchers follow. On the Zen 4 VM (AVX-512 run as two 256-bit halves), reading an
 * 853M Llama's 64 weights (2 threads, paired runs, 2026-12-06) this took 1.06-1.15x the
 * 4-row tile's rate (which prefetches two tiles ahead), 512-bit loads row by row
 * 0.97-1.04x, and 2 or 4 rows at a time with 256-bit loads 0.68-0.85x; a one-token
 * step's experts (4 of 16, 1024 x 768, 2026-12-07) 1.2-1.85x, median 1.6x. Needs AVX-512
 * BF16 and VL (each includer checks). Static inline: each includer compiles its own copy. */
#ifndef BF16_ROW_DOT_H
#define BF16_ROW_DOT_H

#include <immintrin.h>
#include <stdint.h>

#include "half_dot.h" /* hsum */

static inline float bf16_row_dot(const uint16_t *w, const uint16_t *x, int64_t K) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
#define DOT(acc, off) acc = _mm256_dpbf16_ps(acc, (__m256bh)_mm256_loadu_si256((const __m256i *)(w + k + (off))), \
                                             (__m256bh)_mm256_loadu_si256((const __m256i *)(x + k + (off))))
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        DOT(a0, 0);
        DOT(a1, 16);
        DOT(a2, 32);
        DOT(a3, 48);
    }
    for (; k + 16 <= K; k += 16) DOT(a0, 0);
#undef DOT
    if (k < K) { /* the last K % 16 values; the masked-off lanes read as zero */
        const __mmask16 mask = (__mmask16)((1u << (K - k)) - 1u);
        a1 = _mm256_dpbf16_ps(a1, (__m256bh)_mm256_maskz_loadu_epi16(mask, w + k),
                              (__m256bh)_mm256_maskz_loadu_epi16(mask, x + k));
    }
    return hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

#endif
