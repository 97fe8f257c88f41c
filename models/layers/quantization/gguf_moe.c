/* A decode batch's GGUF experts in one call: gguf_moe.py's `GGUFMoEMethod` hands a
 * FusedMoE's whole step here (up to its MAX_TOKENS tokens), so the step reads the routing
 * from tensors, not on the host, and records and replays as a CPU graph (as cpu_moe.c
 * does for bfloat16 experts).
 *
 * The pairs (token, k) of the batch are sorted by local expert (a stable counting sort;
 * pairs of another rank's expert, -1 in expert_map, are skipped); each active expert's
 * tokens are gathered once, multiplied by its gate/up blocks and, after silu(gate) * up
 * in float32, by its down blocks, both with gguf_gemm_q8_shards (the dense layers'
 * int8-activation products: x quantised as llama.cpp quantises it), and each pair's
 * output, times its routing weight, is added to its token's row of y, expert after
 * expert in local order: the sums do not depend on the thread count.
 *
 * Returns 0; -1 for an expert id outside [0, num_experts) or one the map sends past
 * num_local; -2 where this build has no int8 products (nothing written: the caller
 * groups in torch); -3 when scratch cannot be allocated. Memory for the call: the pairs'
 * gathered rows (x's dtype), their gate/up products, activations and outputs (float32). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int gguf_gemm_q8_shards(int n, const int *qtypes, const uint8_t *const *w, const int64_t *rows,
                        const int64_t *row_bytes, int64_t k, const void *x, int x_dtype, int64_t ldx, int64_t m,
                        void *y, int y_dtype, int64_t ldy, int num_threads);

static void release(void *a, void *b, void *c, void *d, void *e, void *f) {
    free(a), free(b), free(c), free(d), free(e), free(f);
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
    int64_t *local = malloc(sizeof(int64_t) * (size_t)(pairs + num_local + 1) + sizeof(int64_t) * (size_t)pairs);
    uint8_t *xg = malloc((size_t)pairs * (size_t)hidden * elem);
    float *gu = malloc(sizeof(float) * (size_t)pairs * 2 * (size_t)inter);
    float *act = malloc(sizeof(float) * (size_t)pairs * (size_t)inter);
    float *out = malloc(sizeof(float) * (size_t)pairs * (size_t)hidden);
    if (!local || !xg || !gu || !act || !out) {
        release(local, xg, gu, act, out, NULL);
        return -3;
    }
    int64_t *start = local + pairs, *order = start + num_local + 1;
    memset(start, 0, sizeof(int64_t) * (size_t)(num_local + 1));
    for (int64_t p = 0; p < pairs; ++p) {
        const int64_t id = topk_ids[p];
        const int64_t e = id < 0 || id >= num_experts ? -2 : expert_map ? expert_map[id] : id;
        if (e < -1 || e >= num_local) {
            release(local, xg, gu, act, out, NULL);
            return -1;
        }
        local[p] = e;
        if (e >= 0) ++start[e + 1];
    }
    for (int64_t e = 0; e < num_local; ++e) start[e + 1] += start[e];
    for (int64_t p = 0; p < pairs; ++p) /* stable: pairs keep their order within an expert */
        if (local[p] >= 0) order[start[local[p]]++] = p;
    for (int64_t e = num_local; e > 0; --e) start[e] = start[e - 1]; /* back to each expert's first */
    start[0] = 0;
    memset(y, 0, sizeof(float) * (size_t)tokens * (size_t)hidden);
    const int64_t rows13 = 2 * inter, rows2 = hidden;
    for (int64_t e = 0; e < num_local; ++e) {
        const int64_t first = start[e], n = start[e + 1] - first;
        if (n == 0) continue;
        for (int64_t i = 0; i < n; ++i)
            memcpy(xg + (size_t)i * (size_t)hidden * elem,
                   (const uint8_t *)x + (size_t)(order[first + i] / top_k) * (size_t)ldx * elem, (size_t)hidden * elem);
        const uint8_t *we13 = w13 + e * w13_expert_bytes, *we2 = w2 + e * w2_expert_bytes;
        int status = gguf_gemm_q8_shards(1, &type13, &we13, &rows13, &w13_row_bytes, hidden, xg, x_dtype, hidden, n,
                                         gu, 0, rows13, num_threads);
        for (int64_t i = 0; status == 0 && i < n; ++i) {
            const float *g = gu + i * rows13, *u = g + inter;
            float *a = act + i * inter;
            for (int64_t j = 0; j < inter; ++j) a[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
        }
        if (status == 0)
            status = gguf_gemm_q8_shards(1, &type2, &we2, &rows2, &w2_row_bytes, inter, act, 0, inter, n, out, 0,
                                         hidden, num_threads);
        if (status) {
            release(local, xg, gu, act, out, NULL);
            return status;
        }
        for (int64_t i = 0; i < n; ++i) {
            const int64_t p = order[first + i];
            const float weight = topk_weights[p], *o = out + i * hidden;
            float *yt = y + (p / top_k) * hidden;
            for (int64_t h = 0; h < hidden; ++h) yt[h] += weight * o[h];
        }
    }
    release(local, xg, gu, act, out, NULL);
    return 0;
}
