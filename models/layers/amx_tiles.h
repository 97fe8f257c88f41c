/* What our AMX kernels share (amx_bf16.c: bfloat16 weights; wna16_amx.c: int4/int8 ones;
 * fp8_amx.c: fp8 ones): the process's permission for the tile state, the tile
 * configuration (8 tiles of 16 rows of 64 bytes), the tokens rearranged into TDPBF16PS's
 * B layout, the product of a panel of decoded weight values whose runs of inputs each
 * carry their own scale (`amx_scaled_runs`), and the threads' loop over a weight's 32-row
 * panels (`amx_panel_product`). A work item is 32 weight rows (two A tiles: tmm0, tmm1) by 32 tokens (two B tiles: tmm2,
 * tmm3) into four C tiles (tmm4: rows 0-15 x tokens 0-15, tmm5: rows 0-15 x tokens 16-31,
 * tmm6, tmm7 the same for rows 16-31). Needs AMX-TILE, AMX-BF16 and AVX-512 (each
 * includer checks). Static inline: each includer compiles its own copy.
 */
#ifndef AMX_TILES_H
#define AMX_TILES_H

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define ROWS 32   /* weight rows a work item: two A tiles */
#define TOKENS 32 /* tokens a work item: two B tiles */

typedef uint16_t bf16;

/* The 64-byte operand of LDTILECFG (palette 1): every tile 16 rows of 64 bytes. */
typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Whether this process may use the tile registers: asked of the kernel once per process
 * (a forked child inherits the answer, and asking again is harmless). */
static inline int tiles_permitted(void) {
    static pid_t asked = 0;
    static int ok = 0;
    const pid_t pid = getpid();
    if (asked != pid) {
        ok = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
        asked = pid;
    }
    return ok;
}

static inline void configure_tiles(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
}

/* x [M, K] (rows ldx apart) into TDPBF16PS's B layout: for each group of 16 tokens, K / 2
 * rows of 16 (input pair) dwords, token t's inputs 2p, 2p + 1 at dword t of row p; groups
 * past M zero. `xv` holds groups * K * 16 values. */
static inline void tokens_to_pairs(const bf16 *x, int64_t ldx, int64_t M, int64_t K, int64_t groups, uint32_t *xv) {
    memset(xv, 0, sizeof(uint32_t) * (size_t)groups * (size_t)(K / 2) * 16);
    for (int64_t m = 0; m < M; m++) {
        uint32_t *dst = xv + (m / 16) * (K / 2) * 16 + m % 16;
        const bf16 *src = x + m * ldx;
        for (int64_t p = 0; p < K / 2; p++) {
            uint32_t pair;
            memcpy(&pair, src + 2 * p, sizeof pair);
            dst[p * 16] = pair;
        }
    }
}

/* y[t, n0 + r] = sum over runs j of run_scale[j * 32 + r] * sum over the run's inputs of
 * panel[r][k] x[t][k], for r < rows and every token t < M: `panel` 32 rows of kp exact
 * bfloat16 values (rows past `rows` zero), `xv` the tokens in tokens_to_pairs' layout,
 * run j the 32-input blocks [run_end[j - 1], run_end[j]) (run_end[-1] = 0; the last
 * run_end kp / 32). Each run is summed in the C tiles (float32; products of bfloat16
 * values are exact), then times its rows' scales into a float32 total; y is float32
 * (y_f32) or bfloat16 (the total rounded once), rows ldy apart. Runs on the calling
 * thread, whose tiles are configured. */
