/* A decode batch's GGUF experts in one call: gguf_moe.py's `GGUFMoEMethod` hands a
 * FusedMoE's whole step here (up to its MAX_TOKENS tokens), so the step reads the routing
 * from tensors, not on the host, and records and replays as a CPU graph (as cpu_moe.c
 * does for bfloat16 experts).
 *
 * The pairs (token, k) of the batch are sorted by local expert (a stable counting sort;
 * pairs of another rank's expert, -1 in expert_map, are skipped); each active expert's
 * tokens are gathered once, multiplied by its gate/up blocks and, after silu(gate) * up
 * in float32, by its down blocks, both with gguf_gemm_q8_shards (the dense layers'
 * int8-activation products: x quantised as llama.cpp quantises it, K-quant activations
 * per 256 values however many tokens an expert gets: `products_by_256`), and each pair's
 * output, times its routing weight, is added to its token's row of y, expert after
 * expert in local order: the sums do not depend on the thread count.
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

int gguf_gemm_q8_shards(int n, const int *qtypes, const uint8_t *const *w, const int64_t *rows,
                        const int64_t *row_bytes, int64_t k, const void *x, int x_dtype, int64_t ldx, int64_t m,
                        void *y, int y_dtype, int64_t ldy, int num_threads);

#ifdef GGUF_INT8_AVX2
/* gguf_avx2.c's products quantise K-quant activations per 32 values from 8 tokens on (its
 * KQ_PER32_TOKENS, for the prefill's and dense batches' sake), at 1.8x the time a token of
 * per-256 ones take; an expert's share of a decode batch is taken 7 tokens at a time, so
 * each is quantised per 256, as a one-token decode's are (gguf_vnni.c's always are). */
#define KQUANT_CHUNK 7
#else
#define KQUANT_CHUNK 0
#endif

/* y [n, rows] float32 = x [n, k] (x_dtype, contiguous rows) times one expert's blocks:
 * gguf_gemm_q8_shards, K-quant rows KQUANT_CHUNK tokens at a time where that is set. */
static int products_by_256(int type, const uint8_t *w, int64_t rows, int64_t row_bytes, int64_t k, const void *x,
                           int x_dtype, int64_t n, float *y, int num_threads) {
    const int64_t chunk = KQUANT_CHUNK && (type == T_Q4_K || type == T_Q5_K || type == T_Q6_K) ? KQUANT_CHUNK : n;
    const size_t elem = x_dtype == 0 ? 4 : 2;
    for (int64_t t0 = 0; t0 < n; t0 += chunk) {
        const int status = gguf_gemm_q8_shards(1, &type, &w, &rows, &row_bytes, k,
                                               (const uint8_t *)x + (size_t)(t0 * k) * elem, x_dtype, k,
                                               n - t0 < chunk ? n - t0 : chunk, y + t0 * rows, 0, rows, num_threads);
        if (status) return status;
    }
    return 0;
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
    const int64_t *start = sc.start, *order = sc.order;
    uint8_t *xg = sc.x;
    float *gu = sc.gu, *act = sc.act, *out = sc.out;
    memset(y, 0, sizeof(float) * (size_t)tokens * (size_t)hidden);
    const int64_t rows13 = 2 * inter, rows2 = hidden;
    for (int64_t e = 0; e < num_local; ++e) {
        const int64_t first = start[e], n = start[e + 1] - first;
        if (n == 0) continue;
        for (int64_t i = 0; i < n; ++i)
            memcpy(xg + (size_t)i * (size_t)hidden * elem,
                   (const uint8_t *)x + (size_t)(order[first + i] / top_k) * (size_t)ldx * elem, (size_t)hidden * elem);
        const uint8_t *we13 = w13 + e * w13_expert_bytes, *we2 = w2 + e * w2_expert_bytes;
        int status = products_by_256(type13, we13, rows13, w13_row_bytes, hidden, xg, x_dtype, n, gu, num_threads);
        if (status == 0) {
            silu_and_mul(gu, n, inter, act);
            status = products_by_256(type2, we2, rows2, w2_row_bytes, inter, act, 0, n, out, num_threads);
        }
        if (status) {
            free_expert_scratch(&sc);
            return status;
        }
        add_expert_outputs(order + first, n, top_k, topk_weights, out, hidden, y);
    }
    free_expert_scratch(&sc);
    return 0;
}
