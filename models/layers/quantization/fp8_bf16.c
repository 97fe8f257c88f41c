/* fp8 (e4m3) weights times bfloat16 activations by bfloat16 dot products (AVX-512 BF16):
 *
 *     y[m, n] = sum_c x[m, c] * fp8(w[n, c]) * scale[n / block_n, c / block_k]
 *
 * for x [M, K] and y [M, N] bfloat16. An e4m3 value is exactly a bfloat16 (3 mantissa
 * bits fit in 7), converted 32 at a time by a few integer ops (fp8x32_to_bf16), so the
 * weight is read once, as bytes, and never dequantised whole. Each thread takes 4-row
 * blocks of w in turn, converts a block into its own panel (prefetching the block two
 * ahead) and runs every 4-token group of x over the panel while it is in L1 (with one
 * group, up to 4 tokens, the tile converts the bytes itself: no panel), in one of two
 * ways:
 *
 *   exact (`round_weights` 0): the panel holds the values unscaled; each k-block's
 *   float32 sums are multiplied by the rows' scales (`scaled_tile`), so no product is
 *   rounded but the output, as fp8_kernels.c's float32 GEMV gives;
 *   rounded (1): the panel holds q * s rounded to bfloat16 and the tile is the plain
 *   bfloat16 one (bf16_tile.h), the values fp8_dequant_rows' tiles hold, in fewer
 *   instructions: the per-block sums cost more than the rounding once there are more
 *   than a few tokens (4096x4096 in 128x128 blocks, 32 tokens: 4.7 against 3.8 ms).
 *
 * Called from fp8_kernels.py only (`Fp8DequantKernel.bf16_linear`), which checks shapes,
 * strides and dtypes; built into the same library as fp8_kernels.c. Each output's sum
 * runs in a fixed order, whatever the thread count.
 */
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include "../bf16_tile.h"
#include "fp8_convert.h"

#define INLINE static inline __attribute__((always_inline))

/* 32 bfloat16 values times s, rounded to bfloat16 (to nearest even) once. */
INLINE __m512i scale_bf16x32(__m512i v, __m512 s) {
    const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16));
    const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)),
                                                            16));
    return (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, s), _mm512_mul_ps(lo, s));
}

/* Row `src` (K bytes) into panel row `dst`: its exact values, or (srow != NULL) each
 * times its k-block's scale srow[c / block_k], rounded to bfloat16. */
INLINE void convert_row(const uint8_t *src, int64_t K, const float *srow, int64_t block_k, bf16 *dst) {
    for (int64_t k = 0; k < K; k += 32) {
        const __mmask32 mask = k + 32 <= K ? (__mmask32)~0u : (__mmask32)((1ull << (K - k)) - 1);
        __m512i v = fp8x32_to_bf16(_mm256_maskz_loadu_epi8(mask, src + k));
        if (srow != NULL) v = scale_bf16x32(v, _mm512_set1_ps(srow[k / block_k]));
        _mm512_mask_storeu_epi16(dst + k, mask, v);
    }
}

/* The R x T sums of panel rows (the exact values, rows K apart), or of the fp8 rows at
 * `direct` (w_stride bytes apart) converted as they are read, with tokens x (ldx apart),
 * each k-block of `block_k` values (a multiple of 32, or all of K) summed apart and then
 * times its row's scale (row_scales[r][kb]) into the total: lane 4t + r. */
