/* A mixture-of-experts block's experts in one C call (cpu_moe_experts), for bfloat16 or
 * float16: the grouping grouped_moe.py does in torch (pairs sorted by expert, each active
 * expert's gate/up and down products over its tokens, the routed weights, the sum back
 * into each token), with no host read of the counts in between, so a decode step that
 * holds it can be recorded and replayed (worker/cpu_graph.py). Its contract is in
 * cpu_moe.py, which compiles it and is its only caller.
 *
 * The products: bfloat16 experts on a CPU with AVX-512 BF16 in our bf16 register tile
 * (../bf16_tile.h), an expert's lone token one row after another (../bf16_row_dot.h);
 * other experts (float16 ones; bfloat16 ones on a CPU without AVX-512 BF16) widened to
 * float32 as they are read, the tokens' rows widened once: two or more tokens in tiles
 * of 16-lane sums on AVX-512 (../half_tile.h), else in the 8-lane dot products
 * of ../half_dot.h (AVX2, FMA, F16C), a lone token one weight row at a time (half_dot.h's
 * dot_row1). The kernel the dense layers and grouped_moe.py use there, cpu_sgemm.c's
 * linear_half, is built on the same code. Either way float32 sums of exact products,
 * each output rounded once to the experts' dtype, as F.linear's 16-bit output is; the gate is silu(g) * u with each of the two rounded to that dtype
 * as torch's 16-bit ops round them; each pair's output times its routing weight is
 * rounded to it and added into its token's row in it, pairs in expert order (the order
 * grouped_moe.py adds them).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <omp.h>

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "needs AVX2, FMA and F16C (the loader builds this only where the CPU has them)"
#endif

#include "../../../distributed/bf16_convert.h"
#include "../../../distributed/fp16_convert.h"
#include "../half_dot.h"
#include "../half_tile.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include "../bf16_row_dot.h"
#include "../bf16_tile.h"
#define TILE 1
#define TILE_ITEM_ROWS BF16_TILE_ROWS

/* y[m, n0 .. n0 + BF16_TILE_ROWS) = x[m, :] . w[n, :] rounded to bf16 (x [M, K] bf16,
 * row stride K; w [N, K]; y stride ldy): one token row after row (bf16_row_dot.h), more
 * in the register tile, every token group, prefetching (into L2) this expert's tile two
 * ahead as cpu_bf16_gemm.c does: without it a 16-token step's experts, about 4 tokens
 * each, waited on their rows (1.4-2x the time at 4-64 tokens, 2026-12-07, the Zen 4 VM). */
