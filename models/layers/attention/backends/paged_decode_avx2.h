/* paged_decode.c's attend() with AVX2 and FMA intrinsics, for head size 64 on CPUs
 * without AVX-512: included by paged_decode.c (its only includer) where the
 * compiler targets AVX2 and FMA but not AVX-512; what it shares with attend() is in
 * paged_decode_common.h.
 *
 * attend()'s order (a cache block at a time, every kv head of the task within it, so
 * that the block's rows come from memory once, and the next block's are prefetched
 * meanwhile), with the arithmetic in registers, for each head's query rows in groups of
 * up to 4:
 * - scores: a token's K (8 vectors of 8) stays in registers while each row's scaled
 *   query (in the scratch, read by the fused multiply-adds) meets it, one vector of
 *   partial sums per (row, token); 8 tokens' are reduced together (reduce8).
 * - the weighted sum of V: a 4-row by 16-column product at a time, its 8 sums in
 *   registers over the block's tokens, each token's 16 values converted once.
 * attend_avx512's order (a head at a time over the whole sequence) walked the cache once
 * per head here and lost to attend() on the Zen 3 VM's caches. Head size 128 stays with
 * attend(): this plan, its K in two halves and its V in 8 slices, measured 0.85-1.16x
 * attend() there. The arithmetic is attend()'s, in float32, with the additions in
 * another order. Figures: paged_decode.py. */
#ifndef PAGED_DECODE_AVX2_H
#define PAGED_DECODE_AVX2_H
#include <immintrin.h>

#include "paged_decode_common.h"

