/* A mixture-of-experts block's experts in one C call (cpu_moe_bf16), for bfloat16: the
 * grouping grouped_moe.py does in torch (pairs sorted by expert, each active expert's
 * gate/up and down products over its tokens, the routed weights, the sum back into each
 * token), with no host read of the counts in between, so a decode step that holds it can
 * be recorded and replayed (worker/cpu_graph.py). Its contract is in cpu_moe.py, which
 * compiles it and is its only caller.
 *
 * The products: on a CPU with AVX-512 BF16, our bf16 register tile (../bf16_tile.h), an
 * expert's lone token one row after another (../bf16_row_dot.h); on one without (AVX2
 * and FMA), the dot products of ../half_dot.h, the expert's rows widened to float32 as
 * they are read and the tokens' rows widened once (the AVX2 kernel the dense layers and
 * grouped_moe.py use there, cpu_sgemm.c, is built on the same code).
 * Either way float32 sums of exact products, each output rounded once to bf16, as
 * F.linear's bf16 output is; the gate is silu(g) * u with each of the two rounded to bf16
 * as torch's bf16 ops round them; each pair's output times its routing weight is rounded
 * to bf16 and added into its token's row in bf16, pairs in expert order (the order
 * grouped_moe.py adds them).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <omp.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include "../bf16_row_dot.h"
#include "../bf16_tile.h"

/* The products' inputs (a token's row, an activation) are bf16 here. */
typedef bf16 xval;
static inline xval to_xval(float v) { return float_to_bf16(v); }
#define ITEM_ROWS BF16_TILE_ROWS /* weight rows per work item */
#define PRODUCTS 1

/* y[m, n0 .. n0 + ITEM_ROWS) = x[m, :] . w[n, :] rounded to bf16 (x [M, K] bf16, row
 * stride K; w [N, K]; y stride ldy): one token row after row (bf16_row_dot.h), more in
 * the register tile, every token group, prefetching (into L2) this expert's tile two
 * ahead as cpu_bf16_gemm.c does: without it a 16-token step's experts, about 4 tokens
 * each, waited on their rows (1.4-2x the time at 4-64 tokens, 2026-12-07, the Zen 4 VM). */
