/* K-quant rows (Q4_K, Q5_K, Q6_K) and Q8_0 rows times 8 or more tokens of 16-bit
 * activations, in integers, on AVX2 CPUs without AVX-512 VNNI: gguf_vnni_tiles.c's entry
 * point (gguf_gemm_int8_tiles) and contract, built instead of it there (GGUF_INT8_AVX2);
 * gguf_vnni_tiles.c's take Q4_0 too (gguf_int8_tile_min_tokens says which, from how many tokens).
 *
 * The activations are quantised per token and per 32 values to int8 (dx = amax / 127,
 * rounded to nearest even), as gguf_vnni_tiles.c quantises them. Each tile of 16 rows is
 * unpacked 4 super-blocks at a time (16 KB of bytes, which stay in L1 while up to 128
 * tokens pass over them; more tokens are taken in blocks of 128, every tile passing over
 * one block before the next, so that a chunk's int8 x comes from L2 and the block's from
 * the last-level cache) into a per-thread buffer with one row per 32-bit lane: lane r
 * of vector v holds 4 consecutive values of row 8v + r, and one 32-byte load and one
 * token's 4 activations broadcast meet in vpmaddubsw (32 products, pairs summed to 16
 * bits), each token's sums staying in the lanes of their rows. Unpacking transposes the rows' code bytes as
 * stored (4 to 6 vectors per row) and decodes them after, byte by byte; the super-block
 * a chunk ahead is prefetched, as a decode streams every weight from memory.
 *
 * The register block is 16 rows by 2 tokens: 4 loads per 4 vpmaddubsw, 4 16-bit sums
 * and 4 float ones. A group's steps add up in 16 bits where they cannot overflow (Q4_K's
 * 4-bit values: 8 * 2 * 15 * 127 < 2^15; Q5_K's per 4 steps, Q6_K's per 2), then one
 * vpmaddwd by the rows' 6- or 8-bit group scales (each row's scale in both 16-bit halves
 * of its lane) widens them to 32 bits, already scaled; per token and 32 values one
 * conversion and one fused multiply-add by dx carry the sum into float, and d per
 * super-block and row multiplies once. Q4_K/Q5_K's mins, dmin * min per 32 times dx *
 * sum(xq) (taken while quantising), are a second pass per super-block over every token,
 * with the rows' 16 vectors of dmin * min held in registers. Q6_K's values q - 32 are
 * held signed and multiply the activations made unsigned (xq + 128, vpmaddubsw's
 * unsigned operand): the extra 128 * sum(scale * (q - 32)) per 32 values depends on the
 * row only and is taken off each group's sum (computed while unpacking). Q8_0's signed
 * 8-bit codes against signed int8 activations could saturate vpmaddubsw's 16-bit pair
 * sums, so they are widened to 16 bits while unpacking (twice the bytes: 2 runs of 256
 * values per chunk) and meet activation pairs in vpmaddwd, 32-bit sums per block of 32,
 * each scaled by dx * d: 170-180 GOP/s at 16 tokens, 210-235 from 128 on.
 *
 * Against the 8-row tiles it replaced (2026-12-06, this Zen 3 VM, 2 threads): a 5632 x
 * 2048 Q4_K weight 2.38 -> 1.4 ms at 16 tokens, 14.3 -> 8.2-8.9 ms at 128; Q6_K 2.20 ->
 * 1.9-2.2 ms and 14.5 -> 10.8-12 ms; at 2048 tokens of a 2048 x 5632 weight, Q4_K 200 ->
 * 330 GOP/s and Q6_K 199 -> 255.
 *
 * Error against float activations: at most sum_i |w_i| * dx_i / 2 per output, as the
 * AVX-512 tiles'. Each output is one thread's sum in a fixed order. */

#include "gguf_blocks.h"

#ifdef GGUF_INT8_AVX2
#include <immintrin.h>
#include <omp.h>
#include <stdlib.h>

#include "gguf_avx2_unpack.h"

