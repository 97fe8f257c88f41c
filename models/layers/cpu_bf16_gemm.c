/* y = x W^T (+ b) for bfloat16 x [M, K] and W [N, K], reading W in the checkpoint's own
 * row-major layout, with AVX-512 BF16's VDPBF16PS: float32 sums, one bfloat16 rounding
 * (to nearest even) of each output, as oneDNN's bf16 GEMM rounds.
 *
 * Each row of W and of x is a run of K contiguous values, so an output is a dot product
 * of two runs: 32 values a step, 16 float32 partial sums a register, summed across at
 * the end. A tile of R weight rows by T tokens keeps R x T of those registers and loads
 * R + T vectors per R x T products; a thread takes a contiguous range of weight rows
 * and runs every token group over each tile of rows while those rows are in L1/L2, so
 * W is streamed from memory once a call. One token (a batch-1 decode, bound by reading W)
 * streams one row at a time instead (bf16_row_dot.h). Why no packing: see cpu_bf16_gemm.py.
 */
#include <stdint.h>
#include <string.h>

#if !defined(__AVX512BF16__) || !defined(__AVX512BW__) || !defined(__AVX512VL__)
#error "needs AVX-512 BF16, BW and VL (the loader only builds this where the CPU has them)"
#endif

#include "bf16_row_dot.h"
#include "bf16_tile.h"

/* y[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]) for m < M, n < N; x, w, bias and y bfloat16,
 * rows at strides ldx, ldw, ldy (elements); bias may be NULL. `threads` OpenMP threads
 * split the weight's rows, each a contiguous range of them, taken one row at a time for
 * one token (`bf16_row_dot`) and as 4-row tiles for more. A tile's token groups
 * share the prefetching of the tile two ahead (into L2: 1.2-1.4x at 1-16 rows on the
 * Zen 5 VM, against no prefetch or one tile ahead into L1): group g fetches rows g,
 * g + groups, ... */
void bf16_linear(const bf16 *x, int64_t ldx, int64_t M, const bf16 *w, int64_t ldw, int64_t N, int64_t K,
                 const bf16 *bias, bf16 *y, int64_t ldy, int threads) {
    if (M == 1) { /* each thread a contiguous range of rows, one row at a time */
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t n = 0; n < N; n++)
            y[n] = float_to_bf16(bf16_row_dot(w + n * ldw, x, K) + (bias ? bf16_to_float(bias[n]) : 0.f));
        return;
    }
    const int64_t blocks = (N + BF16_TILE_ROWS - 1) / BF16_TILE_ROWS;
    const int64_t groups = (M + BF16_TILE_TOKENS - 1) / BF16_TILE_TOKENS;
    const int pf_step = groups < BF16_TILE_ROWS ? (int)groups : BF16_TILE_ROWS;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n0 = b * BF16_TILE_ROWS;
        const int rows = (int)(N - n0 < BF16_TILE_ROWS ? N - n0 : BF16_TILE_ROWS);
        const bf16 *next = b + 2 < blocks ? w + (n0 + 2 * BF16_TILE_ROWS) * ldw : NULL; /* a whole tile */
        float bias_f[BF16_TILE_ROWS] = {0};
        if (bias)
            for (int r = 0; r < rows; r++)
                bias_f[r] = bf16_to_float(bias[n0 + r]);
        const __m512 bias_v = _mm512_broadcast_f32x4(_mm_loadu_ps(bias_f));
        for (int64_t g = 0; g < groups; g++) {
            const int64_t m0 = g * BF16_TILE_TOKENS;
            const int tokens = (int)(M - m0 < BF16_TILE_TOKENS ? M - m0 : BF16_TILE_TOKENS);
            const bf16 *pf = g < BF16_TILE_ROWS ? next : NULL;
            __m512 sums = _mm512_add_ps(bf16_run_tile(w + n0 * ldw, ldw, x + m0 * ldx, ldx, K, rows, tokens, pf,
                                                      (int)g, pf_step), bias_v);
            bf16 out[BF16_TILE_ROWS * BF16_TILE_TOKENS];
            _mm256_storeu_si256((__m256i *)out, (__m256i)_mm512_cvtneps_pbh(sums));
            for (int t = 0; t < tokens; t++) {
                bf16 *dst = y + (m0 + t) * ldy + n0;
                if (rows == BF16_TILE_ROWS)
                    memcpy(dst, out + t * BF16_TILE_ROWS, sizeof(bf16) * BF16_TILE_ROWS);
                else
                    for (int r = 0; r < rows; r++)
                        dst[r] = out[t * BF16_TILE_ROWS + r];
            }
        }
    }
}
