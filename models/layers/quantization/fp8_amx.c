/* fp8 (e4m3) weights times bfloat16 activations on AMX tiles (TDPBF16PS):
 *
 *     y[m, n] = sum_c x[m, c] * fp8(w[n, c]) * scale[n / block_n, c / block_k]
 *
 * for x [M, K] and y [M, N] bfloat16. An e4m3 value is exactly a bfloat16 (fp8_convert.h):
 * each 32-row block of w is converted once a call into a panel of those exact values (32
 * rows x K, in L2), whose 16 x 32 blocks are the tiles' A operands; the tokens are the B
 * operands (amx_tiles.h). Each k-block of block_k inputs (all of K for one scale per row)
 * is summed in the C tiles in float32 (every product exact), then times its rows' scales
 * (amx_tiles.h's `amx_scaled_runs`): no weight is rounded, and each output once, as
 * fp8_bf16.c's exact mode. Threads split the 32-row blocks (a partial last block is
 * zero-padded).
 *
 * Called from fp8_kernels.py only (`Fp8DequantKernel.amx_linear`), which checks shapes,
 * strides and dtypes; built into the same library as fp8_kernels.c. Needs AMX-TILE,
 * AMX-BF16 and AVX-512 BW (elsewhere `fp8_has_amx` is 0) and the process's permission for
 * the tiles.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__)
#include "../amx_tiles.h"
#include "fp8_convert.h"

/* The weight as fp8_amx_linear was given it (amx_panel_fill's context). */
typedef struct {
    const uint8_t *w;
    int64_t w_stride, N, K;
    const float *scale;
    int64_t scale_stride, block_n, kblocks;
} fp8_weight;

/* Rows [n0, n0 + 32) of w (those < N; the rest zero) as exact bfloat16 into panel [32, K],
 * and each k-block's scale of each row (0 past N) into run_scale[kb * 32 + r]. */
static void convert_panel(const void *ctx, int64_t n0, bf16 *panel, float *run_scale) {
    const fp8_weight *wt = ctx;
    for (int r = 0; r < ROWS; r++) {
        bf16 *dst = panel + r * wt->K;
        if (n0 + r >= wt->N) {
            memset(dst, 0, sizeof(bf16) * (size_t)wt->K);
            for (int64_t kb = 0; kb < wt->kblocks; kb++) run_scale[kb * ROWS + r] = 0.f;
            continue;
        }
        const uint8_t *src = wt->w + (n0 + r) * wt->w_stride;
        for (int64_t k = 0; k < wt->K; k += 32)
            _mm512_storeu_si512((void *)(dst + k), fp8x32_to_bf16(_mm256_loadu_si256((const __m256i *)(src + k))));
        const float *srow = wt->scale + ((n0 + r) / wt->block_n) * wt->scale_stride;
        for (int64_t kb = 0; kb < wt->kblocks; kb++) run_scale[kb * ROWS + r] = srow[kb];
    }
}

/* y [M, N] bfloat16 (rows ldy apart) = x [M, K] bfloat16 (rows ldx apart) times dequant(w)^T
 * (w rows w_stride bytes apart; float32 `scale` rows scale_stride apart, one value per
 * block_n x block_k), on `num_threads` threads. Returns 0; 2 (nothing computed) where K is
 * not a multiple of 32, block_k is neither a multiple of 32 nor all of K, or the process
 * may not use the tiles; 1 where scratch (amx_panel_product's) could not be allocated. */
int fp8_amx_linear(const bf16 *x, int64_t ldx, int64_t M, const uint8_t *w, int64_t w_stride, int64_t N, int64_t K,
                   const float *scale, int64_t scale_stride, int64_t block_n, int64_t block_k, bf16 *y, int64_t ldy,
                   int num_threads) {
    if (K % 32 != 0 || (block_k < K && block_k % 32 != 0)) return 2;
    const int64_t kblocks = block_k < K ? (K + block_k - 1) / block_k : 1;
    int64_t *run_end = malloc(sizeof(int64_t) * (size_t)kblocks); /* each k-block's end, in 32-input blocks */
    if (run_end == NULL) return 1;
    for (int64_t kb = 0; kb < kblocks; kb++)
        run_end[kb] = kblocks == 1 || (kb + 1) * block_k >= K ? K / 32 : (kb + 1) * block_k / 32;
    const fp8_weight wt = {w, w_stride, N, K, scale, scale_stride, block_n, kblocks};
    const int status = amx_panel_product(x, ldx, M, N, K, kblocks, run_end, convert_panel, &wt, y, 0, ldy, num_threads);
    free(run_end);
    return status;
}

int fp8_has_amx(void) { return tiles_permitted(); }
#else
int fp8_amx_linear(const uint16_t *x, int64_t ldx, int64_t M, const uint8_t *w, int64_t w_stride, int64_t N,
                   int64_t K, const float *scale, int64_t scale_stride, int64_t block_n, int64_t block_k, uint16_t *y,
                   int64_t ldy, int num_threads) {
    (void)x, (void)ldx, (void)M, (void)w, (void)w_stride, (void)N, (void)K, (void)scale, (void)scale_stride;
    (void)block_n, (void)block_k, (void)y, (void)ldy, (void)num_threads;
    return 2;
}

int fp8_has_amx(void) { return 0; }
#endif
