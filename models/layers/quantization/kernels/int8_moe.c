/* A decode batch's W8A8 int8 experts in one call: quantization/int8_moe.py's
 * `Int8MoEMethod` hands a FusedMoE's whole step here (up to its MAX_KERNEL_TOKENS
 * tokens), so the step reads the routing from tensors, not on the host, and records and
 * replays as a CPU graph (as wna16_moe.c does for int4/int8 weight-only experts).
 *
 * The layer's tokens are quantised to int8 once, per token (int8_quantize_per_token:
 * each token's own scale, the same for every expert it meets). The pairs (token, k) are
 * sorted by local expert (expert_pairs.h; pairs of another rank's expert, -1 in
 * expert_map, are skipped) and each pair's token row gathered. Then, with AVX-512 VNNI,
 * in one parallel region: every active expert's gate/up rows in blocks of ITEM_ROWS,
 * handed out as threads finish (experts' token counts differ), meet its pairs' rows in
 * exact int32 sums (int8_vnni_rows: int8_cpu.c's register tiles); each pair's products
 * are scaled by token and row into float32, silu(gate) * up is taken and quantised per
 * pair; the down rows likewise. With AVX2 alone each expert's two products go through
 * int8_gemm_s32 in turn. Each pair's output, times its routing weight, is added to its
 * token's row of y in the pairs' sorted order (expert after expert, in local order): the
 * sums do not depend on the thread count. The steps are the dense W8A8 layers'
 * (int8_cpu.c), so an expert computes what int8_gemm.py's `int8_linear` computes on
 * per-token quantised rows, in float32.
 *
 * Returns 0; -1 for an expert id outside [0, num_experts) or one the map sends past
 * num_local; -2 where the build has no int8 GEMM (no AVX2); -3 when scratch cannot be
 * allocated. Memory for the call: the tokens and the pairs' rows in int8, the pairs'
 * int32 products and float32 gate/up products, activations and outputs. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../fused_moe/expert_pairs.h"

void int8_quantize_per_token(const void *x, int bf16, int64_t ldx, int64_t m, int64_t k, int8_t *xq, float *scale,
                             int num_threads);
void int8_scale_output(const int32_t *acc, int64_t lda, int64_t m, int64_t n, const float *x_scale,
                       const float *w_scale, const float *bias, void *out, int bf16, int64_t ldo, int num_threads);
int int8_gemm_s32(const int8_t *x, int64_t ldx, int64_t m, const int8_t *w, int64_t ldw, int64_t n, int64_t k,
                  int32_t *acc, int64_t lda, int num_threads);
int int8_has_gemm(void);
void int8_vnni_rows(const int8_t *x, int64_t ldx, int64_t m, const int32_t *xsum, const int8_t *w, int64_t ldw,
                    int64_t k, int64_t j_begin, int64_t j_end, int32_t *acc, int64_t lda);

#define ITEM_ROWS 32 /* weight rows per work item of the VNNI path (32 KiB of a 1024-wide weight) */

/* One stacked int8 weight with its scales: expert e's [rows, k] at w + e * w_stride, its
 * row scales at s + e * s_stride. */
typedef struct {
    const int8_t *w;
    int64_t w_stride;
    const float *s;
    int64_t s_stride, rows, k;
} stack_t;

/* The per-expert path (AVX2 builds): each active expert's product through int8_gemm_s32,
 * which shares its rows out over the threads. acc is [n, rows] int32 scratch. Returns
 * int8_gemm_s32's status. */
static int expert_product(const stack_t *w, int64_t e, const int8_t *xq, const float *x_scale, int64_t n,
                          int32_t *acc, float *out, int threads) {
    const int status = int8_gemm_s32(xq, w->k, n, w->w + e * w->w_stride, w->k, w->rows, w->k, acc, w->rows, threads);
    if (status == 0)
        int8_scale_output(acc, w->rows, n, w->rows, x_scale, w->s + e * w->s_stride, NULL, out, 0, w->rows, threads);
    return status;
}

/* The VNNI path's products of one stack: every active expert's rows in blocks of ITEM_ROWS,
 * handed out as threads finish (experts' token counts differ), then each pair's row
 * scaled: out [pairs, rows] float32 (pairs in sorted order). Inside a parallel region. */
static void stack_products(const stack_t *w, const int64_t *start, const int64_t *item_e, int64_t items,
                           const int8_t *xq, const int32_t *xsum, const float *x_scale, const int64_t *expert_of,
                           int64_t pairs, int32_t *acc, float *out) {
    const int64_t blocks = (w->rows + ITEM_ROWS - 1) / ITEM_ROWS;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items * blocks; ++item) {
        const int64_t e = item_e[item / blocks], j0 = (item % blocks) * ITEM_ROWS, first = start[e];
        const int64_t j1 = j0 + ITEM_ROWS < w->rows ? j0 + ITEM_ROWS : w->rows;
        int8_vnni_rows(xq + first * w->k, w->k, start[e + 1] - first, xsum + first, w->w + e * w->w_stride, w->k,
                       w->k, j0, j1, acc + first * w->rows, w->rows);
    }
#pragma omp for schedule(static)
    for (int64_t i = 0; i < pairs; ++i)
        int8_scale_output(acc + i * w->rows, w->rows, 1, w->rows, x_scale + i, w->s + expert_of[i] * w->s_stride, NULL,
                          out + i * w->rows, 0, w->rows, 1);
}

static int32_t row_sum(const int8_t *q, int64_t k) {
    int32_t s = 0;
    for (int64_t j = 0; j < k; ++j) s += q[j];
    return s;
}

