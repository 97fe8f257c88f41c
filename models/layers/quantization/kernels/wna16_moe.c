/* A decode batch's int4/int8 experts in one call: quantization/wna16_moe.py's
 * `WNA16MoEMethod` hands a FusedMoE's whole step here (up to its MAX_KERNEL_TOKENS
 * tokens), so the step reads the routing from tensors, not on the host, and records and
 * replays as a CPU graph (as cpu_moe.c does for bfloat16 experts, gguf_moe.c for GGUF).
 *
 * The pairs (token, k) are sorted by local expert (a stable counting sort; pairs of
 * another rank's expert, -1 in expert_map, are skipped); each active expert's tokens are
 * gathered once as float32, multiplied by its gate/up weight and, after silu(gate) * up,
 * by its down weight, both with wna16_gemv (wna16_cpu.c) on the expert's WNA16 layout
 * (stacked: expert e's codes, scales and zero points at e times each stride; one
 * block_group per weight; no input permutation), and each pair's output, times its
 * routing weight, is added to its token's row of y, expert after expert in local order:
 * the sums do not depend on the thread count.
 *
 * Returns 0; -1 for an expert id outside [0, num_experts) or one the map sends past
 * num_local; -3 when scratch cannot be allocated. Memory for the call: the pairs'
 * gathered rows, gate/up products, activations and outputs (float32). */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../fused_moe/expert_pairs.h"

#include "../../../../distributed/bf16_convert.h"
#include "../../../../distributed/fp16_convert.h"

int wna16_gemv(int bits, const uint8_t *wq, const void *scales, int scale_dtype, const uint8_t *zeros,
               const int32_t *block_group, int64_t n_rows, int64_t kp, int64_t g_count, const float *x, int64_t ldx,
               int64_t m, float *y, int64_t ldy, int num_threads);

/* One stacked weight: expert e's codes at q + e * q_stride (bytes), scales at
 * s + e * s_stride (bytes, scale_dtype's), zero points at z + e * z_stride. */
typedef struct {
    const uint8_t *q;
    int64_t q_stride;
    const uint8_t *s;
    int64_t s_stride;
    int scale_dtype;
    const uint8_t *z;
    int64_t z_stride;
    const int32_t *block_group;
    int64_t rows, kp, groups;
} stack_t;

static int gemv(const stack_t *w, int bits, int64_t e, const float *x, int64_t m, float *y, int threads) {
    return wna16_gemv(bits, w->q + e * w->q_stride, w->s + e * w->s_stride, w->scale_dtype, w->z + e * w->z_stride,
                      w->block_group, w->rows, w->kp, w->groups, x, w->kp, m, y, w->rows, threads);
}

/* w13 [2 * inter, hidden] and w2 [hidden, inter] per expert (`bits` wide codes); x [tokens,
 * hidden] (x_dtype 0 float32, 1 bfloat16, 2 float16; row stride ldx); topk_ids int64 and
 * topk_weights float32 [tokens, top_k], contiguous; expert_map int64 [num_experts] or NULL;
 * y [tokens, hidden] float32. */
int wna16_moe(int bits, const uint8_t *q13, int64_t q13_stride, const uint8_t *s13, int64_t s13_stride,
              int scale_dtype13, const uint8_t *z13, int64_t z13_stride, const int32_t *bg13, int64_t g13,
              const uint8_t *q2, int64_t q2_stride, const uint8_t *s2, int64_t s2_stride, int scale_dtype2,
              const uint8_t *z2, int64_t z2_stride, const int32_t *bg2, int64_t g2, int64_t hidden, int64_t inter,
              const void *x, int x_dtype, int64_t ldx, int64_t tokens, const int64_t *topk_ids,
              const float *topk_weights, int64_t top_k, const int64_t *expert_map, int64_t num_experts,
              int64_t num_local, float *y, int num_threads) {
    const stack_t w13 = {q13, q13_stride, s13, s13_stride, scale_dtype13, z13, z13_stride, bg13, 2 * inter, hidden,
                         g13};
    const stack_t w2 = {q2, q2_stride, s2, s2_stride, scale_dtype2, z2, z2_stride, bg2, hidden, inter, g2};
    const int64_t pairs = tokens * top_k;
    expert_scratch_t sc;
    const int failed = expert_scratch(&sc, topk_ids, pairs, expert_map, num_experts, num_local, hidden, inter,
                                      sizeof(float));
    if (failed) return failed;
    const int64_t *start = sc.start, *order = sc.order;
    float *xg = sc.x, *gu = sc.gu, *act = sc.act, *out = sc.out;
    memset(y, 0, sizeof(float) * (size_t)tokens * (size_t)hidden);
    for (int64_t e = 0; e < num_local; ++e) {
        const int64_t first = start[e], n = start[e + 1] - first;
        if (n == 0) continue;
        for (int64_t i = 0; i < n; ++i) {
            const int64_t t = order[first + i] / top_k;
            float *row = xg + i * hidden;
            if (x_dtype == 0) {
                memcpy(row, (const float *)x + t * ldx, sizeof(float) * (size_t)hidden);
            } else {
                const uint16_t *src = (const uint16_t *)x + t * ldx;
                for (int64_t h = 0; h < hidden; ++h) row[h] = x_dtype == 1 ? bf16_to_float(src[h]) : fp16_to_float(src[h]);
            }
        }
        int status = gemv(&w13, bits, e, xg, n, gu, num_threads);
        if (status == 0) {
            silu_and_mul(gu, n, inter, act);
            status = gemv(&w2, bits, e, act, n, out, num_threads);
        }
        if (status) {
            free_expert_scratch(&sc);
            return -3; /* the GEMV's only failure: its scratch */
        }
        add_expert_outputs(order + first, n, top_k, topk_weights, out, hidden, y);
    }
    free_expert_scratch(&sc);
    return 0;
}