INLINE __m512 scaled_tile(const bf16 *panel, int64_t K, const bf16 *x, int64_t ldx, const int R, const int T,
                          const float *const *row_scales, int64_t kblocks, int64_t block_k,
                          const uint8_t *direct, int64_t w_stride) {
    __m512 total[BF16_TILE_ROWS][BF16_TILE_TOKENS];
    for (int r = 0; r < BF16_TILE_ROWS; r++)
        for (int t = 0; t < BF16_TILE_TOKENS; t++) total[r][t] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < kblocks; kb++) {
        const int64_t k0 = kb * block_k, k1 = k0 + block_k < K ? k0 + block_k : K;
        __m512 part[BF16_TILE_ROWS][BF16_TILE_TOKENS];
        for (int r = 0; r < R; r++)
            for (int t = 0; t < T; t++) part[r][t] = _mm512_setzero_ps();
        for (int64_t k = k0; k < k1; k += 32) {
            const __mmask32 mask = k + 32 <= k1 ? (__mmask32)~0u : (__mmask32)((1ull << (k1 - k)) - 1);
            __m512i wv[BF16_TILE_ROWS], xv[BF16_TILE_TOKENS];
            for (int r = 0; r < R; r++)
                wv[r] = direct ? fp8x32_to_bf16(_mm256_maskz_loadu_epi8(mask, direct + r * w_stride + k))
                               : bf16_load32(panel + r * K + k, mask);
            for (int t = 0; t < T; t++) xv[t] = bf16_load32(x + t * ldx + k, mask);
            for (int r = 0; r < R; r++)
                for (int t = 0; t < T; t++) part[r][t] = bf16_dot(part[r][t], wv[r], xv[t]);
        }
        for (int r = 0; r < R; r++) {
            const __m512 s = _mm512_set1_ps(row_scales[r][kb]);
            for (int t = 0; t < T; t++) total[r][t] = _mm512_fmadd_ps(part[r][t], s, total[r][t]);
        }
    }
    return bf16_reduce_tile(total);
}

#define SCALED_TILE_CASE(R, T) \
    case (R) * 8 + (T): return scaled_tile(panel, K, x, ldx, R, T, row_scales, kblocks, block_k, direct, w_stride);

static __m512 run_scaled_tile(const bf16 *panel, int64_t K, const bf16 *x, int64_t ldx, int rows, int tokens,
                              const float *const *row_scales, int64_t kblocks, int64_t block_k,
                              const uint8_t *direct, int64_t w_stride) {
    switch (rows * 8 + tokens) {
        SCALED_TILE_CASE(4, 4) SCALED_TILE_CASE(4, 3) SCALED_TILE_CASE(4, 2) SCALED_TILE_CASE(4, 1)
        SCALED_TILE_CASE(3, 4) SCALED_TILE_CASE(3, 3) SCALED_TILE_CASE(3, 2) SCALED_TILE_CASE(3, 1)
        SCALED_TILE_CASE(2, 4) SCALED_TILE_CASE(2, 3) SCALED_TILE_CASE(2, 2) SCALED_TILE_CASE(2, 1)
        SCALED_TILE_CASE(1, 4) SCALED_TILE_CASE(1, 3) SCALED_TILE_CASE(1, 2) default:
        return scaled_tile(panel, K, x, ldx, 1, 1, row_scales, kblocks, block_k, direct, w_stride);
    }
}

/* Rows [n0, n1) of y (M tokens, float32 where y_f32, else bfloat16, rows ldy apart) =
 * x [M, K] bfloat16 (rows ldx apart) times w [N, K] (rows w_stride bytes apart)
 * dequantised with float32 `scale` (rows scale_stride apart, one value per block_n x
 * block_k; block_k a multiple of 32 or all of K), exact or with the weights rounded (see
 * the top), on the calling thread, 4 rows at a time. `panel` (BF16_TILE_ROWS * K
 * values) is the caller's scratch. Called by
 * fp8_bf16_linear's threads and by fp8_moe.c's, each on its own rows. */