/* w13 [2 * inter, hidden] and w2 [hidden, inter] int8 per expert, expert e's at e times
 * its stride (elements), with float32 scales per row (s13 [2 * inter], s2 [hidden], at e
 * times theirs); x [tokens, hidden] (x_dtype 0 float32, 1 bfloat16; row stride ldx);
 * topk_ids int64 and topk_weights float32 [tokens, top_k], contiguous; expert_map int64
 * [num_experts] or NULL; y [tokens, hidden] float32. */
int int8_moe(const int8_t *w13, int64_t w13_stride, const float *s13, int64_t s13_stride, const int8_t *w2,
             int64_t w2_stride, const float *s2, int64_t s2_stride, int64_t hidden, int64_t inter, const void *x,
             int x_dtype, int64_t ldx, int64_t tokens, const int64_t *topk_ids, const float *topk_weights,
             int64_t top_k, const int64_t *expert_map, int64_t num_experts, int64_t num_local, float *y,
             int num_threads) {
    const int isa = int8_has_gemm();
    if (isa == 0) return -2;
    const stack_t gate_up = {w13, w13_stride, s13, s13_stride, 2 * inter, hidden};
    const stack_t down = {w2, w2_stride, s2, s2_stride, hidden, inter};
    const int64_t pairs = tokens * top_k, widest = 2 * inter > hidden ? 2 * inter : hidden;
    expert_scratch_t sc;
    const int failed = expert_scratch(&sc, topk_ids, pairs, expert_map, num_experts, num_local, hidden, inter, 1);
    if (failed) return failed;
    /* int8: the tokens', then the activations' rows; float: the tokens' scales, the pairs'
     * rows' and activations' scales; int32: the pairs' products, the tokens' and the pairs'
     * sums; int64: each sorted pair's expert, the active experts */
    int8_t *xq = malloc((size_t)(tokens * hidden + pairs * inter));
    float *scales = malloc(sizeof(float) * (size_t)(tokens + 2 * pairs));
    int32_t *acc = malloc(sizeof(int32_t) * (size_t)(pairs * widest + tokens + 2 * pairs));
    int64_t *expert_of = malloc(sizeof(int64_t) * (size_t)(pairs + num_local));
    if (!xq || !scales || !acc || !expert_of) {
        free(xq), free(scales), free(acc), free(expert_of), free_expert_scratch(&sc);
        return -3;
    }
    int8_t *aq = xq + tokens * hidden, *rows = sc.x;
    float *x_scale = scales, *row_scale = scales + tokens, *a_scale = row_scale + pairs;
    int32_t *token_sum = acc + pairs * widest, *pair_sum = token_sum + tokens, *a_sum = pair_sum + pairs;
    int64_t *item_e = expert_of + pairs, items = 0;
    int8_quantize_per_token(x, x_dtype == 1, ldx, tokens, hidden, xq, x_scale, num_threads);
    for (int64_t t = 0; t < tokens; ++t) token_sum[t] = row_sum(xq + t * hidden, hidden);
    const int64_t active = sc.start[num_local]; /* pairs this rank computes */
    for (int64_t e = 0; e < num_local; ++e) {
        if (sc.start[e + 1] > sc.start[e]) item_e[items++] = e;
        for (int64_t i = sc.start[e]; i < sc.start[e + 1]; ++i) {
            const int64_t t = sc.order[i] / top_k;
            memcpy(rows + i * hidden, xq + t * hidden, (size_t)hidden);
            row_scale[i] = x_scale[t], pair_sum[i] = token_sum[t], expert_of[i] = e;
        }
    }
    int status = 0;
    if (isa == 2) {
#pragma omp parallel num_threads(num_threads)
        {
            stack_products(&gate_up, sc.start, item_e, items, rows, pair_sum, row_scale, expert_of, active, acc,
                           sc.gu);
#pragma omp for schedule(static)
            for (int64_t i = 0; i < active; ++i) {
                silu_and_mul(sc.gu + i * 2 * inter, 1, inter, sc.act + i * inter);
                int8_quantize_per_token(sc.act + i * inter, 0, inter, 1, inter, aq + i * inter, a_scale + i, 1);
                a_sum[i] = row_sum(aq + i * inter, inter);
            }
            stack_products(&down, sc.start, item_e, items, aq, a_sum, a_scale, expert_of, active, acc, sc.out);
        }
    } else {
        for (int64_t j = 0; j < items && status == 0; ++j) {
            const int64_t e = item_e[j], first = sc.start[e], n = sc.start[e + 1] - first;
            status = expert_product(&gate_up, e, rows + first * hidden, row_scale + first, n, acc,
                                    sc.gu + first * 2 * inter, num_threads);
            if (status) break;
            silu_and_mul(sc.gu + first * 2 * inter, n, inter, sc.act + first * inter);
            int8_quantize_per_token(sc.act + first * inter, 0, inter, n, inter, aq + first * inter, a_scale + first,
                                    num_threads);
            status = expert_product(&down, e, aq + first * inter, a_scale + first, n, acc, sc.out + first * hidden,
                                    num_threads);
        }
    }
    if (status == 0) {
        memset(y, 0, sizeof(float) * (size_t)tokens * (size_t)hidden);
        add_expert_outputs(sc.order, active, top_k, topk_weights, sc.out, hidden, y);
    }
    free(xq), free(scales), free(acc), free(expert_of), free_expert_scratch(&sc);
    return status ? -3 : 0; /* the GEMM's only failure: its scratch */
}
