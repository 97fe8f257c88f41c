/* A decode batch's fp8 experts in one call: fp8_moe.py's `Fp8MoEMethod` hands a FusedMoE's
 * whole step here (up to its MAX_KERNEL_TOKENS tokens), so the step reads the routing from
 * tensors, not on the host, and records and replays as a CPU graph (as cpu_moe.c does for
 * bfloat16 experts).
 *
 * The pairs (token, k) are sorted by local expert (fused_moe/expert_pairs.h; pairs of
 * another rank's expert, -1 in expert_map, are skipped). bfloat16 tokens on an AVX-512
 * BF16 build (`experts_bf16`): the pairs' rows gathered once, then in one parallel region
 * every active expert's gate/up rows in blocks of ITEM_ROWS, handed out as threads
 * finish, meet its pairs' rows by bfloat16 dot products of the bytes' exact values
 * (fp8_bf16.c, exact: each k-block's float32 sums times its scale), silu(gate) * up is
 * taken and rounded to bfloat16, the down rows likewise. Otherwise each active expert's
 * tokens are gathered as float32 and multiplied by its gate/up bytes and, after
 * silu(gate) * up, by its down bytes with fp8_gemv (fp8_kernels.c, at most
 * GEMV_MAX_ROWS tokens a call: more in chunks), one expert after another. Each pair's
 * output, times its routing weight, is added to its token's row of y in the pairs'
 * sorted order (expert after expert, in local order): the sums do not depend on the
 * thread count.
 *
 * Returns 0; -1 for an expert id outside [0, num_experts) or one the map sends past
 * num_local; -3 when scratch cannot be allocated. Memory for the call: the pairs'
 * gathered rows, gate/up products, activations and outputs (float32). */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../../distributed/bf16_convert.h"
#include "../fused_moe/expert_pairs.h"

#define GEMV_ROWS 16 /* fp8_kernels.c's GEMV_MAX_ROWS */

int fp8_gemv(const float *x, int64_t x_stride, int64_t M, const uint8_t *w, int64_t w_stride, int64_t N, int64_t K,
             const float *scale, int64_t scale_stride, int64_t block_n, int64_t block_k, int dtype, void *out,
             int64_t out_stride, int num_threads);

/* One stacked weight: expert e's [rows, cols] bytes at w + e * w_stride, its float32 scales
 * at s + e * s_stride, s_row floats a row of scale blocks of bn x bk values. */
typedef struct {
    const uint8_t *w;
    int64_t w_stride;
    const float *s;
    int64_t s_stride, s_row, bn, bk, rows, cols;
} fp8_stack_t;

int fp8_has_bf16_linear(void);
void fp8_bf16_rows(const uint16_t *x, int64_t ldx, int64_t M, const uint8_t *w, int64_t w_stride, int64_t N, int64_t K,
                   const float *scale, int64_t scale_stride, int64_t block_n, int64_t block_k, int round_weights,
                   int64_t n0, int64_t n1, void *y, int y_f32, int64_t ldy, uint16_t *panel);

#define ITEM_ROWS 32 /* weight rows per work item of the bfloat16 path */

/* y [m, rows] = x [m, cols] times expert e's weight, GEMV_ROWS tokens a call. */
static void product(const fp8_stack_t *w, int64_t e, const float *x, int64_t m, float *y, int threads) {
    for (int64_t t0 = 0; t0 < m; t0 += GEMV_ROWS)
        fp8_gemv(x + t0 * w->cols, w->cols, m - t0 < GEMV_ROWS ? m - t0 : GEMV_ROWS, w->w + e * w->w_stride, w->cols,
                 w->rows, w->cols, w->s + e * w->s_stride, w->s_row, w->bn, w->bk, 0, y + t0 * w->rows, w->rows,
                 threads);
}

/* Whether fp8_bf16_rows takes stack w: an AVX-512 BF16 build, and k-blocks of a multiple
 * of 32 inputs (or one a row). */
static int bf16_rows_take(const fp8_stack_t *w) { return w->bk % 32 == 0 || w->bk >= w->cols; }

/* The bfloat16 path's products of one stack: every active expert's rows in blocks of
 * ITEM_ROWS, handed out as threads finish (experts' token counts differ), each block
 * against its expert's pairs' bfloat16 rows x (fp8_bf16_rows, exact), into out [pairs,
 * rows] float32 (pairs in sorted order). Inside a parallel region; panel is the
 * thread's scratch. */
static void stack_products_bf16(const fp8_stack_t *w, const int64_t *start, const int64_t *item_e, int64_t items,
                                const uint16_t *x, float *out, uint16_t *panel) {
    const int64_t blocks = (w->rows + ITEM_ROWS - 1) / ITEM_ROWS;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items * blocks; ++item) {
        const int64_t e = item_e[item / blocks], j0 = (item % blocks) * ITEM_ROWS, first = start[e];
        const int64_t j1 = j0 + ITEM_ROWS < w->rows ? j0 + ITEM_ROWS : w->rows;
        fp8_bf16_rows(x + first * w->cols, w->cols, start[e + 1] - first, w->w + e * w->w_stride, w->cols, w->rows,
                      w->cols, w->s + e * w->s_stride, w->s_row, w->bn, w->bk, 0, j0, j1, out + first * w->rows, 1,
                      w->rows, panel);
    }
}

