/* K-quant rows (Q4_K, Q5_K, Q6_K) times 8 or more tokens of 16-bit activations, in
 * integers, on AVX2 CPUs without AVX-512 VNNI: gguf_vnni_tiles.c's entry point
 * (gguf_gemm_int8_tiles) and contract, built instead of it there (GGUF_INT8_AVX2).
 *
 * The activations are quantised per token and per 32 values to int8 (dx = amax / 127,
 * rounded to nearest even), as gguf_vnni_tiles.c quantises them. Each tile of 8 rows is
 * unpacked once per call into a per-thread buffer of bytes with one row per 32-bit lane
 * (lane r holds 4 consecutive values of row r): one 32-byte load of the buffer and one
 * token's 4 activations broadcast meet in vpmaddubsw (32 products, pairs summed to 16
 * bits), so each token's sums stay in the lanes of their rows. A 32-value group's eight
 * steps add up in 16 bits where they cannot overflow (Q4_K's 4-bit values: 8 * 2 * 15 *
 * 127 < 2^15; Q5_K's and Q6_K's per 4 and 2 steps), vpmaddwd widens them to 32 bits per
 * row, and the group's sum is scaled in float by the token's dx and the rows' d * scale;
 * Q4_K/Q5_K's min is one fused multiply-add from the sums of x taken while quantising,
 * Q6_K's offset (q - 32) is -32 * sum(xq) per 16 values, subtracted in integers.
 *
 * Error against float activations: at most sum_i |w_i| * dx_i / 2 per output, as the
 * AVX-512 tiles'. Each output is one thread's sum in a fixed order. */

#include "gguf_blocks.h"

#ifdef GGUF_INT8_AVX2
#include <immintrin.h>
#include <omp.h>
#include <stdlib.h>

#define TILE_ROWS 8   /* one row per 32-bit lane */
#define TILE_TOKENS 4 /* tokens sharing each load of the unpacked tile */

/* The quantised activations of every token, read by every thread. */
typedef struct {
    int64_t k;
    int8_t *xq;    /* [m][k], natural order */
    float *dx;     /* [m][k / 32]: dx of each 32 */
    float *xs32;   /* [m][k / 32]: dx * sum(xq) per 32 (Q4_K/Q5_K mins) */
    int32_t *is16; /* [m][k / 16]: 32 * sum(xq) per 16 (Q6_K's offset) */
} qx_t;

static inline float half_to_float(uint16_t h, int x_dtype) {
    if (x_dtype == 1) {
        const uint32_t bits = (uint32_t)h << 16;
        float f;
        memcpy(&f, &bits, sizeof f);
        return f;
    }
    return _cvtsh_ss(h);
}

static void quantize_token(const uint16_t *x, int x_dtype, const qx_t *q, int64_t t) {
    const int64_t k = q->k;
    int8_t *xq = q->xq + t * k;
    for (int64_t g = 0; g < k / 32; ++g) {
        float v[32], amax = 0.f;
        for (int i = 0; i < 32; ++i) {
            v[i] = half_to_float(x[32 * g + i], x_dtype);
            amax = fmaxf(amax, fabsf(v[i]));
        }
        const float dx = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        int sum[2] = {0, 0};
        for (int i = 0; i < 32; ++i) {
            const int r = (int)nearbyintf(v[i] * inv); /* to nearest even, as cvtps2dq */
            xq[32 * g + i] = (int8_t)r;
            sum[i / 16] += r;
        }
        q->dx[t * (k / 32) + g] = dx;
        q->xs32[t * (k / 32) + g] = dx * (float)(sum[0] + sum[1]);
        q->is16[t * (k / 16) + 2 * g] = 32 * sum[0];
        q->is16[t * (k / 16) + 2 * g + 1] = 32 * sum[1];
    }
}


