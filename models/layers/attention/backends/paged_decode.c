/* Paged decode attention on the CPU: one query token per sequence against the K/V in
 * its own cache blocks, read in place (no gather, no padding to the longest).
 *
 * The contract (shapes, who calls, what may alias) is in paged_decode.py, which
 * compiles this file and is its only caller. One task is one sequence and a range of
 * its kv heads (all of them unless there are fewer sequences than threads): a cache
 * block holds a token's K for every kv head in one row, so a task walks its blocks
 * front to back. Tasks are spread over the caller's OpenMP threads (the process's one
 * libgomp, which torch loaded first); each task's arithmetic is sequential and does not
 * depend on the schedule, so results do not depend on the thread count.
 *
 * Compiled with -ffast-math (paged_decode.py links without it, so crtfastmath's
 * flush-to-zero never reaches the process): it lets the compiler vectorise the dot
 * products and call glibc's vector expf. Inputs are finite by contract.
 *
 * Where the compiler targets AVX-512 (-march=native on such a CPU), head sizes 64 and
 * 128 take attend_avx512() (paged_decode_avx512.h), written with intrinsics; where it
 * targets AVX2 and FMA but not AVX-512, head size 64 takes attend_avx2()
 * (paged_decode_avx2.h); other head sizes and other CPUs take attend(). All compute in
 * float32; their results differ only by the order of the additions.
 *
 * A sliding window (window > 0) starts each sequence at max(start, seq_len - window):
 * its query, at position seq_len - 1, sees the window's last positions only. A soft
 * cap (soft_cap > 0) turns each scaled score s into cap * tanh(s / cap) before the
 * softmax (Gemma 2).
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "paged_decode_common.h"

/* Sequence g, kv heads [h0, h1). `D` is a constant in the specialised copies. */
INLINE void attend(const Args *a, int dt, const int64_t D, int64_t g, int64_t h0, int64_t h1,
                   int64_t max_len, float *scratch) {
    const int64_t R = a->group, Hkv = a->num_kv_heads, H = Hkv * R, bs = a->block_size;
    const int64_t rows = (h1 - h0) * R; /* query rows of this task */
    const int64_t esize = dt == DT_F32 ? 4 : 2;
    float *scores = scratch;            /* [rows, max_len] */
    float *acc = scores + rows * max_len; /* [rows, D] */
    float *qf = acc + rows * D;           /* [rows, D] */
    float *row = qf + rows * D;           /* one token's K or V of the task's heads */
    float *row_max = row + (h1 - h0) * D, *row_sum = row_max + rows;

    const int64_t start = seq_start(a, g), n = a->seq_lens[g] - start;
    const int64_t *table = a->tables + g * a->table_stride;
    const char *qg = (const char *)a->q + (g * a->q_seq_stride + h0 * R * D) * esize;
    const float *qs = as_float(qg, dt, qf, rows * D);
    for (int64_t i = 0; i < rows * D; ++i) qf[i] = qs[i] * a->scale;

    const int64_t slot_elems = Hkv * D, kv_elems = bs * slot_elems;
    const char *cache = (const char *)a->cache;
    for (int pass = 0; pass < 2; ++pass) { /* 0: scores from K, 1: weighted sum of V */
        if (pass == 1) {
            for (int64_t r = 0; r < rows; ++r) {
                if (a->soft_cap > 0) soft_cap_in_place(scores + r * max_len, n, a->soft_cap);
                row_sum[r] = exp_in_place(scores + r * max_len, n, &row_max[r]);
            }
            memset(acc, 0, sizeof(float) * rows * D);
        }
        for (int64_t j = 0; j < n;) { /* a block at a time */
            const int64_t pos = start + j;
            const int64_t block = table[pos / bs], first = pos % bs;
            const int64_t count = (bs - first < n - j) ? bs - first : n - j;
            const char *base = cache + ((block * 2 + pass) * kv_elems + first * slot_elems + h0 * D) * esize;
            /* The next block's rows of this pass, fetched while this block is computed: the
             * blocks of a sequence lie anywhere in the cache, so the hardware prefetcher
             * only catches up within a block. */
            const char *next = NULL;
            if (j + count < n) {
                const int64_t npos = start + j + count;
                next = cache + ((table[npos / bs] * 2 + pass) * kv_elems + h0 * D) * esize;
            }
            const int64_t row_bytes = (h1 - h0) * D * esize;
            for (int64_t t = 0; t < count; ++t, ++j) {
                if (next)
                    for (int64_t off = 0; off < row_bytes; off += 64)
                        __builtin_prefetch(next + (first + t) * slot_elems * esize + off, 0, 3);
                const float *x = as_float(base + t * slot_elems * esize, dt, row, (h1 - h0) * D);
                for (int64_t hh = 0; hh < h1 - h0; ++hh) {
                    const float *xh = x + hh * D;
                    for (int64_t r = hh * R; r < (hh + 1) * R; ++r) {
                        if (pass == 0) {
                            const float *qr = qf + r * D;
                            float dot = 0.f;
                            for (int64_t d = 0; d < D; ++d) dot += qr[d] * xh[d];
                            scores[r * max_len + j] = dot;
                        } else {
                            const float w = scores[r * max_len + j];
                            float *o = acc + r * D;
                            for (int64_t d = 0; d < D; ++d) o[d] += w * xh[d];
                        }
                    }
                }
            }
        }
    }
    for (int64_t r = 0; r < rows; ++r) {
        const float inv = 1.f / row_sum[r];
        const int64_t head = h0 * R + r;
        store_row((char *)a->out + (g * H + head) * D * esize, dt, acc + r * D, inv, D);
        if (a->lse) a->lse[g * H + head] = row_max[r] + logf(row_sum[r]);
    }
}