#define TOKEN_BLOCK 128 /* tokens per pass over a tile: 1.1-1.4x at 2048 tokens against one pass */

/* The quantised activations of every token, read by every thread. */
typedef struct {
    int64_t k;
    int8_t *xq;  /* [m][k], natural order */
    uint8_t *xu; /* [m][k]: xq + 128 (Q6_K's unsigned operand), or NULL where no shard is Q6_K */
    float *dx;   /* [m][k / 32]: dx of each 32 */
    float *xs;   /* [m][k / 32]: dx * sum(xq) per 32 (Q4_K/Q5_K mins) */
    int16_t *x16; /* [m][k]: xq widened (Q8_0's operand, in pairs), or NULL where no shard is Q8_0 */
} qx_t;

/* Token t's k values: int8 per 32 (xq, xu), dx and dx * sum(xq) per 32. */
static void quantize_token(const uint16_t *x, int x_dtype, const qx_t *q, int64_t t) {
    const int64_t k = q->k;
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7), bias = _mm256_set1_epi8((char)0x80);
    for (int64_t g = 0; g < k / 32; ++g) {
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; ++i) {
            v[i] = x_load8(x, x_dtype, 32 * g + 8 * i);
            amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], abs_mask));
        }
        const float a = hmax8(amax), dx = a / 127.f;
        const __m256 inv = _mm256_set1_ps(a > 0.f ? 127.f / a : 0.f);
        __m256i r[4];
        for (int i = 0; i < 4; ++i) r[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)); /* nearest even */
        const int32_t sum = hsum8_epi32(_mm256_add_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3])));
        const __m256i bytes = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3])), order);
        _mm256_storeu_si256((__m256i *)(q->xq + t * k + 32 * g), bytes);
        if (q->xu) _mm256_storeu_si256((__m256i *)(q->xu + t * k + 32 * g), _mm256_xor_si256(bytes, bias));
        if (q->x16) {
            _mm256_storeu_si256((__m256i *)(q->x16 + t * k + 32 * g),
                                _mm256_cvtepi8_epi16(_mm256_castsi256_si128(bytes)));
            _mm256_storeu_si256((__m256i *)(q->x16 + t * k + 32 * g + 16),
                                _mm256_cvtepi8_epi16(_mm256_extracti128_si256(bytes, 1)));
        }
        q->dx[t * (k / 32) + g] = dx;
        q->xs[t * (k / 32) + g] = dx * (float)sum;
    }
}

/* acc[t][16] += the tile's super-block c (global super-block sb) times tokens t0 .. t0 +
 * nt - 1 (nt 1 or 2). Inlined per constant qtype and nt. */