/* r[i] (8 words of row i) -> r[c] (word c of every row): an 8 x 8 transpose. */
static inline void transpose8(__m256i v[8]) {
    __m256 r[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm256_castsi256_ps(v[i]);
    __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
    r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
    r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
    r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
    r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
    for (int i = 0; i < 8; ++i) v[i] = _mm256_castps_si256(r[i]);
}

/* One row's super-block b as 8 vectors of 32 values (value 32v + l in byte l of vector v,
 * unsigned: Q6_K's before its - 32), and its scales: sc[v] = d * scale (Q4_K/Q5_K per
 * 32, Q6_K per 16: sc[0..16)), mn[v] = dmin * min. */
static inline void unpack_superblock(int qtype, const uint8_t *b, __m256i w[8], float *sc, float *mn) {
    k_codes_avx2(qtype, b, w);
    if (qtype == T_Q6_K) {
        const float d = load_fp16(b + 208);
        for (int i = 0; i < 16; ++i) sc[i] = d * (float)((const int8_t *)(b + 192))[i];
        return;
    }
    const float d = load_fp16(b), dmin = load_fp16(b + 2);
    for (int v = 0; v < 8; ++v) {
        int s, m;
        scale_min_k4(v, b + 4, &s, &m);
        sc[v] = d * (float)s;
        mn[v] = dmin * (float)m;
    }
}

/* Rows [0, nr) (nr <= 8) of the tile at w (row r at w + r * row_bytes), nsb super-blocks
 * each, into wq (for 32-group g: 8 vectors, vector j holding word j of every row, at
 * wq + (8 g + j) * 32), s1 (d * scale per 32 or, Q6_K, per 16: [group][row]) and s2 (dmin
 * * min per 32: [group][row]). Rows past nr are zeros. */
static void unpack_tile(int qtype, const uint8_t *w, int64_t row_bytes, int nr, int64_t nsb, uint8_t *wq,
                        float *s1, float *s2) {
    const int bb = block_bytes(qtype), per16 = qtype == T_Q6_K;
    for (int64_t s = 0; s < nsb; ++s) {
        __m256i v[8][8]; /* [row][32-group of this super-block] */
        float sc[TILE_ROWS][16], mn[TILE_ROWS][8];
        for (int r = 0; r < TILE_ROWS; ++r) {
            if (r < nr) {
                unpack_superblock(qtype, w + r * row_bytes + s * bb, v[r], sc[r], mn[r]);
            } else {
                for (int g = 0; g < 8; ++g) v[r][g] = _mm256_setzero_si256();
                memset(sc[r], 0, sizeof sc[r]);
                memset(mn[r], 0, sizeof mn[r]);
            }
        }
        for (int g = 0; g < 8; ++g) {
            __m256i col[8];
            for (int r = 0; r < TILE_ROWS; ++r) col[r] = v[r][g];
            transpose8(col);
            for (int j = 0; j < 8; ++j) _mm256_store_si256((__m256i *)(wq + ((8 * s + g) * 8 + j) * 32), col[j]);
            for (int r = 0; r < TILE_ROWS; ++r) {
                if (per16) {
                    s1[(16 * s + 2 * g) * TILE_ROWS + r] = sc[r][2 * g];
                    s1[(16 * s + 2 * g + 1) * TILE_ROWS + r] = sc[r][2 * g + 1];
                } else {
                    s1[(8 * s + g) * TILE_ROWS + r] = sc[r][g];
                    s2[(8 * s + g) * TILE_ROWS + r] = mn[r][g];
                }
            }
        }
    }
}

/* acc[t] (lane r: row r) = the tile's rows times tokens t0 .. t0 + nt - 1. Inlined per
 * constant qtype and nt. */
static inline __attribute__((always_inline)) void tile_times_qx_n(int qtype, const int nt, const uint8_t *wq,
                                                                  const float *s1, const float *s2, const qx_t *q,
                                                                  int64_t t0, __m256 *acc) {
    const int64_t k = q->k, groups = k / 32;
    /* steps of 4 values whose vpmaddubsw sums may add up in 16 bits (see the header) */
    const int run = qtype == T_Q4_K ? 8 : qtype == T_Q5_K ? 4 : 2;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int t = 0; t < nt; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t *wg = wq + g * 8 * 32;
        __m256i isum[TILE_TOKENS], ihalf[TILE_TOKENS];
        for (int t = 0; t < nt; ++t) isum[t] = ihalf[t] = _mm256_setzero_si256();
        for (int j0 = 0; j0 < 8; j0 += run) {
            __m256i s16[TILE_TOKENS];
            for (int t = 0; t < nt; ++t) s16[t] = _mm256_setzero_si256();
            for (int j = j0; j < j0 + run; ++j) {
                const __m256i wv = _mm256_load_si256((const __m256i *)(wg + 32 * j));
                for (int t = 0; t < nt; ++t) {
                    int32_t x4;
                    memcpy(&x4, q->xq + (t0 + t) * k + 32 * g + 4 * j, 4);
                    s16[t] = _mm256_add_epi16(s16[t], _mm256_maddubs_epi16(wv, _mm256_set1_epi32(x4)));
                }
            }
            for (int t = 0; t < nt; ++t) {
                const __m256i s32 = _mm256_madd_epi16(s16[t], ones);
                if (qtype == T_Q6_K && j0 >= 4)
                    ihalf[t] = _mm256_add_epi32(ihalf[t], s32); /* values 16-31: the second scale */
                else
                    isum[t] = _mm256_add_epi32(isum[t], s32);
            }
        }
        for (int t = 0; t < nt; ++t) {
            const int64_t tg = (t0 + t) * groups + g;
            const __m256 dx = _mm256_set1_ps(q->dx[tg]);
            if (qtype == T_Q6_K) { /* per 16: (sum - 32 * sum(xq)) * d * scale */
                const int32_t *off = q->is16 + (t0 + t) * (k / 16) + 2 * g;
                const __m256 a = _mm256_cvtepi32_ps(_mm256_sub_epi32(isum[t], _mm256_set1_epi32(off[0])));
                const __m256 b = _mm256_cvtepi32_ps(_mm256_sub_epi32(ihalf[t], _mm256_set1_epi32(off[1])));
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(a, dx), _mm256_load_ps(s1 + 2 * g * TILE_ROWS), acc[t]);
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(b, dx), _mm256_load_ps(s1 + (2 * g + 1) * TILE_ROWS), acc[t]);
            } else { /* sum * d * scale * dx - dmin * min * (dx * sum(xq)) */
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(isum[t]), dx),
                                         _mm256_load_ps(s1 + g * TILE_ROWS), acc[t]);
                acc[t] = _mm256_fnmadd_ps(_mm256_load_ps(s2 + g * TILE_ROWS), _mm256_set1_ps(q->xs32[tg]), acc[t]);
            }
        }
    }
}

