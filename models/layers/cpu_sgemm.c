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
#include <string.h>

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

/* Rows [0, m) of x against panel j (m <= MC), in equal tiles of at most MR rows. */
static void panel_block(const float *x, int64_t m, int64_t k, const float *packed, int64_t panels, int64_t j,
                        int64_t n, const float *bias, float *out) {
    const float *panel = packed + j * k * NR;
    const float *next = j + 1 < panels ? panel + k * NR : 0;
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
            panel_block(x + i0 * k, rows, k, packed, panels, j, n, bias, out + i0 * n);
    }
}