static inline __attribute__((always_inline)) void superblock_times_tokens(const int qtype, const int nt,
                                                                           const tile_t *u, int c, const qx_t *q,
                                                                           int64_t sb, int64_t t0, float *acc) {
    const int64_t k = q->k, groups = k / 32;
    const int q6 = qtype == T_Q6_K;
    /* steps of 4 values whose vpmaddubsw sums may add up in 16 bits (see the header) */
    const int run = qtype == T_Q4_K ? 8 : qtype == T_Q5_K ? 4 : 2;
    const uint8_t *xb[2];
    for (int t = 0; t < nt; ++t) xb[t] = (q6 ? q->xu : (const uint8_t *)q->xq) + (t0 + t) * k + 256 * sb;
    __m256 f[2][2]; /* [t][v]: sum over groups of dx * scaled integer sum */
    for (int t = 0; t < nt; ++t) f[t][0] = f[t][1] = _mm256_setzero_ps();
    for (int g = 0; g < 8; ++g) {
        __m256i isum[2][2];
        for (int j0 = 0; j0 < 8; j0 += run) {
            __m256i s16[2][2];
            for (int j = j0; j < j0 + run; ++j) {
                const __m256i w0 = _mm256_load_si256(&u->w[c][g][j][0]);
                const __m256i w1 = _mm256_load_si256(&u->w[c][g][j][1]);
                for (int t = 0; t < nt; ++t) {
                    int32_t x4;
                    memcpy(&x4, xb[t] + 32 * g + 4 * j, 4);
                    const __m256i b = _mm256_set1_epi32(x4);
                    /* vpmaddubsw's first operand is the unsigned one: the codes, or Q6_K's activations */
                    const __m256i p0 = q6 ? _mm256_maddubs_epi16(b, w0) : _mm256_maddubs_epi16(w0, b);
                    const __m256i p1 = q6 ? _mm256_maddubs_epi16(b, w1) : _mm256_maddubs_epi16(w1, b);
                    s16[t][0] = j == j0 ? p0 : _mm256_add_epi16(s16[t][0], p0);
                    s16[t][1] = j == j0 ? p1 : _mm256_add_epi16(s16[t][1], p1);
                }
            }
            const int si = q6 ? 2 * g + j0 / 4 : g; /* Q6_K: steps 0-3 scale 2g, 4-7 scale 2g + 1 */
            for (int t = 0; t < nt; ++t)
                for (int v = 0; v < 2; ++v) {
                    const __m256i p = _mm256_madd_epi16(s16[t][v], u->sc[c][si][v]);
                    isum[t][v] = j0 == 0 ? p : _mm256_add_epi32(isum[t][v], p);
                }
        }
        for (int t = 0; t < nt; ++t) {
            const __m256 dx = _mm256_set1_ps(q->dx[(t0 + t) * groups + 8 * sb + g]);
            for (int v = 0; v < 2; ++v) {
                const __m256i s = q6 ? _mm256_sub_epi32(isum[t][v], u->corr[c][g][v]) : isum[t][v];
                f[t][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), dx, f[t][v]);
            }
        }
    }
    for (int t = 0; t < nt; ++t)
        for (int v = 0; v < 2; ++v) {
            float *a = acc + (t0 + t) * TILE_ROWS + 8 * v;
            _mm256_store_ps(a, _mm256_fmadd_ps(f[t][v], u->d[c][v], _mm256_load_ps(a)));
        }
}

/* acc[t][16] += Q8_0 slot c (values [256 sb, 256 sb + 256)) times tokens t0 .. t0 + nt -
 * 1 (nt 1 or 2): vpmaddwd of 16-bit weight pairs and activation pairs, 32-bit sums per
 * block (at most 32 * 128 * 127), then per block one conversion and one fused
 * multiply-add by dx * d. */
static inline __attribute__((always_inline)) void q8_0_times_tokens(const int nt, const tile_t *u, int c,
                                                                     const qx_t *q, int64_t sb, int64_t t0,
                                                                     float *acc) {
    const int64_t k = q->k, groups = k / 32;
    const __m256i(*W)[16][2] = (const __m256i(*)[16][2])u->w[2 * c];
    const int16_t *x0 = q->x16 + t0 * k + 256 * sb, *x1 = x0 + (nt == 2 ? k : 0);
    const float *dx0 = q->dx + t0 * groups + 8 * sb, *dx1 = dx0 + (nt == 2 ? groups : 0);
    __m256 f00 = _mm256_setzero_ps(), f01 = f00, f10 = f00, f11 = f00;
    for (int g = 0; g < 8; ++g) {
        __m256i i00 = _mm256_setzero_si256(), i01 = i00, i10 = i00, i11 = i00;
        for (int j = 0; j < 16; ++j) {
            const __m256i w0 = _mm256_load_si256(&W[g][j][0]), w1 = _mm256_load_si256(&W[g][j][1]);
            int32_t a, b;
            memcpy(&a, x0 + 32 * g + 2 * j, 4);
            const __m256i ba = _mm256_set1_epi32(a);
            i00 = _mm256_add_epi32(i00, _mm256_madd_epi16(w0, ba));
            i01 = _mm256_add_epi32(i01, _mm256_madd_epi16(w1, ba));
            if (nt == 2) {
                memcpy(&b, x1 + 32 * g + 2 * j, 4);
                const __m256i bb = _mm256_set1_epi32(b);
                i10 = _mm256_add_epi32(i10, _mm256_madd_epi16(w0, bb));
                i11 = _mm256_add_epi32(i11, _mm256_madd_epi16(w1, bb));
            }
        }
        const __m256 da = _mm256_set1_ps(dx0[g]);
        f00 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i00), _mm256_mul_ps(da, u->dq[c][g][0]), f00);
        f01 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i01), _mm256_mul_ps(da, u->dq[c][g][1]), f01);
        if (nt == 2) {
            const __m256 db = _mm256_set1_ps(dx1[g]);
            f10 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i10), _mm256_mul_ps(db, u->dq[c][g][0]), f10);
            f11 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i11), _mm256_mul_ps(db, u->dq[c][g][1]), f11);
        }
    }
    float *a = acc + t0 * TILE_ROWS;
    _mm256_store_ps(a, _mm256_add_ps(_mm256_load_ps(a), f00));
    _mm256_store_ps(a + 8, _mm256_add_ps(_mm256_load_ps(a + 8), f01));
    if (nt == 2) {
        _mm256_store_ps(a + 16, _mm256_add_ps(_mm256_load_ps(a + 16), f10));
        _mm256_store_ps(a + 24, _mm256_add_ps(_mm256_load_ps(a + 24), f11));
    }
}