static void tile_rows(const bf16 *x, int64_t M, const bf16 *w, int64_t N, int64_t K, int64_t n0, bf16 *y,
                      int64_t ldy) {
    const int rows = (int)(N - n0 < BF16_TILE_ROWS ? N - n0 : BF16_TILE_ROWS);
    if (M == 1) { /* one token: row after row */
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
#else
#define TILE 0
#define TILE_ITEM_ROWS 1 /* (no tile in this build) */
#endif

/* A 16-bit value (bf: bfloat16, else float16) to and from float32. */
static inline float half_to_float(uint16_t h, int bf) { return bf ? bf16_to_float(h) : fp16_to_float(h); }
static inline uint16_t float_to_half(float v, int bf) { return bf ? float_to_bf16(v) : float_to_fp16(v); }
static inline float round_half(float v, int bf) { return half_to_float(float_to_half(v, bf), bf); }

/* As tile_rows, for the DOT_BLOCK rows from n0 (x [M, K] float32, w 16-bit of type bf):
 * one token row after row (dot_row1); more, on an AVX-512 build in ../half_tile.h's
 * 16-lane tiles, else in half_dot.h's groups of at most DOT_ROWS tokens; each output
 * rounded to w's dtype. */
static void dot_rows_of(const float *x, int64_t M, const uint16_t *w, int64_t N, int64_t K, int64_t n0, uint16_t *y,
                        int64_t ldy, int bf) {
    const int64_t rows = N - n0 < DOT_BLOCK ? N - n0 : DOT_BLOCK;
    if (M == 1) { /* one token: row after row (half_dot.h's dot_row1) */
        for (int64_t r = 0; r < rows; r++) y[n0 + r] = float_to_half(dot_row1(x, K, w + (n0 + r) * K, bf), bf);
        return;
    }
#ifdef HALF_TILE_R
    /* An AVX-512 build: tiles of 16-lane sums (../half_tile.h), the first token
     * group prefetching the expert's tile two ahead. Against half_dot.h's 8-lane dot
     * products, float16 experts of Qwen3-MoE's size, 2026-12-07, the Zen 4 VM: 1.3-1.5x
     * at 4 tokens, 1.55-1.66x at 16, 1.2x at 64 (the prefetch about half of it). Six
     * weight rows whatever the tokens (the dense product's 4 up to 8 rows of x,
     * half_tile_width, lost here), every token group of a tile while its rows are in L1:
     * a 16-32-token step's experts, mostly 2-8 tokens each, 1.06-1.38x against 4 rows a
     * token group at a time (the gain the larger the faster the memory of the minute). */
    const int tw = HALF_TILE_W;
    for (int64_t r0 = 0; r0 < rows; r0 += tw) {
        const int W = (int)(rows - r0 < tw ? rows - r0 : tw);
        for (int64_t m0 = 0; m0 < M; m0 += HALF_TILE_R) {
            const int R = (int)(M - m0 < HALF_TILE_R ? M - m0 : HALF_TILE_R);
            const int64_t ahead = n0 + r0 + 2 * tw;
            float o[HALF_TILE_W * HALF_TILE_R];
            half_tile_run(W, R, x + m0 * K, K, w + (n0 + r0) * K, K, K, o,
                          m0 == 0 && ahead < N ? w + ahead * K : NULL, bf);
            for (int t = 0; t < R; t++)
                for (int i = 0; i < W; i++) y[(m0 + t) * ldy + n0 + r0 + i] = float_to_half(o[t * HALF_TILE_W + i], bf);
        }
    }
#else
    const int64_t groups = (M + DOT_ROWS - 1) / DOT_ROWS;
    float out[DOT_ROWS * DOT_BLOCK];
    int64_t m0 = 0;
    for (int64_t g = 0; g < groups; g++) {
        const int R = (int)((M - m0 + groups - g - 1) / (groups - g)); /* equal groups */
        dot_group(R, x + m0 * K, K, w + n0 * K, K, 0, rows, NULL, out, DOT_BLOCK, bf);
        for (int t = 0; t < R; t++)
            for (int64_t r = 0; r < rows; r++)
                y[(m0 + t) * ldy + n0 + r] = float_to_half(out[t * DOT_BLOCK + r], bf);
        m0 += R;
    }
#endif
}

/* Which products bfloat16 experts of two or more tokens take in this build: 1 the bf16
 * register tile, 2 the AVX2 dot products, 3 the 16-lane tiles of ../half_tile.h (AVX-512
 * without BF16). Float16 experts take the 16-lane tiles on every AVX-512 build, the dot
 * products elsewhere. */
int cpu_moe_products(void) {
#ifdef HALF_TILE_R
    return TILE ? 1 : 3;
#else
    return TILE ? 1 : 2;
#endif
}

/* A thread's run of work items [next, end), next in the low 32 bits, end in the high; its
 * owner takes items from the front, a thread done with its own from the back, each with
 * one compare-and-swap (relaxed: the items' inputs were written before the parallel
 * region or a barrier, their outputs are disjoint, a barrier follows). One per line. */
typedef struct {
    uint64_t v;
    char pad[56];
} run_t;
static inline uint64_t run_pack(int64_t next, int64_t end) { return (uint64_t)next | (uint64_t)end << 32; }

/* The item taken from the run's front (or its back where back), or -1: the run is empty. */
static inline int64_t run_claim(uint64_t *run, int back) {
    uint64_t seen = __atomic_load_n(run, __ATOMIC_RELAXED);
    for (;;) {
        const int64_t next = (int64_t)(uint32_t)seen, end = (int64_t)(seen >> 32);
        if (next >= end) return -1;
        const uint64_t want = back ? run_pack(next, end - 1) : run_pack(next + 1, end);
        if (__atomic_compare_exchange_n(run, &seen, want, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
            return back ? end - 1 : next;
    }
}

/* out [T, H] (the experts' dtype, written whole) = sum over the pairs (t, j) whose expert
 * this rank holds of topk_w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e =
 * topk_ids[t, j] mapped through expert_map [E] (NULL: ids are local; -1: another rank's,
 * skipped). x [T, H] (row stride ldx), w13 [E_local, 2I, H], w2 [E_local, H, I] and out
 * are bfloat16 where bf is 1, float16 where it is 0; topk_w float32 [T, K], topk_ids
 * int64 [T, K]. Returns 0; -1 for an id outside [0, E) or a mapped id outside [0,
 * E_local) (nothing written); -3 without memory for the scratch; -4 for more than 2^31
 * blocks of rows in one product (a run's 32-bit count). */
int cpu_moe_experts(const uint16_t *x, int64_t ldx, int64_t T, int64_t H, const uint16_t *w13,
                    const uint16_t *w2, int64_t E_local, int64_t I, const float *topk_w, const int64_t *topk_ids,
                    int64_t K, const int64_t *expert_map, int64_t E, uint16_t *out, int bf, int threads) {
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
    /* [kept, H] rows, then [kept, I] activations: bf16 for the tile, float32 for the dot products */
    const int tile = TILE && bf;
    void *xs = malloc(n_rows * (size_t)(H + I) * (tile ? sizeof(uint16_t) : sizeof(float)));
    /* [kept, 2I] gate/up, then [kept, H] outputs */
    uint16_t *gu = malloc(n_rows * (size_t)(2 * I + H) * sizeof(uint16_t));
    if (!fill || !xs || !gu) {
        free(count), free(pair), free(local), free(fill), free(xs), free(gu);
        return -3;
    }
    memcpy(fill, count, (size_t)E_local * sizeof(int64_t));
    for (int64_t p = 0; p < P; p++) /* stable: an expert's pairs keep their token order */
        if (local[p] >= 0) pair[fill[local[p]]++] = p;
    uint16_t *xh = xs, *acth = xh + kept * H; /* the tile's */
    float *xf = xs, *actf = xf + kept * H;    /* the dot products' */
    uint16_t *ys = gu + kept * 2 * I;

    /* (active expert, block of rows) work items of each product, item j of expert fill[j
     * / items]: each thread first the contiguous run of them its share of the estimated
     * work gives (an item costs its expert's tokens + 2, for reading its rows), then
     * items taken from the back of another thread's run. The estimate alone left a thread
     * waiting for a third of a 16-token step (the rows' time against the tokens' moves
     * with the memory's rate; 2026-12-07, the Zen 4 VM); a shared counter instead
     * (OpenMP's dynamic schedule) interleaved the threads' rows: 1.25x the time. */
    int64_t active = 0;
    for (int64_t e = 0; e < E_local; e++)
        if (count[e + 1] > count[e]) fill[active++] = e; /* fill: the active experts now */
    const int64_t item = tile ? TILE_ITEM_ROWS : DOT_BLOCK; /* weight rows per work item */
    const int64_t items13 = (2 * I + item - 1) / item, items2 = (H + item - 1) / item;
    run_t *runs = aligned_alloc(64, (size_t)(2 * threads) * sizeof(run_t)); /* each product's, each thread's */
    if (!runs) {
        free(count), free(pair), free(local), free(fill), free(xs), free(gu);
        return -3;
    }
    if (active * (items13 > items2 ? items13 : items2) > INT32_MAX) { /* a run counts items in 32 bits */
        free(count), free(pair), free(local), free(fill), free(xs), free(gu), free(runs);
        return -4;
    }
    int64_t work = 0;
    for (int64_t a = 0; a < active; a++) work += count[fill[a] + 1] - count[fill[a]] + 2;
    for (int product = 0; product < 2; product++) {
        const int64_t items = product ? items2 : items13;
        int64_t j0 = 0;
        for (int t = 0; t < threads; t++) {
            const int64_t w1 = work * items * (t + 1) / threads;
            int64_t j1 = 0, start = 0;
            for (int64_t a = 0; a < active; a++) { /* items of expert a whose work begins before w1 */
                const int64_t cost = count[fill[a] + 1] - count[fill[a]] + 2;
                const int64_t i1 = w1 > start ? (w1 - start + cost - 1) / cost : 0;
                j1 += i1 < items ? i1 : items;
                start += cost * items;
            }
            runs[product * threads + t].v = run_pack(j0, j1);
            j0 = j1;
        }
    }

#pragma omp parallel num_threads(threads)
    {
        const int id = omp_get_thread_num();
#pragma omp for schedule(static)
        for (int64_t s = 0; s < kept; s++) {
            const uint16_t *row = x + (pair[s] / K) * ldx;
            if (tile)
                memcpy(xh + s * H, row, (size_t)H * sizeof(uint16_t));
            else
                for (int64_t h = 0; h < H; h++) xf[s * H + h] = half_to_float(row[h], bf); /* exact */
        }
        for (int product = 0; product < 2; product++) {
            const int64_t items = product ? items2 : items13;
            const int64_t N = product ? H : 2 * I, Kd = product ? I : H; /* rows, and their length */
            for (;;) {
                int64_t j = run_claim(&runs[product * threads + id].v, 0);
                for (int v = 1; j < 0 && v < threads; v++) /* ours done: another's last item */
                    j = run_claim(&runs[product * threads + (id + v) % threads].v, 1);
                if (j < 0) break;
                const int64_t e = fill[j / items], i = j % items, n = count[e + 1] - count[e];
                const uint16_t *w = product ? w2 + e * H * I : w13 + e * 2 * I * H;
                uint16_t *y = product ? ys + count[e] * H : gu + count[e] * 2 * I;
#if TILE
                if (tile) {
                    tile_rows((product ? acth : xh) + count[e] * Kd, n, w, N, Kd, i * item, y, N);
                    continue;
                }
#endif
                dot_rows_of((product ? actf : xf) + count[e] * Kd, n, w, N, Kd, i * item, y, N, bf);
            }
#pragma omp barrier
            if (product == 1) break;
#pragma omp for schedule(static)
            for (int64_t s = 0; s < kept; s++) { /* silu(g) * u, each rounded as torch's 16-bit ops round */
                const uint16_t *g = gu + s * 2 * I;
                for (int64_t i = 0; i < I; i++) {
                    const float a = half_to_float(g[i], bf), silu = round_half(a / (1.0f + expf(-a)), bf);
                    const float v = round_half(silu * half_to_float(g[I + i], bf), bf);
                    if (tile)
                        acth[s * I + i] = float_to_half(v, bf);
                    else
                        actf[s * I + i] = v;
                }
            }
        }
        /* each pair's output weighted, rounded and added into its token's row in expert
         * order, the columns shared out (every value's sum in the same order) */
#pragma omp for schedule(static)
        for (int64_t h0 = 0; h0 < H; h0 += 64) {
            const int64_t h1 = h0 + 64 < H ? h0 + 64 : H;
            for (int64_t t = 0; t < T; t++) memset(out + t * H + h0, 0, (size_t)(h1 - h0) * sizeof(uint16_t));
            for (int64_t s = 0; s < kept; s++) {
                const int64_t p = pair[s];
                const float wt = topk_w[p];
                uint16_t *o = out + (p / K) * H;
                const uint16_t *y = ys + s * H;
                for (int64_t h = h0; h < h1; h++)
                    o[h] = float_to_half(half_to_float(o[h], bf) + round_half(half_to_float(y[h], bf) * wt, bf), bf);
            }
        }
    }
    free(count), free(pair), free(local), free(fill), free(xs), free(gu), free(runs);
    return 0;
}
