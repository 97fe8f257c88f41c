/* y = x W^T for bfloat16 tokens x [M, Kp] and an int4/int8 WNA16 weight (wna16_blocks.h's
 * layout) on AMX tiles (TDPBF16PS), without dequantising the whole weight: each 32-row block
 * of W is decoded once a call into a panel of bfloat16 weights bf16((q - z) * s), each
 * rounded once from its float32 value, as the dequantised bfloat16 tiles it replaces held
 * them and as a bfloat16 model's weights are (an int4 code through a 16-entry table of its
 * group's weights); the panel's 16 x 32 blocks are the tiles' A operands and the tokens
 * the B operands (amx_tiles.h), summed in float32 over the whole input
 * (`amx_scaled_runs`, one run). Keeping q - z exact and scaling each group's sums instead
 * took 1.2-1.45x the time at 32 tokens: four tile stores and a scaled add a group. Threads
 * split the 32-row blocks (a partial last block is zero-padded).
 *
 * Called from wna16_cpu.py only (`Wna16Kernel.amx_matmul`), which checks shapes, strides
 * and dtypes; built into its library. Needs AMX-TILE, AMX-BF16 and AVX-512 BW (elsewhere
 * `wna16_has_amx` is 0) and the process's permission for the tiles.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "wna16_blocks.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__)
#include "../../amx_tiles.h"

/* Block b of `row` (4 or 8 bits) as 32 bfloat16 weights (q - z) * s, each rounded once
 * (to nearest even) from its float32 value: for 4 bits `table` holds word j = bf16((j - z)
 * * s) (j < 16) and the codes index it (vpermw reads 5 bits: the nibbles are masked); for
 * 8 bits each is computed in float32, q - z exact. */
static inline void decode_block_bf16(int bits, const uint8_t *row, int64_t b, __m512i table, __m512i zv, __m512 sv,
                                     bf16 *dst) {
    if (bits == 4) {
        const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(row + b * 16)));
        const __m256i lo = _mm256_and_si256(v, _mm256_set1_epi16(15)), hi = _mm256_srli_epi16(v, 4);
        const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); /* inputs 0-15, then 16-31 */
        _mm512_storeu_si512((void *)dst, _mm512_permutexvar_epi16(idx, table));
        return;
    }
    const __m512 a = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(
        _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + b * BLOCK))), zv)), sv);
    const __m512 c = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(
        _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + b * BLOCK + 16))), zv)), sv);
    _mm512_storeu_si512((void *)dst, (__m512i)_mm512_cvtne2ps_pbh(c, a));
}

/* The weight as wna16_amx_matmul was given it (amx_panel_fill's context). */
typedef struct {
    int bits, scale_dtype;
    const uint8_t *wq, *zeros;
    const void *scales;
    const int32_t *block_group;
    int64_t N, kp, g_count;
} wna16_weight;

/* Rows [n0, n0 + 32) of W (those < N; the rest zero) as bfloat16 weights into panel [32,
 * kp]; their one run's scale 1 (the scales are in the weights). */
static void decode_panel(const void *ctx, int64_t n0, bf16 *panel, float *run_scale) {
    const wna16_weight *wt = ctx;
    const int64_t row_bytes = wt->kp * wt->bits / 8;
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int r = 0; r < ROWS; r++) {
        bf16 *dst = panel + r * wt->kp;
        run_scale[r] = 1.f;
        if (n0 + r >= wt->N) {
            memset(dst, 0, sizeof(bf16) * (size_t)wt->kp);
            continue;
        }
        const uint8_t *row = wt->wq + (n0 + r) * row_bytes;
        int32_t g = -1;
        __m512i table = _mm512_setzero_si512(), zv = _mm512_setzero_si512();
        __m512 sv = _mm512_setzero_ps();
        for (int64_t b = 0; b < wt->kp / BLOCK; b++) {
            if (wt->block_group[b] != g) { /* a new group: its zero point and scale, the 16 weights a code stands for */
                g = wt->block_group[b];
                zv = _mm512_set1_epi32(wt->zeros[(n0 + r) * wt->g_count + g]);
                sv = _mm512_set1_ps(load_scale(wt->scales, (n0 + r) * wt->g_count + g, wt->scale_dtype));
                table = _mm512_castsi256_si512(
                    (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(iota, zv)), sv)));
            }
            decode_block_bf16(wt->bits, row, b, table, zv, sv, dst + b * BLOCK);
        }
    }
}

/* y [M, N] float32 (rows ldy apart) = x [M, kp] bfloat16 (rows ldx apart) times W^T, on
 * `num_threads` threads. Returns 0; 2 where the process may not use the tiles (nothing
 * computed); 1 where scratch (amx_panel_product's) could not be allocated. */
int wna16_amx_matmul(int bits, const uint8_t *wq, const void *scales, int scale_dtype, const uint8_t *zeros,
                     const int32_t *block_group, int64_t N, int64_t kp, int64_t g_count, const bf16 *x, int64_t ldx,
                     int64_t M, float *y, int64_t ldy, int num_threads) {
    const wna16_weight wt = {bits, scale_dtype, wq, zeros, scales, block_group, N, kp, g_count};
    const int64_t run_end = kp / BLOCK; /* one run: the scales are in the weights */
    return amx_panel_product(x, ldx, M, N, kp, 1, &run_end, decode_panel, &wt, y, 1, ldy, num_threads);
}

int wna16_has_amx(void) { return tiles_permitted(); }
#else
int wna16_amx_matmul(int bits, const uint8_t *wq, const void *scales, int scale_dtype, const uint8_t *zeros,
                     const int32_t *block_group, int64_t N, int64_t kp, int64_t g_count, const uint16_t *x,
                     int64_t ldx, int64_t M, float *y, int64_t ldy, int num_threads) {
    (void)bits, (void)wq, (void)scales, (void)scale_dtype, (void)zeros, (void)block_group, (void)N, (void)kp;
    (void)g_count, (void)x, (void)ldx, (void)M, (void)y, (void)ldy, (void)num_threads;
    return 2;
}

int wna16_has_amx(void) { return 0; }
#endif
