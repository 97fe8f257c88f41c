/* A decode batch's GGUF experts in one call: gguf_moe.py's `GGUFMoEMethod` hands a
 * FusedMoE's whole step here (up to its MAX_TOKENS tokens), so the step reads the routing
 * from tensors, not on the host, and records and replays as a CPU graph (as cpu_moe.c
 * does for bfloat16 experts).
 *
 * The pairs (token, k) of the batch are sorted by local expert (a stable counting sort;
 * pairs of another rank's expert, -1 in expert_map, are skipped); each active expert's
 * tokens are gathered once (a lone token is read where it is), and every expert's
 * gate/up products are one gguf_gemm_q8_groups call, its down products after silu(gate)
 * * up in float32 another (the dense layers' int8-activation products: x quantised as
 * llama.cpp quantises it, K-quant activations per 256 values however many tokens an
 * expert gets, KQUANT_CHUNK; one parallel loop over every expert's rows, where a call
 * per expert paid a thread team's start and end barrier for each: the Qwen3-MoE bench
 * model's one-token steps, 4 experts a layer, took 1.07x (Q8_0) and 1.11x (Q4_K_M) as
 * long in the experts that way, 2026-12-07, the Zen 4 VM). Each pair's output, times its routing weight, is added to
 * its token's row of y, expert after expert in local order: the sums do not depend on
 * the thread count.
 *
 * Returns 0; -1 for an expert id outside [0, num_experts) or one the map sends past
 * num_local; -2 where this build has no int8 products (nothing written: the caller
 * groups in torch); -3 when scratch cannot be allocated. Memory for the call: the pairs'
 * gathered rows (x's dtype), their gate/up products, activations and outputs (float32). */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../fused_moe/expert_pairs.h"
#include "gguf_blocks.h"

int gguf_gemm_q8_groups(int n, const int *qtypes, const uint8_t *const *w, const int64_t *rows,
                        const int64_t *row_bytes, int64_t k, const void *const *x, const int64_t *m, int x_dtype,
                        int64_t ldx, void *const *y, int y_dtype, int64_t ldy, int num_threads);

#ifdef GGUF_INT8_AVX2
/* gguf_avx2.c's products quantise K-quant activations per 32 values for groups of 8
 * tokens or more (its KQ_PER32_TOKENS, for the prefill's and dense batches' sake), at 1.8x
 * the time a token of per-256 ones take; an expert's share of a decode batch is cut into
 * groups of 7 tokens at most, so each is quantised per 256, as a one-token decode's are
 * (gguf_vnni.c's always are). */
#define KQUANT_CHUNK 7
#else
#define KQUANT_CHUNK 0
#endif

/* One phase's groups (gguf_gemm_q8_groups' arrays): an expert's tokens, or a run of them. */
typedef struct {
    const uint8_t **w;
    const void **x;
    void **y;
    int64_t *rows, *row_bytes, *m;
    int *qtypes;
    int n;
} groups_t;

static int groups_alloc(groups_t *g, int64_t capacity) {
    const size_t each = 3 * sizeof(void *) + 3 * sizeof(int64_t) + sizeof(int);
    const int64_t c = capacity > 0 ? capacity : 1;
    uint8_t *p = malloc(each * (size_t)c);
    g->w = (const uint8_t **)p;
    g->x = (const void **)(g->w + c);
    g->y = (void **)(g->x + c);
    g->rows = (int64_t *)(g->y + c);
    g->row_bytes = g->rows + c;
    g->m = g->row_bytes + c;
    g->qtypes = (int *)(g->m + c);
    g->n = 0;
    return p ? 0 : -3;
}

/* Appends one expert's rows (`rows` rows of `type` blocks at we) times its pairs [first,
 * first + n): their inputs are rows of xs (xs_row bytes apart, indexed by pair), their
 * outputs rows of ys (ys_row floats apart). A K-quant expert's pairs go KQUANT_CHUNK at a
 * time where that is set. A group of one pair reads its token's row of x itself where x
 * is given (x_row bytes apart): so the experts of a one-token step share one input, which
 * gguf_gemm_q8_groups quantises once. */
