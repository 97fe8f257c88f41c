/* A decode batch's fp8 experts in one call: fp8_moe.py's `Fp8MoEMethod` hands a FusedMoE's
 * whole step here (up to its MAX_KERNEL_TOKENS tokens), so the step reads the routing from
 * tensors, not on the host, and records and replays as a CPU graph (as cpu_moe.c does for
 * bfloat16 experts).
 *
 * The pairs (token, k) are sorted by local expert (fused_moe/expert_pairs.h; pairs of
 * another rank's expert, -1 in expert_map, are skipped); each active expert's tokens are
 * gathered once as float32 and multiplied by its gate/up bytes and, after silu(gate) *
 * up, by its down bytes with fp8_gemv (fp8_kernels.c, at most GEMV_MAX_ROWS tokens a
 * call: more in chunks), and each pair's output, times its routing weight, is added to
 * its token's row of y, expert after expert in local order: the sums do not depend on
 * the thread count.
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

/* y [m, rows] = x [m, cols] times expert e's weight, GEMV_ROWS tokens a call. */
static void product(const fp8_stack_t *w, int64_t e, const float *x, int64_t m, float *y, int threads) {
    for (int64_t t0 = 0; t0 < m; t0 += GEMV_ROWS)
        fp8_gemv(x + t0 * w->cols, w->cols, m - t0 < GEMV_ROWS ? m - t0 : GEMV_ROWS, w->w + e * w->w_stride, w->cols,
                 w->rows, w->cols, w->s + e * w->s_stride, w->s_row, w->bn, w->bk, 0, y + t0 * w->rows, w->rows,
                 threads);
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