static inline void amx_scaled_runs(const bf16 *panel, int64_t kp, const uint32_t *xv, int64_t M, int64_t n0, int rows,
                                   int64_t nruns, const int64_t *run_end, const float *run_scale, void *y, int y_f32,
                                   int64_t ldy) {
    float c[4][16][16], total[ROWS][TOKENS];
    const int64_t group_stride = (kp / 2) * 16;
    const __m512i across = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(TOKENS));
    for (int64_t t0 = 0; t0 < M; t0 += TOKENS) {
        const uint32_t *b0 = xv + (t0 / 16) * group_stride, *b1 = b0 + group_stride;
        const int two = M - t0 > 16; /* a second B tile */
        memset(total, 0, sizeof total);
        for (int64_t j = 0, b = 0; j < nruns; j++) {
            _tile_zero(4);
            _tile_zero(5);
            _tile_zero(6);
            _tile_zero(7);
            for (; b < run_end[j]; b++) {
                _tile_loadd(0, panel + b * 32, kp * sizeof(bf16));
                _tile_loadd(1, panel + 16 * kp + b * 32, kp * sizeof(bf16));
                _tile_loadd(2, b0 + b * 16 * 16, 64);
                _tile_dpbf16ps(4, 0, 2);
                _tile_dpbf16ps(6, 1, 2);
                if (two) {
                    _tile_loadd(3, b1 + b * 16 * 16, 64);
                    _tile_dpbf16ps(5, 0, 3);
                    _tile_dpbf16ps(7, 1, 3);
                }
            }
            _tile_stored(4, c[0], 64);
            _tile_stored(6, c[2], 64);
            if (two) {
                _tile_stored(5, c[1], 64);
                _tile_stored(7, c[3], 64);
            }
            const float *scale = run_scale + j * ROWS;
            for (int r = 0; r < ROWS; r++) { /* total[r][t] += scale[r] * c[r][t] */
                const __m512 s = _mm512_set1_ps(scale[r]);
                const float *lo = c[r < 16 ? 0 : 2][r % 16], *hi = c[r < 16 ? 1 : 3][r % 16];
                _mm512_storeu_ps(total[r], _mm512_fmadd_ps(_mm512_loadu_ps(lo), s, _mm512_loadu_ps(total[r])));
                if (two)
                    _mm512_storeu_ps(total[r] + 16,
                                     _mm512_fmadd_ps(_mm512_loadu_ps(hi), s, _mm512_loadu_ps(total[r] + 16)));
            }
        }
        for (int t = 0; t < TOKENS && t0 + t < M; t++)
            for (int h = 0; h < 2 && 16 * h < rows; h++) {
                const int real = rows - 16 * h < 16 ? rows - 16 * h : 16;
                const __mmask16 mask = (__mmask16)((1u << real) - 1);
                const __m512 v = _mm512_i32gather_ps(across, &total[16 * h][t], 4);
                if (y_f32)
                    _mm512_mask_storeu_ps((float *)y + (t0 + t) * ldy + n0 + 16 * h, mask, v);
                else
                    _mm256_mask_storeu_epi16((bf16 *)y + (t0 + t) * ldy + n0 + 16 * h, mask,
                                             (__m256i)_mm512_cvtneps_pbh(v));
            }
    }
}

/* Fills `panel` (32 rows of K bfloat16 values) with weight rows [n0, n0 + 32) (zero past N)
 * and `run_scale` with their scales by run (amx_scaled_runs' layout). */
typedef void (*amx_panel_fill)(const void *ctx, int64_t n0, bf16 *panel, float *run_scale);

/* y [M, N] (float32 where y_f32, else bfloat16; rows ldy apart) = x [M, K] (bfloat16, rows
 * ldx apart) times the weight `fill` decodes, 32 rows at a time into each thread's panel,
 * with `nruns` runs of inputs ending at run_end (amx_scaled_runs), on `num_threads`
 * OpenMP threads splitting the 32-row blocks. K a multiple of 32. Returns 0; 1 where
 * scratch (the tokens, 2 bytes an input padded to 32 tokens; a 32 x K panel and the runs'
 * scales a thread) could not be allocated; 2 where the process may not use the tiles. */
static inline int amx_panel_product(const bf16 *x, int64_t ldx, int64_t M, int64_t N, int64_t K, int64_t nruns,
                                    const int64_t *run_end, amx_panel_fill fill, const void *ctx, void *y,
                                    int y_f32, int64_t ldy, int num_threads) {
    if (M <= 0 || !tiles_permitted()) return 2;
    const int64_t groups = (M + TOKENS - 1) / TOKENS * 2, blocks = (N + ROWS - 1) / ROWS;
    uint32_t *xv = malloc(sizeof(uint32_t) * (size_t)groups * (size_t)(K / 2) * 16);
    if (xv == NULL) return 1;
    tokens_to_pairs(x, ldx, M, K, groups, xv);
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        bf16 *panel = malloc(sizeof(bf16) * ROWS * (size_t)K);
        float *run_scale = malloc(sizeof(float) * ROWS * (size_t)nruns);
        if (panel == NULL || run_scale == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
            configure_tiles();
#pragma omp for schedule(static)
            for (int64_t b = 0; b < blocks; b++) {
                const int64_t n0 = b * ROWS;
                fill(ctx, n0, panel, run_scale);
                amx_scaled_runs(panel, K, xv, M, n0, (int)(N - n0 < ROWS ? N - n0 : ROWS), nruns, run_end, run_scale,
                                y, y_f32, ldy);
            }
            _tile_release();
        }
        free(panel);
        free(run_scale);
    }
    free(xv);
    return failed;
}

#endif