void fp8_bf16_rows(const bf16 *x, int64_t ldx, int64_t M, const uint8_t *w, int64_t w_stride, int64_t N, int64_t K,
                   const float *scale, int64_t scale_stride, int64_t block_n, int64_t block_k, int round_weights,
                   int64_t n0, int64_t n1, void *y, int y_f32, int64_t ldy, bf16 *panel) {
    const int64_t kblocks = (K + block_k - 1) / block_k;
    const int64_t groups = (M + BF16_TILE_TOKENS - 1) / BF16_TILE_TOKENS;
    for (int64_t nb = n0; nb < n1; nb += BF16_TILE_ROWS) {
        const int rows = (int)(n1 - nb < BF16_TILE_ROWS ? n1 - nb : BF16_TILE_ROWS);
        const float *row_scales[BF16_TILE_ROWS]; /* each row's k-blocks' scales */
        for (int r = 0; r < rows; r++) {
            const uint8_t *src = w + (nb + r) * w_stride;
            row_scales[r] = scale + ((nb + r) / block_n) * scale_stride;
            if (nb + 2 * BF16_TILE_ROWS + r < N) /* the block two ahead, into L2 */
                for (int64_t c = 0; c < K; c += 64) __builtin_prefetch(src + 2 * BF16_TILE_ROWS * w_stride + c, 0, 2);
            if (groups > 1 || round_weights)
                convert_row(src, K, round_weights ? row_scales[r] : NULL, block_k, panel + r * K);
        }
        for (int64_t g = 0; g < groups; g++) {
            const int64_t m0 = g * BF16_TILE_TOKENS;
            const int tokens = (int)(M - m0 < BF16_TILE_TOKENS ? M - m0 : BF16_TILE_TOKENS);
            const __m512 sums = round_weights
                                    ? bf16_run_tile(panel, K, x + m0 * ldx, ldx, K, rows, tokens, NULL, 0, 0)
                                    : run_scaled_tile(panel, K, x + m0 * ldx, ldx, rows, tokens, row_scales, kblocks,
                                                      block_k, groups > 1 ? NULL : w + nb * w_stride, w_stride);
            float out[BF16_TILE_ROWS * BF16_TILE_TOKENS]; /* lane 4t + r */
            _mm512_storeu_ps(out, sums);
            for (int t = 0; t < tokens; t++)
                for (int r = 0; r < rows; r++) {
                    const float v = out[t * BF16_TILE_ROWS + r];
                    if (y_f32)
                        ((float *)y)[(m0 + t) * ldy + nb + r] = v;
                    else
                        ((bf16 *)y)[(m0 + t) * ldy + nb + r] = float_to_bf16(v);
                }
        }
    }
}

/* y [M, N] bfloat16 (rows ldy apart) = x [M, K] times dequant(w)^T (fp8_bf16_rows), the
 * rows shared out over `num_threads` threads 4 at a time. Returns 0; 2 (nothing
 * computed) where block_k is neither a multiple of 32 nor all of K; 1 where a thread's
 * panel (8 K bytes) could not be allocated. */
int fp8_bf16_linear(const bf16 *x, int64_t ldx, int64_t M, const uint8_t *w, int64_t w_stride, int64_t N, int64_t K,
                    const float *scale, int64_t scale_stride, int64_t block_n, int64_t block_k, int round_weights,
                    bf16 *y, int64_t ldy, int num_threads) {
    if (block_k < K && block_k % 32 != 0) return 2;
    const int64_t blocks = (N + BF16_TILE_ROWS - 1) / BF16_TILE_ROWS;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        bf16 *panel = malloc(sizeof(bf16) * BF16_TILE_ROWS * (size_t)K);
        if (panel == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(static)
            for (int64_t b = 0; b < blocks; b++) {
                const int64_t n0 = b * BF16_TILE_ROWS, n1 = n0 + BF16_TILE_ROWS < N ? n0 + BF16_TILE_ROWS : N;
                fp8_bf16_rows(x, ldx, M, w, w_stride, N, K, scale, scale_stride, block_n, block_k, round_weights, n0,
                              n1, y, 0, ldy, panel);
            }
        }
        free(panel);
    }
    return failed;
}

int fp8_has_bf16_linear(void) { return 1; }
#else
int fp8_has_bf16_linear(void) { return 0; }
#endif
