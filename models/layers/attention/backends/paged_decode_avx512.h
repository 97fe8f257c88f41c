/* paged_decode.c's attend() with AVX-512 intrinsics, for head sizes 64 and 128: included
 * by paged_decode.c (its only includer) where the compiler targets AVX-512; what it shares
 * with attend() is in paged_decode_common.h. */
#ifndef PAGED_DECODE_AVX512_H
#define PAGED_DECODE_AVX512_H
#include <immintrin.h>

#include "paged_decode_common.h"

/* 16 elements at `p` (of dtype `dt`) as one float32 vector. */
INLINE __m512 load16(const void *p, int dt) {
    if (dt == DT_F32) return _mm512_loadu_ps(p);
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    if (dt == DT_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* The horizontal sums of v[0], ..., v[15], in that order, as one vector: 45 shuffles and
 * adds where 16 separate reductions take about 130. */
INLINE __m512 reduce16(const __m512 *v) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; ++i) /* per 128-bit lane: pairs of tokens, two sums each */
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) { /* per 128-bit lane: four tokens, one sum each */
        const __m512d c = _mm512_castps_pd(t[2 * i]), d = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c, d)), _mm512_castpd_ps(_mm512_unpackhi_pd(c, d)));
    }
    /* then across the four lanes */
    const __m512 s0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 s1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s0, s1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(s0, s1, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* attend() with AVX-512 intrinsics, for head sizes 64 and 128 (`D`, a constant in the
 * two copies). One kv head at a time, its query rows in groups of up to RG, so that a
 * group's scaled queries and its running output sums stay in registers while it walks
 * the sequence (attend()'s sums live in memory, and the compiler kept them there).
 * Each (row, token) dot product stays a vector until 16 tokens have one, and those 16
 * are reduced together (reduce16). The arithmetic is attend()'s, in float32, with the
 * additions in another order. On a Zen 5 core, bfloat16, head size 64: 2-2.5x faster than
 * attend() with the K/V in cache, 1.3-1.5x with it in memory (a decode step's case). */
INLINE void attend_avx512(const Args *a, int dt, const int64_t D, int64_t g, int64_t h0, int64_t h1,
                          int64_t max_len, float *scratch) {
    enum { RG = 4, MAX_C = 8 };
    /* Rows per group: the K pass holds a row's q (C vectors), the V pass its acc (C), and a
     * group's must fit in the 32 registers beside the K or V row (C more): 4 rows at D=64
     * (16 + 4), 2 at D=128 (16 + 8). */
    const int64_t C = D / 16, group_rows = D == 64 ? 4 : 2;
    const int64_t R = a->group, Hkv = a->num_kv_heads, H = Hkv * R, bs = a->block_size;
    const int64_t esize = dt == DT_F32 ? 4 : 2;
    const int64_t start = seq_start(a, g), n = a->seq_lens[g] - start;
    const int64_t *table = a->tables + g * a->table_stride;
    const int64_t slot_elems = Hkv * D, kv_elems = bs * slot_elems;
    const char *cache = (const char *)a->cache;
    float *scores = scratch;                /* [R, max_len] */
    float *partial = scores + R * max_len;  /* [RG, 16, 16]: dot vectors awaiting reduce16 */
    const __m512 scale = _mm512_set1_ps(a->scale);
    for (int64_t h = h0; h < h1; ++h) {
        for (int64_t r0 = 0; r0 < R; r0 += group_rows) {
            const int64_t rg = R - r0 < group_rows ? R - r0 : group_rows;
            __m512 q[RG][MAX_C], acc[RG][MAX_C];
            /* Loops to the constant RG with a test on rg, so that the compiler unrolls them
             * and q and acc become registers. */
            for (int64_t r = 0; r < RG; ++r)
                for (int64_t c = 0; c < C; ++c) {
                    acc[r][c] = _mm512_setzero_ps();
                    q[r][c] = _mm512_setzero_ps();
                    if (r < rg) {
                        const char *qp = (const char *)a->q
                                         + (g * a->q_seq_stride + (h * R + r0 + r) * D + c * 16) * esize;
                        q[r][c] = _mm512_mul_ps(load16(qp, dt), scale);
                    }
                }
            int64_t pending = 0; /* tokens whose dot vectors wait in `partial` */
            for (int64_t j = 0; j < n;) { /* scores from K, a block at a time */
                const int64_t pos = start + j;
                const int64_t first = pos % bs, count = (bs - first < n - j) ? bs - first : n - j;
                const char *base = cache + ((table[pos / bs] * 2) * kv_elems + first * slot_elems + h * D) * esize;
                const char *next = j + count < n ? cache + ((table[(pos + count) / bs] * 2) * kv_elems + h * D) * esize : NULL;
                for (int64_t t = 0; t < count; ++t, ++j) {
                    const char *kp = base + t * slot_elems * esize;
                    if (next) /* as in attend(); without it this loop ran 1.5x slower than attend()'s */
                        for (int64_t off = 0; off < D * esize; off += 64)
                            __builtin_prefetch(next + (first + t) * slot_elems * esize + off, 0, 3);
                    __m512 k[MAX_C];
                    for (int64_t c = 0; c < C; ++c) k[c] = load16(kp + c * 16 * esize, dt);
                    for (int64_t r = 0; r < RG && r < rg; ++r) {
                        __m512 s = _mm512_mul_ps(q[r][0], k[0]);
                        for (int64_t c = 1; c < C; ++c) s = _mm512_fmadd_ps(q[r][c], k[c], s);
                        _mm512_storeu_ps(partial + (r * 16 + pending) * 16, s);
                    }
                    if (++pending == 16) {
                        for (int64_t r = 0; r < rg; ++r) {
                            __m512 v[16];
                            for (int u = 0; u < 16; ++u) v[u] = _mm512_loadu_ps(partial + (r * 16 + u) * 16);
                            _mm512_storeu_ps(scores + (r0 + r) * max_len + j + 1 - 16, reduce16(v));
                        }
                        pending = 0;
                    }
                }
            }
            for (int64_t r = 0; r < rg; ++r)
                for (int64_t u = 0; u < pending; ++u)
                    scores[(r0 + r) * max_len + n - pending + u] =
                        _mm512_reduce_add_ps(_mm512_loadu_ps(partial + (r * 16 + u) * 16));
            float top[RG], sum[RG];
            for (int64_t r = 0; r < rg; ++r) {
                if (a->soft_cap > 0) soft_cap_in_place(scores + (r0 + r) * max_len, n, a->soft_cap);
                sum[r] = exp_in_place(scores + (r0 + r) * max_len, n, &top[r]);
            }
            for (int64_t j = 0; j < n;) { /* the weighted sum of V */
                const int64_t pos = start + j;
                const int64_t first = pos % bs, count = (bs - first < n - j) ? bs - first : n - j;
                const char *base = cache + ((table[pos / bs] * 2 + 1) * kv_elems + first * slot_elems + h * D) * esize;
                const char *next = j + count < n ? cache + ((table[(pos + count) / bs] * 2 + 1) * kv_elems + h * D) * esize : NULL;
                for (int64_t t = 0; t < count; ++t, ++j) {
                    const char *vp = base + t * slot_elems * esize;
                    if (next)
                        for (int64_t off = 0; off < D * esize; off += 64)
                            __builtin_prefetch(next + (first + t) * slot_elems * esize + off, 0, 3);
                    __m512 v[MAX_C];
                    for (int64_t c = 0; c < C; ++c) v[c] = load16(vp + c * 16 * esize, dt);
                    for (int64_t r = 0; r < RG && r < rg; ++r) {
                        const __m512 w = _mm512_set1_ps(scores[(r0 + r) * max_len + j]);
                        for (int64_t c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(w, v[c], acc[r][c]);
                    }
                }
            }
            for (int64_t r = 0; r < rg; ++r) {
                const int64_t head = h * R + r0 + r;
                float row[MAX_C * 16];
                const __m512 inv = _mm512_set1_ps(1.f / sum[r]);
                for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(row + c * 16, _mm512_mul_ps(acc[r][c], inv));
                store_row((char *)a->out + (g * H + head) * D * esize, dt, row, 1.f, D);
                if (a->lse) a->lse[g * H + head] = top[r] + logf(sum[r]);
            }
        }
    }
}

#endif
