/* out[m, n] = x[m, k] . w[n, k]^T (+ bias[n]) in float32 with AVX2 and FMA, for a weight
 * packed once into column panels (models/layers/cpu_sgemm.py explains why).
 *
 * Packed layout: ceil(n / NR) panels, panel j holding columns [j*NR, j*NR + NR) of w^T
 * as k rows of NR floats (columns past n are zero). A panel (48-128 KB for k = 768-2048)
 * stays in L2 while every row tile of x streams past it, and the next panel is
 * prefetched during the first tile, so the weight is read from memory once per call.
 *
 * A tile is MR <= 6 rows by NR = 16 columns: 12 accumulators, 2 weight vectors and one
 * broadcast, 15 of the 16 ymm registers. The rows of a row block are split into equal
 * tiles (32 rows: 6,6,5,5,5,5, not 6,6,6,6,6,2) since a thin tile reads the same panel
 * for a third of the work. Each output element is one thread's dot product in k order,
 * so results do not depend on the thread count.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "avx2_transpose.h"
#include "half_dot.h"
#include "half_tile.h"

#define NR 16
#define MR 6
#define MC 192 /* rows of x per block: its k floats per row stay in L2 across panels */

void cpu_sgemm_pack(const float *w, int64_t n, int64_t k, float *packed, int nthreads) {
    int64_t panels = (n + NR - 1) / NR;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t j = 0; j < panels; j++) {
        float *p = packed + j * k * NR;
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t c = 0; c < NR; c++) {
                int64_t col = j * NR + c;
                p[kk * NR + c] = col < n ? w[col * k + kk] : 0.0f;
            }
    }
}

static inline __attribute__((always_inline)) void tile(const int mr, const float *x, int64_t k, const float *panel,
                                                       const float *prefetch, const float *bias, float *out,
                                                       int64_t ldo, int64_t cols) {
    __m256 acc[MR][2];
    for (int r = 0; r < MR; r++)
        acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t kk = 0; kk < k; kk++) {
        if (prefetch)
            _mm_prefetch((const char *)(prefetch + kk * NR), _MM_HINT_T1);
        __m256 b0 = _mm256_loadu_ps(panel + kk * NR), b1 = _mm256_loadu_ps(panel + kk * NR + 8);
        for (int r = 0; r < mr; r++) {
            __m256 a = _mm256_broadcast_ss(x + r * k + kk);
            acc[r][0] = _mm256_fmadd_ps(a, b0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(a, b1, acc[r][1]);
        }
    }
    float add[NR] = {0};
    if (bias)
        memcpy(add, bias, cols * sizeof(float));
    __m256 z0 = _mm256_loadu_ps(add), z1 = _mm256_loadu_ps(add + 8);
    for (int r = 0; r < mr; r++) {
        __m256 o0 = _mm256_add_ps(acc[r][0], z0), o1 = _mm256_add_ps(acc[r][1], z1);
        if (cols == NR) {
            _mm256_storeu_ps(out + r * ldo, o0);
            _mm256_storeu_ps(out + r * ldo + 8, o1);
        } else { /* the last panel of an n that is not a multiple of NR */
            float row[NR];
            _mm256_storeu_ps(row, o0);
            _mm256_storeu_ps(row + 8, o1);
            memcpy(out + r * ldo, row, cols * sizeof(float));
        }
    }
}

/* Rows [0, m) of x against `panel`, the weight's panel j (m <= MC), in equal tiles of at
 * most MR rows; the first tile prefetches `next` (NULL: nothing) into L2. */
static void panel_block(const float *x, int64_t m, int64_t k, const float *panel, const float *next, int64_t j,
                        int64_t n, const float *bias, float *out) {
    const float *b = bias ? bias + j * NR : 0;
    int64_t cols = n - j * NR < NR ? n - j * NR : NR;
    int64_t tiles = (m + MR - 1) / MR, i = 0;
    for (int64_t t = 0; t < tiles; t++) {
        int64_t rows = (m - i + tiles - t - 1) / (tiles - t);
        const float *xi = x + i * k, *pf = t == 0 ? next : 0;
        float *o = out + i * n + j * NR;
        switch (rows) {
        case 6: tile(6, xi, k, panel, pf, b, o, n, cols); break;
        case 5: tile(5, xi, k, panel, pf, b, o, n, cols); break;
        case 4: tile(4, xi, k, panel, pf, b, o, n, cols); break;
        case 3: tile(3, xi, k, panel, pf, b, o, n, cols); break;
        case 2: tile(2, xi, k, panel, pf, b, o, n, cols); break;
        default: tile(1, xi, k, panel, pf, b, o, n, cols); break;
        }
        i += rows;
    }
}

