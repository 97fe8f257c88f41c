/* y = x W^T (+ b) for bfloat16 x [M, K] and W [N, K], reading W in the checkpoint's own
 * row-major layout, with AVX-512 BF16's VDPBF16PS: float32 sums, one bfloat16 rounding
 * (to nearest even) of each output, as oneDNN's bf16 GEMM rounds.
 *
 * Each row of W and of x is a run of K contiguous values, so an output is a dot product
 * of two runs: 32 values a step, 16 float32 partial sums a register, summed across at
 * the end. A tile of R weight rows by T tokens keeps R x T of those registers and loads
 * R + T vectors per R x T products; a thread takes a contiguous range of weight rows
 * and runs every token group over each tile of rows while those rows are in L1/L2, so
 * W is streamed from memory once a call. Why no packing: see cpu_bf16_gemm.py.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#if !defined(__AVX512BF16__) || !defined(__AVX512BW__)
#error "needs AVX-512 BF16 and BW (the loader only builds this where the CPU has them)"
#endif

#define TILE_ROWS 4
#define TILE_TOKENS 4

typedef uint16_t bf16;

static inline __m512i load32(const bf16 *p, __mmask32 mask) {
    return _mm512_maskz_loadu_epi16(mask, p);
}

static inline __m512 dot(__m512 acc, __m512i a, __m512i b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

static inline float bf16_to_float(bf16 v) {
    union { uint32_t u; float f; } c = { .u = (uint32_t)v << 16 };
    return c.f;
}


/* The 16 sums of acc[r][t] (r, t < 4), summed across: one register whose lane 4t + r is
 * acc[r][t]'s total, which is the tile's output laid out token by token. Four rounds of
 * shuffle-and-add, each halving the registers, in place of 16 separate reductions. */
static inline __m512 reduce_tile(__m512 acc[TILE_ROWS][TILE_TOKENS]) {
    __m512 b[8], c[4], d[2];
    for (int j = 0; j < 8; j++) { /* halves: lanes 0-7 of acc 2j, 8-15 of acc 2j+1 */
        __m512 lo = acc[(2 * j) / 4][(2 * j) % 4], hi = acc[(2 * j + 1) / 4][(2 * j + 1) % 4];
        b[j] = _mm512_add_ps(_mm512_shuffle_f32x4(lo, hi, 0x44), _mm512_shuffle_f32x4(lo, hi, 0xEE));
    }
    for (int j = 0; j < 4; j++) /* quarters: 128-bit lane q holds acc 4j + q */
        c[j] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], 0xDD));
    for (int j = 0; j < 2; j++) /* pairs within each 128-bit lane */
        d[j] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * j], c[2 * j + 1], 0x44),
                             _mm512_shuffle_ps(c[2 * j], c[2 * j + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
}

/* The R x T dot products of rows w[0..R) (stride ldw) with tokens x[0..T) (stride ldx),
 * lane 4t + r of the result (the other lanes 0). R and T are constants where it is
 * inlined, so the loops unroll and the sums stay in registers. While it runs it
 * prefetches rows pf_first, pf_first + pf_step, ... (< TILE_ROWS) of the weight tile at
 * `pf` (NULL: none), so that the next tile's rows arrive while this one computes. */
static inline __attribute__((always_inline)) __m512 tile(const bf16 *w, int64_t ldw, const bf16 *x, int64_t ldx,
                                                         int64_t K, const int R, const int T, const bf16 *pf,
                                                         int pf_first, int pf_step) {
    __m512 acc[TILE_ROWS][TILE_TOKENS];
    for (int r = 0; r < TILE_ROWS; r++)
        for (int t = 0; t < TILE_TOKENS; t++)
            acc[r][t] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512i wv[TILE_ROWS], xv[TILE_TOKENS];
        for (int r = 0; r < R; r++)
            wv[r] = _mm512_loadu_si512((const void *)(w + r * ldw + k));
        if (pf)
            for (int r = pf_first; r < TILE_ROWS; r += pf_step)
                _mm_prefetch((const char *)(pf + r * ldw + k), _MM_HINT_T1);
        for (int t = 0; t < T; t++)
            xv[t] = _mm512_loadu_si512((const void *)(x + t * ldx + k));
        for (int r = 0; r < R; r++)
            for (int t = 0; t < T; t++)
                acc[r][t] = dot(acc[r][t], wv[r], xv[t]);
    }
    if (k < K) { /* the last K % 32 values; the masked-off lanes read as zero */
        __mmask32 mask = (__mmask32)((1ull << (K - k)) - 1);
        __m512i wv[TILE_ROWS], xv[TILE_TOKENS];
        for (int r = 0; r < R; r++)
            wv[r] = load32(w + r * ldw + k, mask);
        for (int t = 0; t < T; t++)
            xv[t] = load32(x + t * ldx + k, mask);
        for (int r = 0; r < R; r++)
            for (int t = 0; t < T; t++)
                acc[r][t] = dot(acc[r][t], wv[r], xv[t]);
    }
    return reduce_tile(acc);
}

