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
 * 128 take attend_avx512(), written with intrinsics; other head sizes and other CPUs
 * take attend(). Both compute in float32; their results differ only by the order of
 * the additions.
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

#define INLINE static inline __attribute__((always_inline))

typedef uint16_t bf16_t;

INLINE float bf16_to_float(bf16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

INLINE bf16_t float_to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                      /* round to nearest even, as torch */
    return (bf16_t)(u >> 16);
}

/* `n` elements at `src` (float32, or bfloat16 when `bf16`) as float32: `src` itself, or
 * `scratch` filled with the conversion. */
INLINE const float *as_float(const void *src, int bf16, float *scratch, int64_t n) {
    if (!bf16) return (const float *)src;
    const bf16_t *b = (const bf16_t *)src;
    for (int64_t i = 0; i < n; ++i) scratch[i] = bf16_to_float(b[i]);
    return scratch;
}

/* s[0..n) <- exp(s - max s), in place; returns the sum, and the maximum in *top. */
INLINE float exp_in_place(float *s, int64_t n, float *top) {
    float m = s[0], sum = 0.f;
    for (int64_t j = 1; j < n; ++j) m = s[j] > m ? s[j] : m;
    for (int64_t j = 0; j < n; ++j) {
        s[j] = expf(s[j] - m);
        sum += s[j];
    }
    *top = m;
    return sum;
}

typedef struct {
    const void *q;
    int64_t q_seq_stride;
    const void *cache;
    const int64_t *tables;
    int64_t table_stride, table_width, num_blocks;
    const int64_t *seq_lens;
    int64_t start;
    void *out;
    float *lse;
    int64_t num_seqs, num_kv_heads, group, block_size;
    float scale;
    int64_t window;  /* <= 0: none */
    float soft_cap;  /* <= 0: none */
} Args;

/* The first position sequence g's query sees. */
INLINE int64_t seq_start(const Args *a, int64_t g) {
    const int64_t from = a->seq_lens[g] - a->window;
    return a->window > 0 && from > a->start ? from : a->start;
}

/* cap * tanh(s / cap) for n scores, as cap - 2 cap / (exp(2 s / cap) + 1), which the
 * compiler vectorises with the vector expf; s / cap is clamped to +-9 (tanh(9) is 1 in
 * float32) so that exp stays finite, as -ffast-math assumes. */
INLINE void soft_cap_in_place(float *s, int64_t n, float cap) {
    const float inv = 1.f / cap;
    for (int64_t j = 0; j < n; ++j) {
        float x = s[j] * inv;
        x = x > 9.f ? 9.f : (x < -9.f ? -9.f : x);
        s[j] = cap - 2.f * cap / (expf(2.f * x) + 1.f);
    }
}