void cpu_sgemm(const float *x, int64_t m, int64_t k, const float *packed, int64_t n, const float *bias, float *out,
               int nthreads) {
    int64_t panels = (n + NR - 1) / NR;
#pragma omp parallel num_threads(nthreads)
    for (int64_t i0 = 0; i0 < m; i0 += MC) {
        int64_t rows = m - i0 < MC ? m - i0 : MC;
#pragma omp for schedule(static)
        for (int64_t j = 0; j < panels; j++)
            panel_block(x + i0 * k, rows, k, packed + j * k * NR, j + 1 < panels ? packed + (j + 1) * k * NR : 0, j,
                        n, bias, out + i0 * n);
    }
}

/* ---- 16-bit weights kept in the checkpoint's row-major layout ----
 *
 * out[m, n] = x[m, k] . w[n, k]^T (+ bias[n]) in float32 for a bfloat16 or float16 weight
 * w [n, k] (rows at stride ldw) read where it was loaded: no packed copy.
 * - One row of x: each thread's weight rows one at a time (`dot_row1`).
 * - On AVX-512 builds, up to HALF_TILE_MAX_ROWS rows of x (decode batches): tiles of 4
 *   weight rows (up to 8 rows of x) or 6 (more) by 4 rows of x in 16-lane sums
 *   (half_tile.h), each thread a run of DOT_BLOCK-row blocks, the rows of x in equal
 *   groups of at most 4 over each block. Against the dot products below, paired, float16
 *   5632x2048 weights from memory, 2026-12-07, the Zen 4 VM: 1.26x at 2 rows, 1.4-1.67x
 *   at 3-16, 1.05-1.14x at 24-32 in 4-row tiles; 6-row tiles, against those: 1.05x at 16
 *   rows (181 GFLOP/s; the FMA units' peak is 234 on two cores), 1.1-1.2x at 24-32, and
 *   1.2x at 16-32 rows of a 1536x1024 weight (an expert's gate/up); from 48 rows the
 *   widened panels are as fast (0.99x), at 128-512 faster.
 * - Elsewhere up to DOT_MAX_ROWS rows of x, each output is a dot product of a
 *   weight row and a row of x, 8 values a step (half_dot.h): a tile of W weight rows
 *   widened once per step serves R <= DOT_ROWS rows of x (W * R <= 12 running sums); the
 *   weight is read from memory once, at its 2 bytes a value, and from L2 for the next
 *   group of rows.
 * - More rows: each thread widens a 16-row panel of w into its own buffer in the packed
 *   panels' layout (8x8 blocks transposed in registers) and runs the same 6x16 tiles as
 *   the packed weights over every row of the block: the widening is paid once per panel
 *   and MC rows.
 * Against the packed float32 copy it replaces (2026-12-05, 2-core Zen 3 VM, 5632x2048 and
 * 2048x5632 bf16): 2.2-2.4x at 1 row, 1.1-1.5x at 2-8, on par at 16 and from 32 to 1024
 * rows (0.94-1.03x). Up to 20 rows the dot products beat the panels (2.8 against 3.3 ms
 * at 16 rows). One row, since taken a weight row at a time: 1.05-1.08x the 8-row tile it
 * replaced (an 853M Llama's float16 weights, AVX2 and native builds, paired, Zen 4 VM,
 * 2026-12-06).
 * Products and sums are float32 (a bf16 or fp16 value widens exactly). Each output is one
 * thread's sum, so results do not depend on the thread count. */

#define DOT_MAX_ROWS 16 /* up to this many rows of x, dot products; above, widened panels */
#define HALF_TILE_MAX_ROWS 32 /* AVX-512: up to this many rows of x, half_tile.h's tiles */

/* Rows [n0, n0 + cols) of w, widened into one panel: p[kk * NR + c] (zero for c >= cols). */
static inline __attribute__((always_inline)) void widen_panel(const uint16_t *w, int64_t ldw, int64_t n0,
                                                              int64_t cols, int64_t k, const int bf16, float *p) {
    int64_t kk = 0;
    if (cols == NR) {
        for (; kk + 8 <= k; kk += 8)
            for (int half = 0; half < 2; half++) {
                __m256 r[8];
                for (int c = 0; c < 8; c++)
                    r[c] = widen8(w + (n0 + half * 8 + c) * ldw + kk, bf16);
                transpose8(r);
                for (int j = 0; j < 8; j++)
                    _mm256_storeu_ps(p + (kk + j) * NR + half * 8, r[j]);
            }
    }
    for (; kk < k; kk++)
        for (int64_t c = 0; c < NR; c++)
            p[kk * NR + c] = c < cols ? widen1(w[(n0 + c) * ldw + kk], bf16) : 0.0f;
}