#define TILE_CASE(R, T) \
    case (R) * 8 + (T): return tile(w, ldw, x, ldx, K, R, T, pf, pf_first, pf_step);

static __m512 run_tile(const bf16 *w, int64_t ldw, const bf16 *x, int64_t ldx, int64_t K, int rows, int tokens,
                       const bf16 *pf, int pf_first, int pf_step) {
    switch (rows * 8 + tokens) {
        TILE_CASE(4, 4) TILE_CASE(4, 3) TILE_CASE(4, 2) TILE_CASE(4, 1)
        TILE_CASE(3, 4) TILE_CASE(3, 3) TILE_CASE(3, 2) TILE_CASE(3, 1)
        TILE_CASE(2, 4) TILE_CASE(2, 3) TILE_CASE(2, 2) TILE_CASE(2, 1)
        TILE_CASE(1, 4) TILE_CASE(1, 3) TILE_CASE(1, 2) TILE_CASE(1, 1)
        default: return _mm512_setzero_ps();
    }
}

/* y[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]) for m < M, n < N; x, w, bias and y bfloat16,
 * rows at strides ldx, ldw, ldy (elements); bias may be NULL. `threads` OpenMP threads
 * split the weight's rows, each a contiguous range of 4-row tiles. A tile's token groups
 * share the prefetching of the tile after it: group g fetches rows g, g + groups, ... */
void bf16_linear(const bf16 *x, int64_t ldx, int64_t M, const bf16 *w, int64_t ldw, int64_t N, int64_t K,
                 const bf16 *bias, bf16 *y, int64_t ldy, int threads) {
    const int64_t blocks = (N + TILE_ROWS - 1) / TILE_ROWS;
    const int64_t groups = (M + TILE_TOKENS - 1) / TILE_TOKENS;
    const int pf_step = groups < TILE_ROWS ? (int)groups : TILE_ROWS;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n0 = b * TILE_ROWS;
        const int rows = (int)(N - n0 < TILE_ROWS ? N - n0 : TILE_ROWS);
        const bf16 *next = b + 2 < blocks ? w + (n0 + 2 * TILE_ROWS) * ldw : NULL; /* a whole tile */
        float bias_f[TILE_ROWS] = {0};
        if (bias)
            for (int r = 0; r < rows; r++)
                bias_f[r] = bf16_to_float(bias[n0 + r]);
        const __m512 bias_v = _mm512_broadcast_f32x4(_mm_loadu_ps(bias_f));
        for (int64_t g = 0; g < groups; g++) {
            const int64_t m0 = g * TILE_TOKENS;
            const int tokens = (int)(M - m0 < TILE_TOKENS ? M - m0 : TILE_TOKENS);
            const bf16 *pf = g < TILE_ROWS ? next : NULL;
            __m512 sums = _mm512_add_ps(run_tile(w + n0 * ldw, ldw, x + m0 * ldx, ldx, K, rows, tokens, pf,
                                                 (int)g, pf_step), bias_v);
            bf16 out[TILE_ROWS * TILE_TOKENS];
            _mm256_storeu_si256((__m256i *)out, (__m256i)_mm512_cvtneps_pbh(sums));
            for (int t = 0; t < tokens; t++) {
                bf16 *dst = y + (m0 + t) * ldy + n0;
                if (rows == TILE_ROWS)
                    memcpy(dst, out + t * TILE_ROWS, sizeof(bf16) * TILE_ROWS);
                else
                    for (int r = 0; r < rows; r++)
                        dst[r] = out[t * TILE_ROWS + r];
            }
        }
    }
}