/* Sequence g, kv heads [h0, h1). `D` is a constant in the specialised copies. */
INLINE void attend(const Args *a, int bf16, const int64_t D, int64_t g, int64_t h0, int64_t h1,
                   int64_t max_len, float *scratch) {
    const int64_t R = a->group, Hkv = a->num_kv_heads, H = Hkv * R, bs = a->block_size;
    const int64_t rows = (h1 - h0) * R; /* query rows of this task */
    const int64_t esize = bf16 ? 2 : 4;
    float *scores = scratch;            /* [rows, max_len] */
    float *acc = scores + rows * max_len; /* [rows, D] */
    float *qf = acc + rows * D;           /* [rows, D] */
    float *row = qf + rows * D;           /* one token's K or V of the task's heads */
    float *row_max = row + (h1 - h0) * D, *row_sum = row_max + rows;

    const int64_t start = seq_start(a, g), n = a->seq_lens[g] - start;
    const int64_t *table = a->tables + g * a->table_stride;
    const char *qg = (const char *)a->q + (g * a->q_seq_stride + h0 * R * D) * esize;
    const float *qs = as_float(qg, bf16, qf, rows * D);
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
                const float *x = as_float(base + t * slot_elems * esize, bf16, row, (h1 - h0) * D);
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
        if (bf16) {
            bf16_t *o = (bf16_t *)a->out + (g * H + head) * D;
            for (int64_t d = 0; d < D; ++d) o[d] = float_to_bf16(acc[r * D + d] * inv);
        } else {
            float *o = (float *)a->out + (g * H + head) * D;
            for (int64_t d = 0; d < D; ++d) o[d] = acc[r * D + d] * inv;
        }
        if (a->lse) a->lse[g * H + head] = row_max[r] + logf(row_sum[r]);
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* 16 elements at `p` (float32, or bfloat16 when `bf16`) as one float32 vector. */
INLINE __m512 load16(const void *p, int bf16) {
    if (!bf16) return _mm512_loadu_ps(p);
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
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
INLINE void attend_avx512(const Args *a, int bf16, const int64_t D, int64_t g, int64_t h0, int64_t h1,
                          int64_t max_len, float *scratch) {
    enum { RG = 4, MAX_C = 8 };
    /* Rows per group: the K pass holds a row's q (C vectors), the V pass its acc (C), and a
     * group's must fit in the 32 registers beside the K or V row (C more): 4 rows at D=64
     * (16 + 4), 2 at D=128 (16 + 8). */
    const int64_t C = D / 16, group_rows = D == 64 ? 4 : 2;
    const int64_t R = a->group, Hkv = a->num_kv_heads, H = Hkv * R, bs = a->block_size;
    const int64_t esize = bf16 ? 2 : 4;
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
                        q[r][c] = _mm512_mul_ps(load16(qp, bf16), scale);
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
                    for (int64_t c = 0; c < C; ++c) k[c] = load16(kp + c * 16 * esize, bf16);
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
                    for (int64_t c = 0; c < C; ++c) v[c] = load16(vp + c * 16 * esize, bf16);
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
                if (bf16) {
                    bf16_t *o = (bf16_t *)a->out + (g * H + head) * D;
                    for (int64_t d = 0; d < D; ++d) o[d] = float_to_bf16(row[d]);
                } else {
                    memcpy((float *)a->out + (g * H + head) * D, row, sizeof(float) * D);
                }
                if (a->lse) a->lse[g * H + head] = top[r] + logf(sum[r]);
            }
        }
    }
}
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

INLINE int run(const Args *a, int bf16, int64_t D, int num_threads) {
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
    /* attend()'s buffers, or attend_avx512()'s scores and its 4 x 16 x 16 partial sums */
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
                attend_avx512(a, bf16, 64, g, h0, h1, max_len, scratch);
            else if (D == 128)
                attend_avx512(a, bf16, 128, g, h0, h1, max_len, scratch);
            else
#endif
            if (D == 64)
                attend(a, bf16, 64, g, h0, h1, max_len, scratch);
            else if (D == 128)
                attend(a, bf16, 128, g, h0, h1, max_len, scratch);
            else
                attend(a, bf16, D, g, h0, h1, max_len, scratch);
        }
        free(scratch);
    }
    return failed;
}

/* Returns 0; 1 when a thread's scratch could not be allocated; 2-4 for an input out of
 * range (check), before anything is read through it. */
#define EXPORT(NAME, BF16)                                                                      \
    int NAME(const void *q, int64_t q_seq_stride, const void *cache, int64_t num_blocks,       \
             const int64_t *tables, int64_t table_stride, int64_t table_width,                 \
             const int64_t *seq_lens, int64_t start, void *out, float *lse, int64_t num_seqs,  \
             int64_t num_kv_heads, int64_t group, int64_t head_size, int64_t block_size,        \
             float scale, int64_t window, float soft_cap, int num_threads) {                    \
        const Args a = {q, q_seq_stride, cache, tables, table_stride, table_width, num_blocks, \
                        seq_lens, start, out, lse, num_seqs, num_kv_heads, group, block_size,   \
                        scale, window, soft_cap};                                               \
        return run(&a, BF16, head_size, num_threads);                                          \
    }

EXPORT(paged_decode_f32, 0)
EXPORT(paged_decode_bf16, 1)

/* Whether head sizes 64 and 128 run attend_avx512(): 1 or 0. */
int paged_decode_avx512(void) {
#if defined(__AVX512F__)
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