static void add_groups(groups_t *g, int type, const uint8_t *we, int64_t rows, int64_t row_bytes, int64_t first,
                       int64_t n, const uint8_t *xs, size_t xs_row, float *ys, int64_t ys_row, const uint8_t *x,
                       size_t x_row, const int64_t *order, int64_t top_k) {
    const int kquant = type == T_Q4_K || type == T_Q5_K || type == T_Q6_K;
    const int64_t chunk = KQUANT_CHUNK && kquant ? KQUANT_CHUNK : n;
    for (int64_t t0 = 0; t0 < n; t0 += chunk) {
        const int i = g->n++;
        const int64_t p = first + t0;
        g->qtypes[i] = type;
        g->w[i] = we;
        g->rows[i] = rows;
        g->row_bytes[i] = row_bytes;
        g->m[i] = n - t0 < chunk ? n - t0 : chunk;
        g->x[i] = g->m[i] == 1 && x ? x + (size_t)(order[p] / top_k) * x_row : xs + (size_t)p * xs_row;
        g->y[i] = ys + p * ys_row;
    }
}

static int run_groups(const groups_t *g, int64_t k, int x_dtype, int64_t ldx, int64_t ldy, int num_threads) {
    return gguf_gemm_q8_groups(g->n, g->qtypes, g->w, g->rows, g->row_bytes, k, g->x, g->m, x_dtype, ldx,
                               (void *const *)g->y, 0, ldy, num_threads);
}

/* w13: expert e's gate then up rows at w13 + e * w13_expert_bytes, [2 * inter, w13_row_bytes];
 * w2: its down rows [hidden, w2_row_bytes]. x [tokens, hidden] (x_dtype 0 float32, 1
 * bfloat16, 2 float16; row stride ldx); topk_ids int64 and topk_weights float32 [tokens,
 * top_k], contiguous; expert_map int64 [num_experts] or NULL; y [tokens, hidden] float32. */
int gguf_moe_q8(int type13, const uint8_t *w13, int64_t w13_expert_bytes, int64_t w13_row_bytes, int type2,
                const uint8_t *w2, int64_t w2_expert_bytes, int64_t w2_row_bytes, int64_t hidden, int64_t inter,
                const void *x, int x_dtype, int64_t ldx, int64_t tokens, const int64_t *topk_ids,
                const float *topk_weights, int64_t top_k, const int64_t *expert_map, int64_t num_experts,
                int64_t num_local, float *y, int num_threads) {
    const int64_t pairs = tokens * top_k;
    const size_t elem = x_dtype == 0 ? 4 : 2;
    expert_scratch_t sc;
    const int failed = expert_scratch(&sc, topk_ids, pairs, expert_map, num_experts, num_local, hidden, inter, elem);
    if (failed) return failed;
    groups_t g13, g2;
    int status = groups_alloc(&g13, pairs) | groups_alloc(&g2, pairs);
    const int64_t *start = sc.start, *order = sc.order, rows13 = 2 * inter, rows2 = hidden;
    for (int64_t e = 0; e < num_local && status == 0; ++e) {
        const int64_t first = start[e], n = start[e + 1] - first;
        for (int64_t i = first; n > 1 && i < start[e + 1]; ++i) /* (a lone token is read where it is) */
            memcpy(sc.x + (size_t)i * (size_t)hidden * elem,
                   (const uint8_t *)x + (size_t)(order[i] / top_k) * (size_t)ldx * elem, (size_t)hidden * elem);
        add_groups(&g13, type13, w13 + e * w13_expert_bytes, rows13, w13_row_bytes, first, n, sc.x,
                   (size_t)hidden * elem, sc.gu, rows13, x, (size_t)ldx * elem, order, top_k);
        add_groups(&g2, type2, w2 + e * w2_expert_bytes, rows2, w2_row_bytes, first, n, (const uint8_t *)sc.act,
                   (size_t)inter * sizeof(float), sc.out, rows2, NULL, 0, order, top_k);
    }
    if (status == 0) status = run_groups(&g13, hidden, x_dtype, hidden, rows13, num_threads);
    if (status == 0) {
        silu_and_mul(sc.gu, start[num_local], inter, sc.act);
        status = run_groups(&g2, inter, 0, inter, rows2, num_threads);
    }
    if (status == 0) {
        memset(y, 0, sizeof(float) * (size_t)tokens * (size_t)hidden);
        for (int64_t e = 0; e < num_local; ++e)
            add_expert_outputs(order + start[e], start[e + 1] - start[e], top_k, topk_weights,
                               sc.out + start[e] * hidden, hidden, y);
    }
    free(g13.w);
    free(g2.w);
    free_expert_scratch(&sc);
    return status;
}