#ifdef HALF_TILE_R
#define SMALL_MAX_ROWS HALF_TILE_MAX_ROWS
#define SMALL_GROUP HALF_TILE_R
#else
#define SMALL_MAX_ROWS DOT_MAX_ROWS
#define SMALL_GROUP DOT_ROWS
#endif

/* The R rows of x at x against weight rows [n0, n1) into out (rows n apart): AVX-512's
 * tiles of 16-lane sums (half_tile.h), as wide as the product's m rows of x make best,
 * the first group of rows prefetching two tiles ahead; else half_dot.h's dot products. */
static inline void small_group(int R, int64_t m, int first, const float *x, int64_t k, const uint16_t *w,
                               int64_t ldw, int64_t n0, int64_t n1, int64_t n, const float *bias, float *out,
                               const int bf16) {
#ifdef HALF_TILE_R
    const int tw = half_tile_width(m);
    for (int64_t j = n0; j < n1; j += tw) {
        const int W = (int)(n1 - j < tw ? n1 - j : tw);
        const int64_t ahead = j + 2 * tw;
        float o[HALF_TILE_W * HALF_TILE_R];
        half_tile_run(W, R, x, k, w + j * ldw, ldw, k, o, first && ahead < n ? w + ahead * ldw : 0, bf16);
        for (int r = 0; r < R; r++)
            for (int i = 0; i < W; i++) out[r * n + j + i] = o[r * HALF_TILE_W + i] + (bias ? bias[j + i] : 0.0f);
    }
#else
    (void)first;
    (void)m;
    if (bf16)
        dot_group(R, x, k, w, ldw, n0, n1, bias, out, n, 1);
    else
        dot_group(R, x, k, w, ldw, n0, n1, bias, out, n, 0);
#endif
}

static void half_gemm(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t ldw, int64_t n,
                      const float *bias, float *out, int nthreads, const int bf16, int *status) {
    if (m == 1) { /* each thread a contiguous range of weight rows, one at a time */
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int64_t j = 0; j < n; j++)
            out[j] = (bf16 ? dot_row1(x, k, w + j * ldw, 1) : dot_row1(x, k, w + j * ldw, 0)) + (bias ? bias[j] : 0.0f);
        return;
    }
    if (m <= SMALL_MAX_ROWS) {
        /* Blocks of DOT_BLOCK weight rows (a multiple of every tile's width) per task;
         * within a block, the rows of x in equal groups of at most SMALL_GROUP, each group
         * over the block's rows while they are in L2. */
        const int64_t blocks = (n + DOT_BLOCK - 1) / DOT_BLOCK, groups = (m + SMALL_GROUP - 1) / SMALL_GROUP;
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t n0 = b * DOT_BLOCK, n1 = n - n0 < DOT_BLOCK ? n : n0 + DOT_BLOCK;
            int64_t r0 = 0;
            for (int64_t g = 0; g < groups; g++) {
                const int R = (int)((m - r0 + groups - g - 1) / (groups - g));
                small_group(R, m, g == 0, x + r0 * k, k, w, ldw, n0, n1, n, bias, out + r0 * n, bf16);
                r0 += R;
            }
        }
        return;
    }
    int64_t panels = (n + NR - 1) / NR;
#pragma omp parallel num_threads(nthreads)
    {
        float *p = aligned_alloc(64, (size_t)((k * NR * sizeof(float) + 63) / 64 * 64));
        if (!p) {
#pragma omp atomic write
            *status = -3;
        }
        for (int64_t i0 = 0; i0 < m; i0 += MC) {
            int64_t rows = m - i0 < MC ? m - i0 : MC;
#pragma omp for schedule(static)
            for (int64_t j = 0; j < panels; j++) {
                if (!p)
                    continue;
                widen_panel(w, ldw, j * NR, n - j * NR < NR ? n - j * NR : NR, k, bf16, p);
                panel_block(x + i0 * k, rows, k, p, 0, j, n, bias, out + i0 * n);
            }
        }
        free(p);
    }
}

/* out [m, n] float32 = x [m, k] float32 (contiguous) times w^T, w [n, k] bfloat16
 * (`bf16` = 1) or float16 (0) at row stride ldw, plus bias [n] float32 or NULL.
 * Returns 0, or -3 where a thread's panel buffer (k * 64 bytes) could not be allocated. */
int cpu_sgemm_half(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t ldw, int64_t n,
                   const float *bias, float *out, int bf16, int nthreads) {
    int status = 0;
    if (bf16)
        half_gemm(x, m, k, w, ldw, n, bias, out, nthreads, 1, &status);
    else
        half_gemm(x, m, k, w, ldw, n, bias, out, nthreads, 0, &status);
    return status;
}
