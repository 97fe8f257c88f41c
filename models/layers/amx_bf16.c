/* y = x W^T (+ b) for bfloat16 x [M, K] and W [N, K] on AMX tiles (TDPBF16PS), reading W in
 * the checkpoint's row-major layout: float32 sums, one bfloat16 rounding of each output.
 *
 * The weight is the tiles' A operand as it lies: a 16 x 32 bfloat16 block of W (16 rows, 32
 * inputs, rows ldw apart) is exactly one A tile, so W is never reordered (oneDNN's GEMM
 * reorders it into its blocked layout on every F.linear call). The tokens are the B
 * operand, which TDPBF16PS wants as pairs of inputs side by side: `x` is rewritten once
 * a call into that layout (tokens in groups of 16, zero-padded to a multiple of 32; 2 K x
 * 32 bytes per 32 tokens), a small cost against the weight's. A work item is amx_tiles.h's
 * 32 weight rows by 32 tokens (16 tokens or fewer: one B tile, two C tiles); the last
 * block of a weight whose N is not a multiple of 32 is copied into a zero-padded 32-row
 * panel first. Each A row is prefetched PREFETCH_AHEAD inputs ahead. Threads split the
 * 32-row blocks, each running every 32 tokens over its block while the block is in L2,
 * so W is streamed from memory once a call.
 *
 * Needs AMX-TILE and AMX-BF16 (built with -march=native on such a CPU; elsewhere it
 * compiles to `bf16_amx_available` returning 0) and the kernel's permission for the tile
 * state, which each process asks for once (arch_prctl ARCH_REQ_XCOMP_PERM); K a multiple
 * of 32 (else 2 is returned and nothing computed). Called from cpu_bf16_gemm.py
 * (`Bf16GemmKernel.amx_linear`), which checks shapes, strides and dtypes.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../distributed/bf16_convert.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#include "amx_tiles.h"

#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 256
#endif

/* Column t of a 16 x 16 float32 tile (its 16 rows' values for token t). */
static inline __m512 tile_column(const float c[16][16], int t) {
    const __m512i rows = _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80, 64, 48, 32, 16, 0);
    return _mm512_i32gather_ps(rows, &c[0][t], 4);
}

/* C tile `c` (16 weight rows from n0, `rows` of them real, by 16 tokens from t0, `tokens`
 * of them real) to y as bfloat16, plus the rows' bias: each token's 16 sums gathered from
 * the tile's column, rounded and stored side by side. */
static inline void store_tile(const float c[16][16], int64_t n0, int rows, int64_t t0, int tokens, __m512 bias,
                              bf16 *y, int64_t ldy) {
    const __mmask16 mask = (__mmask16)((1u << rows) - 1);
    for (int t = 0; t < tokens; t++) {
        const __m512 v = _mm512_add_ps(tile_column(c, t), bias);
        _mm256_mask_storeu_epi16(y + (t0 + t) * ldy + n0, mask, (__m256i)_mm512_cvtneps_pbh(v));
    }
}