/* 8 elements at `p` (of dtype `dt`) as one float32 vector. */
INLINE __m256 load8(const void *p, int dt) {
    if (dt == DT_F32) return _mm256_loadu_ps(p);
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
#if defined(__F16C__)
    if (dt == DT_F16) return _mm256_cvtph_ps(h);
#else
    if (dt == DT_F16) {
        float f[8];
        for (int i = 0; i < 8; ++i) f[i] = fp16_to_float(((const uint16_t *)p)[i]);
        return _mm256_loadu_ps(f);
    }
#endif
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* The horizontal sums of v[0], ..., v[7], in that order, as one vector. */
INLINE __m256 reduce8(const __m256 *v) {
    const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    /* per 128-bit half: the sums of v[0..3] (u0) and v[4..7] (u1) over that half */
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* Row t of the next block (its K or V at `next`), the task's heads' `row_bytes` of it,
 * fetched while this block is computed: the blocks of a sequence lie anywhere in the
 * cache, so the hardware prefetcher only catches up within a block. */
INLINE void prefetch_row(const char *next, int64_t t, int64_t slot_bytes, int64_t row_bytes) {
    if (next)
        for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(next + t * slot_bytes + off, 0, 3);
}

/* Scores of rows r0 .. r0 + rg - 1 (rg <= 4; row r is q row r of the task, scaled, in qf)
 * against the `count` tokens of K at kp (a token every slot_elems elements, the rows'
 * head at element 0), from position j0: one vector of partial sums per (row, token),
 * reduced 8 tokens at a time. */
INLINE void block_scores(int dt, const int64_t D, const char *kp, int64_t slot_elems, int64_t count,
                         const float *qf, int64_t r0, int64_t rg, float *scores, int64_t max_len, int64_t j0,
                         float *partial) {
    enum { RG = 4 };
    const int64_t esize = dt == DT_F32 ? 4 : 2;
    int64_t pending = 0; /* tokens whose vectors wait in `partial` ([RG][8][8]) */
    for (int64_t t = 0; t < count; ++t) {
        const char *k_t = kp + t * slot_elems * esize;
        __m256 s[RG], k[8];
        for (int c = 0; c < 8; ++c) k[c] = load8(k_t + c * 8 * esize, dt);
        for (int64_t r = 0; r < RG && r < rg; ++r) {
            const float *qr = qf + (r0 + r) * D;
            s[r] = _mm256_mul_ps(_mm256_loadu_ps(qr), k[0]);
            for (int c = 1; c < 8; ++c) s[r] = _mm256_fmadd_ps(_mm256_loadu_ps(qr + 8 * c), k[c], s[r]);
        }
        for (int64_t r = 0; r < RG && r < rg; ++r) _mm256_storeu_ps(partial + (r * 8 + pending) * 8, s[r]);
        if (++pending == 8) {
            for (int64_t r = 0; r < rg; ++r) {
                __m256 v[8];
                for (int u = 0; u < 8; ++u) v[u] = _mm256_loadu_ps(partial + (r * 8 + u) * 8);
                _mm256_storeu_ps(scores + (r0 + r) * max_len + j0 + t + 1 - 8, reduce8(v));
            }
            pending = 0;
        }
    }
    for (int64_t r = 0; r < rg; ++r)
        for (int64_t u = 0; u < pending; ++u) {
            const float *p = partial + (r * 8 + u) * 8;
            float sum = 0.f;
            for (int e = 0; e < 8; ++e) sum += p[e];
            scores[(r0 + r) * max_len + j0 + count - pending + u] = sum;
        }
}

/* acc[row][c0 .. c0 + 16) += the weights of rows r0 .. r0 + rg - 1 (rg <= 4) at positions
 * j0 .. j0 + count - 1 times those tokens of V at vp (the rows' head, column c0): a 4-row
 * by 16-column product in registers, each token's 16 values converted once. */
INLINE void block_weighted_v(int dt, const int64_t D, const char *vp, int64_t slot_elems, int64_t count,
                             const float *scores, int64_t max_len, int64_t j0, int64_t r0, int64_t rg, int64_t c0,
                             float *acc) {
    enum { RG = 4 };
    const int64_t esize = dt == DT_F32 ? 4 : 2;
    __m256 a[RG][2];
    for (int64_t r = 0; r < RG && r < rg; ++r) {
        a[r][0] = _mm256_loadu_ps(acc + (r0 + r) * D + c0);
        a[r][1] = _mm256_loadu_ps(acc + (r0 + r) * D + c0 + 8);
    }
    for (int64_t t = 0; t < count; ++t) {
        const char *v_t = vp + (t * slot_elems + c0) * esize;
        const __m256 v0 = load8(v_t, dt), v1 = load8(v_t + 8 * esize, dt);
        for (int64_t r = 0; r < RG && r < rg; ++r) {
            const __m256 w = _mm256_broadcast_ss(scores + (r0 + r) * max_len + j0 + t);
            a[r][0] = _mm256_fmadd_ps(w, v0, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(w, v1, a[r][1]);
        }
    }
    for (int64_t r = 0; r < RG && r < rg; ++r) {
        _mm256_storeu_ps(acc + (r0 + r) * D + c0, a[r][0]);
        _mm256_storeu_ps(acc + (r0 + r) * D + c0 + 8, a[r][1]);
    }
}

/* attend() for head size 64 (`D`: 64, which the loops above are written for), in
 * attend()'s order: a block at a time, each of the task's kv heads within it (the block's rows come
 * from memory once and serve the later heads from cache), then that head's query rows
 * in groups of up to 4. Scratch, within run()'s buffer: scores [rows, max_len], the
 * scaled queries and the output sums [rows, D] each, 256 floats of partial sums, and
 * the rows' maxima and sums. */
INLINE void attend_avx2(const Args *a, int dt, const int64_t D, int64_t g, int64_t h0, int64_t h1,
                        int64_t max_len, float *scratch) {
    const int64_t R = a->group, Hkv = a->num_kv_heads, H = Hkv * R, bs = a->block_size;
    const int64_t rows = (h1 - h0) * R, esize = dt == DT_F32 ? 4 : 2;
    float *scores = scratch, *qf = scores + rows * max_len, *acc = qf + rows * D, *partial = acc + rows * D;
    float *top = partial + 256, *sum = top + rows;
    const int64_t start = seq_start(a, g), n = a->seq_lens[g] - start;
    const int64_t *table = a->tables + g * a->table_stride;
    const int64_t slot_elems = Hkv * D, kv_elems = bs * slot_elems, row_bytes = (h1 - h0) * D * esize;
    const char *cache = (const char *)a->cache;

    const char *qg = (const char *)a->q + (g * a->q_seq_stride + h0 * R * D) * esize;
    const __m256 scale = _mm256_set1_ps(a->scale);
    for (int64_t i = 0; i < rows * D; i += 8) _mm256_storeu_ps(qf + i, _mm256_mul_ps(load8(qg + i * esize, dt), scale));
    memset(acc, 0, sizeof(float) * rows * D);
    for (int pass = 0; pass < 2; ++pass) { /* 0: scores from K, 1: weighted sum of V */
        if (pass == 1)
            for (int64_t r = 0; r < rows; ++r) {
                if (a->soft_cap > 0) soft_cap_in_place(scores + r * max_len, n, a->soft_cap);
                sum[r] = exp_in_place(scores + r * max_len, n, &top[r]);
            }
        for (int64_t j = 0; j < n;) { /* a block at a time */
            const int64_t pos = start + j;
            const int64_t first = pos % bs, count = (bs - first < n - j) ? bs - first : n - j;
            const char *base = cache + ((table[pos / bs] * 2 + pass) * kv_elems + first * slot_elems + h0 * D) * esize;
            /* the next block's rows, a share of them before each head */
            const int64_t next_count = n - j - count < bs ? n - j - count : bs, heads = h1 - h0;
            const char *next = next_count > 0 ? cache + ((table[(pos + count) / bs] * 2 + pass) * kv_elems + h0 * D) * esize
                                              : NULL;
            for (int64_t hh = 0; hh < heads; ++hh) {
                for (int64_t t = hh * next_count / heads; t < (hh + 1) * next_count / heads; ++t)
                    prefetch_row(next, t, slot_elems * esize, row_bytes);
                const char *head = base + hh * D * esize;
                for (int64_t r0 = 0; r0 < R; r0 += 4) {
                    const int64_t rg = R - r0 < 4 ? R - r0 : 4, row0 = hh * R + r0;
                    /* the group's row count as a constant in each copy, so that the
                     * rows' sums become registers */
#define ROWS(RG)                                                                                        \
    if (pass == 0)                                                                                      \
        block_scores(dt, D, head, slot_elems, count, qf, row0, RG, scores, max_len, j, partial);      \
    else                                                                                                \
        for (int64_t c0 = 0; c0 < D; c0 += 16)                                                          \
            block_weighted_v(dt, D, head, slot_elems, count, scores, max_len, j, row0, RG, c0, acc);
                    switch (rg) {
                    case 4: ROWS(4) break;
                    case 3: ROWS(3) break;
                    case 2: ROWS(2) break;
                    default: ROWS(1)
                    }
#undef ROWS
                }
            }
            j += count;
        }
    }
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t out_row = g * H + h0 * R + r;
        const float inv = 1.f / sum[r];
        store_row((char *)a->out + out_row * D * esize, dt, acc + r * D, inv, D);
        if (a->lse) a->lse[out_row] = top[r] + logf(sum[r]);
    }
}

#endif