static void item_rows(const xval *x, int64_t M, const bf16 *w, int64_t N, int64_t K, int64_t n0, bf16 *y,
                      int64_t ldy) {
    const int rows = (int)(N - n0 < BF16_TILE_ROWS ? N - n0 : BF16_TILE_ROWS);
    if (M == 1) { /* one token: row after row (bf16_row_dot.h) */
        for (int r = 0; r < rows; r++) y[n0 + r] = float_to_bf16(bf16_row_dot(w + (n0 + r) * K, x, K));
        return;
    }
    const int64_t groups = (M + BF16_TILE_TOKENS - 1) / BF16_TILE_TOKENS;
    const int pf_step = groups < BF16_TILE_ROWS ? (int)groups : BF16_TILE_ROWS;
    const bf16 *next = n0 + 2 * BF16_TILE_ROWS < N ? w + (n0 + 2 * BF16_TILE_ROWS) * K : NULL; /* this expert's */
    for (int64_t m0 = 0; m0 < M; m0 += BF16_TILE_TOKENS) {
        const int tokens = (int)(M - m0 < BF16_TILE_TOKENS ? M - m0 : BF16_TILE_TOKENS);
        const int64_t g = m0 / BF16_TILE_TOKENS;
        float out[BF16_TILE_ROWS * BF16_TILE_TOKENS];
        _mm512_storeu_ps(out, bf16_run_tile(w + n0 * K, K, x + m0 * K, K, K, rows, tokens,
                                            g < BF16_TILE_ROWS ? next : NULL, (int)g, pf_step));
        for (int t = 0; t < tokens; t++)
            for (int r = 0; r < rows; r++)
                y[(m0 + t) * ldy + n0 + r] = float_to_bf16(out[t * BF16_TILE_ROWS + r]);
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
#include "../../../distributed/bf16_convert.h"
#include "../half_dot.h"

typedef uint16_t bf16;
/* The products' inputs are float32 here (bf16 values, widened exactly). */
typedef float xval;
static inline xval to_xval(float v) { return v; }
#define ITEM_ROWS DOT_BLOCK
#define PRODUCTS 2

/* As above, for the DOT_BLOCK rows from n0 (x [M, K] float32), tokens in groups of at
 * most DOT_ROWS. */
static void item_rows(const xval *x, int64_t M, const bf16 *w, int64_t N, int64_t K, int64_t n0, bf16 *y,
                      int64_t ldy) {
    const int64_t rows = N - n0 < DOT_BLOCK ? N - n0 : DOT_BLOCK, groups = (M + DOT_ROWS - 1) / DOT_ROWS;
    float out[DOT_ROWS * DOT_BLOCK];
    int64_t m0 = 0;
    for (int64_t g = 0; g < groups; g++) {
        const int R = (int)((M - m0 + groups - g - 1) / (groups - g)); /* equal groups */
        dot_group(R, x + m0 * K, K, w + n0 * K, K, 0, rows, NULL, out, DOT_BLOCK, 1);
        for (int t = 0; t < R; t++)
            for (int64_t r = 0; r < rows; r++)
                y[(m0 + t) * ldy + n0 + r] = float_to_bf16(out[t * DOT_BLOCK + r]);
        m0 += R;
    }
}
#else
#error "needs AVX-512 BF16 and BW, or AVX2 and FMA (the loader builds this only where the CPU has one)"
#endif

static inline float round_bf16(float v) { return bf16_to_float(float_to_bf16(v)); }

/* Which products this build computes with: 1 the bf16 register tile, 2 the AVX2 dot products. */
int cpu_moe_products(void) { return PRODUCTS; }

/* out [T, H] (bf16, written whole) = sum over the pairs (t, j) whose expert this rank
 * holds of topk_w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, j]
 * mapped through expert_map [E] (NULL: ids are local; -1: another rank's, skipped).
 * x [T, H] (row stride ldx), w13 [E_local, 2I, H], w2 [E_local, H, I], topk_w float32
 * [T, K], topk_ids int64 [T, K]. Returns 0; -1 for an id outside [0, E) or a mapped id
 * outside [0, E_local) (nothing written); -3 without memory for the scratch. */
int cpu_moe_bf16(const bf16 *x, int64_t ldx, int64_t T, int64_t H, const bf16 *w13, const bf16 *w2,
                 int64_t E_local, int64_t I, const float *topk_w, const int64_t *topk_ids, int64_t K,
                 const int64_t *expert_map, int64_t E, bf16 *out, int threads) {
    const int64_t P = T * K;
    int64_t *count = calloc((size_t)E_local + 1, sizeof(int64_t)), *pair = malloc((size_t)(P ? P : 1) * sizeof(int64_t));
    int64_t *local = malloc((size_t)(P ? P : 1) * sizeof(int64_t));
    if (!count || !pair || !local) {
        free(count), free(pair), free(local);
        return -3;
    }
    for (int64_t p = 0; p < P; p++) { /* each pair's local expert, or -1 */
        const int64_t id = topk_ids[p];
        if (id < 0 || id >= E) {
            free(count), free(pair), free(local);
            return -1;
        }
        local[p] = expert_map ? expert_map[id] : id;
        if (local[p] >= E_local) {
            free(count), free(pair), free(local);
            return -1;
        }
        if (local[p] >= 0) count[local[p] + 1]++;
    }
    for (int64_t e = 0; e < E_local; e++) count[e + 1] += count[e]; /* count[e]: expert e's first sorted pair */
    const int64_t kept = count[E_local];
    int64_t *fill = malloc((size_t)(E_local ? E_local : 1) * sizeof(int64_t));
    const size_t n_rows = (size_t)(kept ? kept : 1);
    xval *xs = malloc(n_rows * (size_t)(H + I) * sizeof(xval)); /* [kept, H] rows, then [kept, I] activations */
    bf16 *gu = malloc(n_rows * (size_t)(2 * I + H) * sizeof(bf16)); /* [kept, 2I] gate/up, then [kept, H] outputs */
    if (!fill || !xs || !gu) {
        free(count), free(pair), free(local), free(fill), free(xs), free(gu);
        return -3;
    }
    memcpy(fill, count, (size_t)E_local * sizeof(int64_t));
    for (int64_t p = 0; p < P; p++) /* stable: an expert's pairs keep their token order */
        if (local[p] >= 0) pair[fill[local[p]]++] = p;
    xval *act = xs + kept * H;
    bf16 *ys = gu + kept * 2 * I;
    for (int64_t s = 0; s < kept; s++) {
        const bf16 *row = x + (pair[s] / K) * ldx;
        for (int64_t h = 0; h < H; h++) xs[s * H + h] = to_xval(bf16_to_float(row[h])); /* exact either way */
    }

    /* (active expert, block of ITEM_ROWS weight rows) work items of each product, each
     * thread a contiguous run of them weighted by the expert's tokens: a static schedule
     * over every expert's items left a thread idle wherever the active experts fell in
     * the other's half (a one-token step's 4 of 16 experts: 2.6x the time its weights
     * take to stream, 2026-12-07, the Zen 4 VM). */
    int64_t active = 0;
    for (int64_t e = 0; e < E_local; e++)
        if (count[e + 1] > count[e]) fill[active++] = e; /* fill: the active experts now */
    const int64_t items13 = (2 * I + ITEM_ROWS - 1) / ITEM_ROWS, items2 = (H + ITEM_ROWS - 1) / ITEM_ROWS;
    int64_t work = 0; /* an item costs its expert's tokens + 2 (reading its rows) */
    for (int64_t a = 0; a < active; a++) work += count[fill[a] + 1] - count[fill[a]] + 2;
#pragma omp parallel num_threads(threads)
    {
        const int64_t nth = omp_get_num_threads(), id = omp_get_thread_num();
        for (int product = 0; product < 2; product++) {
            const int64_t items = product ? items2 : items13, w0 = work * items * id / nth;
            const int64_t w1 = work * items * (id + 1) / nth;
            int64_t start = 0; /* the first item's work of expert a */
            for (int64_t a = 0; a < active; a++) {
                const int64_t e = fill[a], n = count[e + 1] - count[e], cost = n + 2;
                const int64_t i0 = w0 > start ? (w0 - start + cost - 1) / cost : 0;
                const int64_t i1 = w1 > start ? (w1 - start + cost - 1) / cost : 0;
                for (int64_t i = i0; i < (i1 < items ? i1 : items); i++) {
                    if (product == 0)
                        item_rows(xs + count[e] * H, n, w13 + e * 2 * I * H, 2 * I, H, i * ITEM_ROWS,
                                  gu + count[e] * 2 * I, 2 * I);
                    else
                        item_rows(act + count[e] * I, n, w2 + e * H * I, H, I, i * ITEM_ROWS, ys + count[e] * H, H);
                }
                start += cost * items;
            }
            if (product == 1) break;
#pragma omp barrier
#pragma omp for schedule(static)
            for (int64_t s = 0; s < kept; s++) { /* silu(g) * u, each rounded to bf16 as torch's bf16 ops are */
                const bf16 *g = gu + s * 2 * I;
                for (int64_t i = 0; i < I; i++) {
                    const float a = bf16_to_float(g[i]), silu = round_bf16(a / (1.0f + expf(-a)));
                    act[s * I + i] = to_xval(round_bf16(silu * bf16_to_float(g[I + i])));
                }
            }
        }
    }
    for (int64_t t = 0; t < T; t++) memset(out + t * H, 0, (size_t)H * sizeof(bf16));
    for (int64_t s = 0; s < kept; s++) { /* weighted, rounded, added in expert order */
        const int64_t p = pair[s];
        const float wt = topk_w[p];
        bf16 *o = out + (p / K) * H;
        const bf16 *y = ys + s * H;
        for (int64_t h = 0; h < H; h++)
            o[h] = float_to_bf16(bf16_to_float(o[h]) + round_bf16(bf16_to_float(y[h]) * wt));
    }
    free(count), free(pair), free(local), free(fill), free(xs), free(gu);
    return 0;
}