/* acc[t] -= dmin * min * (dx * sum(xq)) per 32 of super-block c, for every token: the 16
 * vectors of dmin * min stay in registers while the tokens pass. */
static void mins_times_all(const tile_t *u, int c, const qx_t *q, int64_t sb, int64_t m, float *acc) {
    const int64_t groups = q->k / 32;
    __m256 mn0[8], mn1[8];
    for (int g = 0; g < 8; ++g) {
        mn0[g] = u->mn[c][g][0];
        mn1[g] = u->mn[c][g][1];
    }
    for (int64_t t = 0; t < m; ++t) {
        const float *xs = q->xs + t * groups + 8 * sb;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0; /* even and odd groups: shorter chains */
        for (int g = 0; g < 8; g += 2) {
            const __m256 x0 = _mm256_set1_ps(xs[g]), x1 = _mm256_set1_ps(xs[g + 1]);
            a0 = _mm256_fmadd_ps(mn0[g], x0, a0);
            a1 = _mm256_fmadd_ps(mn1[g], x0, a1);
            b0 = _mm256_fmadd_ps(mn0[g + 1], x1, b0);
            b1 = _mm256_fmadd_ps(mn1[g + 1], x1, b1);
        }
        float *a = acc + t * TILE_ROWS;
        _mm256_store_ps(a, _mm256_sub_ps(_mm256_load_ps(a), _mm256_add_ps(a0, b0)));
        _mm256_store_ps(a + 8, _mm256_sub_ps(_mm256_load_ps(a + 8), _mm256_add_ps(a1, b1)));
    }
}

#define TOKENS(qt) \
    int64_t t0 = 0; \
    for (; t0 + 2 <= m; t0 += 2) superblock_times_tokens(qt, 2, u, c, q, sb, t0, acc); \
    if (t0 < m) superblock_times_tokens(qt, 1, u, c, q, sb, t0, acc);