/* The step with bfloat16 tokens on an AVX-512 BF16 build: the pairs' rows gathered once,
 * then in one parallel region every active expert's gate/up rows (stack_products_bf16),
 * silu(gate) * up rounded to bfloat16 (the input of the down product, as between a
 * dense MLP's two layers), and the down rows; the outputs in sc->out. Returns 0, or -3
 * without memory. */
static int experts_bf16(const fp8_stack_t *g13, const fp8_stack_t *g2, const expert_scratch_t *sc,
                        const uint16_t *x, int64_t ldx, int64_t top_k, int64_t num_local, int num_threads) {
    const int64_t hidden = g13->cols, inter = g2->cols, active = sc->start[num_local];
    uint16_t *rows = sc->x, *act = malloc(sizeof(uint16_t) * (size_t)(active * inter));
    int64_t *item_e = malloc(sizeof(int64_t) * (size_t)num_local), items = 0;
    if (!act || !item_e) {
        free(act), free(item_e);
        return -3;
    }
    for (int64_t e = 0; e < num_local; ++e) {
        if (sc->start[e + 1] > sc->start[e]) item_e[items++] = e;
        for (int64_t i = sc->start[e]; i < sc->start[e + 1]; ++i)
            memcpy(rows + i * hidden, x + (sc->order[i] / top_k) * ldx, sizeof(uint16_t) * (size_t)hidden);
    }
    const int64_t widest = hidden > inter ? hidden : inter;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        uint16_t *panel = malloc(sizeof(uint16_t) * 4 * (size_t)widest);
        if (!panel) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
            stack_products_bf16(g13, sc->start, item_e, items, rows, sc->gu, panel);
#pragma omp for schedule(static)
            for (int64_t i = 0; i < active; ++i) {
                silu_and_mul(sc->gu + i * 2 * inter, 1, inter, sc->act + i * inter);
                for (int64_t j = 0; j < inter; ++j) act[i * inter + j] = float_to_bf16(sc->act[i * inter + j]);
            }
            stack_products_bf16(g2, sc->start, item_e, items, act, sc->out, panel);
        }
        free(panel);
    }
    free(act), free(item_e);
    return failed ? -3 : 0;
}

/* w13 [2 * inter, hidden] and w2 [hidden, inter] e4m3 bytes per expert with their scales
 * (s13: s13_row floats per row of bn13 x bk13 blocks, s13_stride per expert; s2 alike);
 * x [tokens, hidden] (x_dtype 0 float32, 1 bfloat16; row stride ldx); topk_ids int64 and
 * topk_weights float32 [tokens, top_k], contiguous; expert_map int64 [num_experts] or NULL;
 * y [tokens, hidden] float32. */
int fp8_moe(const uint8_t *w13, int64_t w13_stride, const float *s13, int64_t s13_stride, int64_t s13_row,
            int64_t bn13, int64_t bk13, const uint8_t *w2, int64_t w2_stride, const float *s2, int64_t s2_stride,
            int64_t s2_row, int64_t bn2, int64_t bk2, int64_t hidden, int64_t inter, const void *x, int x_dtype,
            int64_t ldx, int64_t tokens, const int64_t *topk_ids, const float *topk_weights, int64_t top_k,
            const int64_t *expert_map, int64_t num_experts, int64_t num_local, float *y, int num_threads) {
    const fp8_stack_t g13 = {w13, w13_stride, s13, s13_stride, s13_row, bn13, bk13, 2 * inter, hidden};
    const fp8_stack_t g2 = {w2, w2_stride, s2, s2_stride, s2_row, bn2, bk2, hidden, inter};
    expert_scratch_t sc;
    const int failed = expert_scratch(&sc, topk_ids, tokens * top_k, expert_map, num_experts, num_local, hidden,
                                      inter, sizeof(float));
    if (failed) return failed;
    if (x_dtype == 1 && fp8_has_bf16_linear() && bf16_rows_take(&g13) && bf16_rows_take(&g2)) {
        const int status = experts_bf16(&g13, &g2, &sc, (const uint16_t *)x, ldx, top_k, num_local, num_threads);
        if (status == 0) {
            memset(y, 0, sizeof(float) * (size_t)tokens * (size_t)hidden);
            add_expert_outputs(sc.order, sc.start[num_local], top_k, topk_weights, sc.out, hidden, y);
        }
        free_expert_scratch(&sc);
        return status;
    }
    float *xg = sc.x;
    memset(y, 0, sizeof(float) * (size_t)tokens * (size_t)hidden);
    for (int64_t e = 0; e < num_local; ++e) {
        const int64_t first = sc.start[e], n = sc.start[e + 1] - first;
        if (n == 0) continue;
        for (int64_t i = 0; i < n; ++i) {
            const int64_t t = sc.order[first + i] / top_k;
            float *row = xg + i * hidden;
            if (x_dtype == 0) {
                memcpy(row, (const float *)x + t * ldx, sizeof(float) * (size_t)hidden);
            } else {
                const uint16_t *src = (const uint16_t *)x + t * ldx;
                for (int64_t h = 0; h < hidden; ++h) row[h] = bf16_to_float(src[h]);
            }
        }
        product(&g13, e, xg, n, sc.gu, num_threads);
        silu_and_mul(sc.gu, n, inter, sc.act);
        product(&g2, e, sc.act, n, sc.out, num_threads);
        add_expert_outputs(sc.order + first, n, top_k, topk_weights, sc.out, hidden, y);
    }
    free_expert_scratch(&sc);
    return 0;
}