static void tile_times_qx(int qtype, int nt, const uint8_t *wq, const float *s1, const float *s2, const qx_t *q,
                          int64_t t0, __m256 *acc) {
#define NT(qt) \
    switch (nt) { \
    case 1: tile_times_qx_n(qt, 1, wq, s1, s2, q, t0, acc); break; \
    case 2: tile_times_qx_n(qt, 2, wq, s1, s2, q, t0, acc); break; \
    case 3: tile_times_qx_n(qt, 3, wq, s1, s2, q, t0, acc); break; \
    default: tile_times_qx_n(qt, 4, wq, s1, s2, q, t0, acc); break; \
    }
    switch (qtype) {
    case T_Q4_K: NT(T_Q4_K) break;
    case T_Q5_K: NT(T_Q5_K) break;
    default: NT(T_Q6_K) break;
    }
#undef NT
}

static int tile_type(int qtype) { return qtype == T_Q4_K || qtype == T_Q5_K || qtype == T_Q6_K; }

/* See gguf_vnni_tiles.c: the same contract; -2 is never returned here. */
int gguf_gemm_int8_tiles(int n, const int *qtypes, const uint8_t *const *w, const int64_t *rows,
                         const int64_t *row_bytes, int64_t k, const uint16_t *x, int x_dtype, int64_t ldx, int64_t m,
                         void *y, int y_dtype, int64_t ldy, int num_threads) {
    if (y_dtype < 0 || y_dtype > 2 || x_dtype < 1 || x_dtype > 2 || k % 256) return -1;
    int64_t tiles = 0;
    for (int i = 0; i < n; ++i) {
        if (!tile_type(qtypes[i])) return -1;
        tiles += (rows[i] + TILE_ROWS - 1) / TILE_ROWS;
    }
    const out_t yo = {y, y_dtype, ldy};
    qx_t q = {k, malloc((size_t)(m * k)), malloc((size_t)(m * (k / 32)) * sizeof(float)),
              malloc((size_t)(m * (k / 32)) * sizeof(float)), malloc((size_t)(m * (k / 16)) * sizeof(int32_t))};
    int failed = !q.xq || !q.dx || !q.xs32 || !q.is16;
    if (!failed) {
#pragma omp parallel num_threads(num_threads)
        {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < m; ++t) quantize_token(x + t * ldx, x_dtype, &q, t);
            uint8_t *wq = aligned_alloc(64, (size_t)(TILE_ROWS * k));
            float *s1 = aligned_alloc(64, (size_t)(k / 16 * TILE_ROWS) * sizeof(float));
            float *s2 = aligned_alloc(64, (size_t)(k / 32 * TILE_ROWS) * sizeof(float));
            if (!wq || !s1 || !s2) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(static)
            for (int64_t g = 0; g < tiles; ++g) {
                if (!wq || !s1 || !s2) continue;
                const tile_pos_t at = tile_position(rows, g, TILE_ROWS);
                const int i = at.shard, nr = at.rows;
                unpack_tile(qtypes[i], w[i] + at.r0 * row_bytes[i], row_bytes[i], nr, k / 256, wq, s1, s2);
                for (int64_t t0 = 0; t0 < m; t0 += TILE_TOKENS) {
                    const int nt = (int)(m - t0 < TILE_TOKENS ? m - t0 : TILE_TOKENS);
                    __m256 acc[TILE_TOKENS];
                    float out[TILE_ROWS];
                    tile_times_qx(qtypes[i], nt, wq, s1, s2, &q, t0, acc);
                    for (int t = 0; t < nt; ++t) {
                        _mm256_storeu_ps(out, acc[t]);
                        for (int r = 0; r < nr; ++r) out_store(&yo, t0 + t, at.offset + at.r0 + r, out[r]);
                    }
                }
            }
            free(wq);
            free(s1);
            free(s2);
        }
    }
    free(q.xq);
    free(q.dx);
    free(q.xs32);
    free(q.is16);
    return failed ? -3 : 0;
}
#endif