#if defined(__AVX512F__)
#include "paged_decode_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__)
#include "paged_decode_avx2.h"
#endif

/* 0, or which input is out of range (see paged_decode.py): every block a task will read
 * is checked here, before any is, so a bad table is an error and not a wild read. */
INLINE int check(const Args *a) {
    for (int64_t g = 0; g < a->num_seqs; ++g) {
        const int64_t n = a->seq_lens[g];
        if (n <= a->start) return 2;
        const int64_t last = (n - 1) / a->block_size;
        if (last >= a->table_width) return 4;
        for (int64_t b = seq_start(a, g) / a->block_size; b <= last; ++b) {
            const int64_t block = a->tables[g * a->table_stride + b];
            if (block < 0 || block >= a->num_blocks) return 3;
        }
    }
    return 0;
}

INLINE int run(const Args *a, int dt, int64_t D, int num_threads) {
    const int bad = check(a);
    if (bad) return bad;
    int64_t max_len = 1;
    for (int64_t g = 0; g < a->num_seqs; ++g)
        if (a->seq_lens[g] - seq_start(a, g) > max_len) max_len = a->seq_lens[g] - seq_start(a, g);
    /* Fewer sequences than threads: split each sequence's kv heads among tasks. */
    int64_t splits = 1;
    while (splits < a->num_kv_heads && a->num_seqs * splits < num_threads) ++splits;
    const int64_t heads_per_task = (a->num_kv_heads + splits - 1) / splits;
    const int64_t rows = heads_per_task * a->group;
    /* attend()'s buffers, or attend_avx512()'s scores and its 4 x 16 x 16 partial sums
     * (attend_avx2()'s scores, queries, 4 x 8 x 8 partial sums, maxima and sums) */
    const size_t floats = (size_t)(rows * max_len + 2 * rows * D + heads_per_task * D + 2 * rows + 4 * 256);
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scratch = malloc(sizeof(float) * floats);
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < a->num_seqs * splits; ++task) {
            if (!scratch) continue;
            const int64_t g = task / splits, h0 = task % splits * heads_per_task;
            const int64_t h1 = h0 + heads_per_task < a->num_kv_heads ? h0 + heads_per_task : a->num_kv_heads;
            if (h0 >= h1) continue;
#if defined(__AVX512F__)
            if (D == 64)
                attend_avx512(a, dt, 64, g, h0, h1, max_len, scratch);
            else if (D == 128)
                attend_avx512(a, dt, 128, g, h0, h1, max_len, scratch);
            else
#elif defined(__AVX2__) && defined(__FMA__)
            if (D == 64)
                attend_avx2(a, dt, 64, g, h0, h1, max_len, scratch);
            else
#endif
            if (D == 64)
                attend(a, dt, 64, g, h0, h1, max_len, scratch);
            else if (D == 128)
                attend(a, dt, 128, g, h0, h1, max_len, scratch);
            else
                attend(a, dt, D, g, h0, h1, max_len, scratch);
        }
        free(scratch);
    }
    return failed;
}

/* Returns 0; 1 when a thread's scratch could not be allocated; 2-4 for an input out of
 * range (check), before anything is read through it. */
#define EXPORT(NAME, DT)                                                                      \
    int NAME(const void *q, int64_t q_seq_stride, const void *cache, int64_t num_blocks,       \
             const int64_t *tables, int64_t table_stride, int64_t table_width,                 \
             const int64_t *seq_lens, int64_t start, void *out, float *lse, int64_t num_seqs,  \
             int64_t num_kv_heads, int64_t group, int64_t head_size, int64_t block_size,        \
             float scale, int64_t window, float soft_cap, int num_threads) {                    \
        const Args a = {q, q_seq_stride, cache, tables, table_stride, table_width, num_blocks, \
                        seq_lens, start, out, lse, num_seqs, num_kv_heads, group, block_size,   \
                        scale, window, soft_cap};                                               \
        return run(&a, DT, head_size, num_threads);                                            \
    }

EXPORT(paged_decode_f32, DT_F32)
EXPORT(paged_decode_bf16, DT_BF16)
EXPORT(paged_decode_f16, DT_F16)

/* Whether head sizes 64 and 128 run attend_avx512(): 1 or 0. */
int paged_decode_avx512(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

/* Whether head size 64 runs attend_avx2(): 1 or 0. */
int paged_decode_avx2(void) {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

/* vLLM's reshape_and_cache: token t's keys (row_bytes at k + t * k_stride bytes: every
 * kv head's, contiguous) and values into slot slots[t] of the paged cache [num_blocks,
 * 2, block_size, kv heads, head size] (contiguous, the rows' dtype). Returns 0, or 3
 * when a slot is outside the cache (checked first: then nothing is written). */
int paged_write_kv(const char *k, int64_t k_stride, const char *v, int64_t v_stride, char *cache,
                   int64_t num_blocks, int64_t block_size, int64_t row_bytes, const int64_t *slots,
                   int64_t tokens) {
    for (int64_t t = 0; t < tokens; ++t)
        if (slots[t] < 0 || slots[t] >= num_blocks * block_size) return 3;
    for (int64_t t = 0; t < tokens; ++t) {
        const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
        char *key = cache + ((block * 2) * block_size + offset) * row_bytes;
        memcpy(key, k + t * k_stride, (size_t)row_bytes);
        memcpy(key + block_size * row_bytes, v + t * v_stride, (size_t)row_bytes);
    }
    return 0;
}