/* GCC 12's default order (no scheduling before register allocation) computes a Q4_K
 * group's 32 vpmaddubsw products (Q8_0's 64 vpmaddwd) ahead of their additions and
 * spills them; scheduling with register pressure in view keeps the block in registers:
 * 1.4x (2026-12-06, Zen 3). Q5_K's and Q6_K's shorter runs do not spill, and lose a little
 * with it; the unpacking loses more (1.6x slower), so the option covers these two. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("schedule-insns", "sched-pressure")
#endif
static void q4_k_times_all(const tile_t *u, int c, const qx_t *q, int64_t sb, int64_t m, float *acc) { TOKENS(T_Q4_K) }
static void q8_0_times_all(const tile_t *u, int c, const qx_t *q, int64_t sb, int64_t m, float *acc) {
    int64_t t0 = 0;
    for (; t0 + 2 <= m; t0 += 2) q8_0_times_tokens(2, u, c, q, sb, t0, acc);
    if (t0 < m) q8_0_times_tokens(1, u, c, q, sb, t0, acc);
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

static void superblock_times_all(int qtype, const tile_t *u, int c, const qx_t *q, int64_t sb, int64_t m,
                                 float *acc) {
    if (qtype == T_Q4_K) {
        q4_k_times_all(u, c, q, sb, m, acc);
    } else if (qtype == T_Q8_0) {
        q8_0_times_all(u, c, q, sb, m, acc);
    } else if (qtype == T_Q5_K) {
        TOKENS(T_Q5_K)
    } else {
        TOKENS(T_Q6_K)
    }
    if (qtype == T_Q4_K || qtype == T_Q5_K) mins_times_all(u, c, q, sb, m, acc);
}
#undef TOKENS

/* 8 outputs of token t from column c on, rounded once to y's dtype. */
static inline void store8(const out_t *y, int64_t t, int64_t c, __m256 v) {
    if (y->dtype == 0) {
        _mm256_storeu_ps((float *)y->p + t * y->ld + c, v);
        return;
    }
    __m128i h;
    if (y->dtype == 2) {
        h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
    } else {
        h = float_to_bf16x8(v);
    }
    _mm_storeu_si128((__m128i *)((uint16_t *)y->p + t * y->ld + c), h);
}

/* One tile (tile g of the `tiles` over every shard) times tokens t0 .. t0 + mb - 1 (mb <=
 * TOKEN_BLOCK; qb: the quantised activations from token t0 on), written to y: its
 * super-blocks unpacked CHUNK at a time into u, the tokens' sums in acc. */
static void tile_times_block(const int *qtypes, const uint8_t *const *w, const int64_t *rows,
                             const int64_t *row_bytes, int64_t tiles, int64_t g, const qx_t *qb, int64_t t0,
                             int64_t mb, const out_t *yo, tile_t *u, float *acc) {
    const int64_t k = qb->k;
    const tile_pos_t at = tile_position(rows, g, TILE_ROWS);
    const int i = at.shard, nr = at.rows;
    const uint8_t *wt = w[i] + at.r0 * row_bytes[i];
    /* where the tile after this one starts, for the prefetches */
    const tile_pos_t nx = tile_position(rows, g + 1 < tiles ? g + 1 : g, TILE_ROWS);
    const uint8_t *wn = w[nx.shard] + nx.r0 * row_bytes[nx.shard];
    const int64_t col = at.offset + at.r0;
    const int per = qtypes[i] == T_Q8_0 ? CHUNK / 2 : CHUNK; /* runs of 256 per chunk */
    memset(acc, 0, (size_t)(mb * TILE_ROWS) * sizeof(float));
    for (int64_t s0 = 0; s0 < k / 256; s0 += per) {
        const int nc = (int)(k / 256 - s0 < per ? k / 256 - s0 : per);
        for (int c = 0; c < nc; ++c) {
            /* a decode streams every weight from memory: the 256 values a chunk ahead (or
             * the next tile's) are fetched while this chunk computes */
            const int64_t ahead = s0 + c + per;
            if (ahead < k / 256)
                prefetch_superblock(wt, row_bytes[i], nr, ahead * sb_bytes(qtypes[i]), sb_bytes(qtypes[i]));
            else if (g + 1 < tiles && ahead - k / 256 < k / 256)
                prefetch_superblock(wn, row_bytes[nx.shard], nx.rows, (ahead - k / 256) * sb_bytes(qtypes[nx.shard]),
                                    sb_bytes(qtypes[nx.shard]));
            unpack_superblock(qtypes[i], wt, row_bytes[i], nr, s0 + c, u, c);
        }
        for (int c = 0; c < nc; ++c) superblock_times_all(qtypes[i], u, c, qb, s0 + c, mb, acc);
    }
    for (int64_t t = 0; t < mb; ++t) {
        const float *a = acc + t * TILE_ROWS;
        if (nr == TILE_ROWS) {
            store8(yo, t0 + t, col, _mm256_load_ps(a));
            store8(yo, t0 + t, col + 8, _mm256_load_ps(a + 8));
        } else {
            for (int r = 0; r < nr; ++r) out_store(yo, t0 + t, col + r, a[r]);
        }
    }
}