/* The bias of rows [n0, n0 + rows) as float32 lanes (0 past them, and without a bias). */
static inline __m512 bias_of(const bf16 *bias, int64_t n0, int rows) {
    if (bias == NULL) return _mm512_setzero_ps();
    const __m256i b = _mm256_maskz_loadu_epi16((__mmask16)((1u << rows) - 1), bias + n0);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

/* One 32-row block (A rows at `a`, `lda` values apart; `rows` of them real, from n0)
 * against every 32 tokens (16 where only 16 are left: two products a step, not four). */
static void block_times_tokens(const bf16 *a, int64_t lda, const uint32_t *xv, int64_t K, int64_t M, int64_t n0,
                               int64_t rows, const bf16 *bias, bf16 *y, int64_t ldy) {
    float c[4][16][16];
    const int64_t group_stride = (K / 2) * 16; /* dwords per 16-token group */
    const int rows0 = rows < 16 ? (int)rows : 16, rows1 = rows > 16 ? (int)rows - 16 : 0;
    const __m512 bias0 = bias_of(bias, n0, rows0), bias1 = bias_of(bias, n0 + 16, rows1);
    for (int64_t t0 = 0; t0 < M; t0 += TOKENS) {
        const uint32_t *b0 = xv + (t0 / 16) * group_stride, *b1 = b0 + group_stride;
        const int tokens0 = M - t0 < 16 ? (int)(M - t0) : 16, tokens1 = M - t0 > 16 ? (int)(M - t0 - 16) : 0;
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        for (int64_t k = 0; k < K; k += 32) {
            if (k + PREFETCH_AHEAD < K) /* each row's line PREFETCH_AHEAD inputs on: 32 streams */
                for (int r = 0; r < ROWS; r++)
                    _mm_prefetch((const char *)(a + r * lda + k + PREFETCH_AHEAD), _MM_HINT_T0);
            _tile_loadd(0, a + k, lda * sizeof(bf16));
            _tile_loadd(1, a + 16 * lda + k, lda * sizeof(bf16));
            _tile_loadd(2, b0 + (k / 2) * 16, 64);
            _tile_dpbf16ps(4, 0, 2);
            _tile_dpbf16ps(6, 1, 2);
            if (tokens1) {
                _tile_loadd(3, b1 + (k / 2) * 16, 64);
                _tile_dpbf16ps(5, 0, 3);
                _tile_dpbf16ps(7, 1, 3);
            }
        }
        _tile_stored(4, c[0], 64);
        _tile_stored(6, c[2], 64);
        store_tile(c[0], n0, rows0, t0, tokens0, bias0, y, ldy);
        if (rows1) store_tile(c[2], n0 + 16, rows1, t0, tokens0, bias1, y, ldy);
        if (tokens1) {
            _tile_stored(5, c[1], 64);
            _tile_stored(7, c[3], 64);
            store_tile(c[1], n0, rows0, t0 + 16, tokens1, bias0, y, ldy);
            if (rows1) store_tile(c[3], n0 + 16, rows1, t0 + 16, tokens1, bias1, y, ldy);
        }
    }
}

/* y [M, N] bfloat16 (rows ldy apart) = x [M, K] (rows ldx apart) times w [N, K]^T (rows ldw
 * apart) (+ bias [N], or NULL), on `threads` OpenMP threads. Returns 0; 2 where K is not a
 * multiple of 32 or the process may not use the tiles (nothing computed); 1 where scratch
 * could not be allocated. */
int bf16_amx_linear(const bf16 *x, int64_t ldx, int64_t M, const bf16 *w, int64_t ldw, int64_t N, int64_t K,
                    const bf16 *bias, bf16 *y, int64_t ldy, int threads) {
    if (K % 32 != 0 || M <= 0 || !tiles_permitted()) return 2;
    const int64_t groups = (M + TOKENS - 1) / TOKENS * 2;
    uint32_t *xv = malloc(sizeof(uint32_t) * (size_t)groups * (size_t)(K / 2) * 16);
    if (xv == NULL) return 1;
    tokens_to_pairs(x, ldx, M, K, groups, xv);
    const int64_t blocks = (N + ROWS - 1) / ROWS;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        configure_tiles();
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t n0 = b * ROWS, rows = N - n0 < ROWS ? N - n0 : ROWS;
            if (rows == ROWS) {
                block_times_tokens(w + n0 * ldw, ldw, xv, K, M, n0, rows, bias, y, ldy);
                continue;
            }
            bf16 *panel = calloc((size_t)ROWS * (size_t)K, sizeof(bf16)); /* the last, partial block */
            if (panel == NULL) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            for (int64_t r = 0; r < rows; r++) memcpy(panel + r * K, w + (n0 + r) * ldw, sizeof(bf16) * (size_t)K);
            block_times_tokens(panel, K, xv, K, M, n0, rows, bias, y, ldy);
            free(panel);
        }
        _tile_release();
    }
    free(xv);
    return failed;
}

int bf16_amx_available(void) { return tiles_permitted(); }
#else
typedef uint16_t bf16;

int bf16_amx_linear(const bf16 *x, int64_t ldx, int64_t M, const bf16 *w, int64_t ldw, int64_t N, int64_t K,
                    const bf16 *bias, bf16 *y, int64_t ldy, int threads) {
    (void)x, (void)ldx, (void)M, (void)w, (void)ldw, (void)N, (void)K, (void)bias, (void)y, (void)ldy, (void)threads;
    return 2;
}

int bf16_amx_available(void) { return 0; }
#endif