static int tile_type(int qtype) { return qtype == T_Q4_K || qtype == T_Q5_K || qtype == T_Q6_K || qtype == T_Q8_0; }

/* See gguf_vnni_tiles.c: the K-quants and Q8_0 from 8 tokens (no bf16 tiles here). */
int gguf_int8_tile_min_tokens(int qtype) { return tile_type(qtype) ? 8 : 0; }

/* See gguf_vnni_tiles.c: the same contract; -2 is never returned here. */
int gguf_gemm_int8_tiles(int n, const int *qtypes, const uint8_t *const *w, const int64_t *rows,
                         const int64_t *row_bytes, int64_t k, const uint16_t *x, int x_dtype, int64_t ldx, int64_t m,
                         void *y, int y_dtype, int64_t ldy, int num_threads) {
    if (y_dtype < 0 || y_dtype > 2 || x_dtype < 1 || x_dtype > 2 || k % 256) return -1;
    int64_t tiles = 0;
    int any_q6 = 0, any_q8 = 0;
    for (int i = 0; i < n; ++i) {
        if (!tile_type(qtypes[i])) return -1;
        any_q6 |= qtypes[i] == T_Q6_K;
        any_q8 |= qtypes[i] == T_Q8_0;
        tiles += (rows[i] + TILE_ROWS - 1) / TILE_ROWS;
    }
    const out_t yo = {y, y_dtype, ldy};
    qx_t q = {k, malloc((size_t)(m * k)), any_q6 ? malloc((size_t)(m * k)) : NULL,
              malloc((size_t)(m * (k / 32)) * sizeof(float)), malloc((size_t)(m * (k / 32)) * sizeof(float)),
              any_q8 ? malloc((size_t)(m * k) * sizeof(int16_t)) : NULL};
    int failed = !q.xq || (any_q6 && !q.xu) || !q.dx || !q.xs || (any_q8 && !q.x16);
    if (!failed) {
#pragma omp parallel num_threads(num_threads)
        {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < m; ++t) quantize_token(x + t * ldx, x_dtype, &q, t);
            tile_t *u = aligned_alloc(64, sizeof(tile_t));
            float *acc = aligned_alloc(64, (size_t)(TOKEN_BLOCK * TILE_ROWS) * sizeof(float));
            if (!u || !acc) {
#pragma omp atomic write
                failed = 1;
            }
/* Token blocks outside, tiles inside: a block's activations (up to 1.4 MB of
             * Q8_0's 16-bit x at k = 5632) stay in the last-level cache while every tile
             * passes over them, where tiles outside walked all of m's per tile: 1.04-1.34x
             * at 2048 tokens (2026-12-06, Zen 3). The implicit barrier after each block
             * costs nothing at these sizes; up to 128 tokens it is one block as before. */
            for (int64_t t0 = 0; t0 < m; t0 += TOKEN_BLOCK) {
                const int64_t mb = m - t0 < TOKEN_BLOCK ? m - t0 : TOKEN_BLOCK;
                const qx_t qb = {k, q.xq + t0 * k, q.xu ? q.xu + t0 * k : NULL, q.dx + t0 * (k / 32),
                                 q.xs + t0 * (k / 32), q.x16 ? q.x16 + t0 * k : NULL};
#pragma omp for schedule(static)
                for (int64_t g = 0; g < tiles; ++g)
                    if (u && acc) tile_times_block(qtypes, w, rows, row_bytes, tiles, g, &qb, t0, mb, &yo, u, acc);
            }
            free(u);
            free(acc);
        }
    }
    free(q.xq);
    free(q.xu);
    free(q.dx);
    free(q.xs);
    free(q.x16);
    return failed ? -3 : 0;
}
#endif
