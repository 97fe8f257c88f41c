/* GGUF blocks dequantised straight to bfloat16 (gguf_dequantize_rows_bf16: a prefill's
 * row tiles), and the product of a few to a few dozen tokens of bfloat16 activations
 * through such tiles (gguf_gemm_bf16_shards): each 4-row tile of the weight dequantised
 * into a per-thread buffer in L1/L2, then multiplied by every token with our bf16
 * register tile (VDPBF16PS, ../bf16_tile.h). Its error is only the weights' bf16
 * rounding. Where each path is taken, and the timings: gguf_kernels.py, which compiles
 * this file with gguf_kernels.c (the block layouts are described there) and is its only
 * caller.
 *
 * Every value is gguf-py's (computed in the same order, products then differences,
 * never fused: -ffp-contract=off) rounded once to bfloat16, to nearest even. A block's
 * values take few distinct values per group: a Q4_0/Q4_K group's 16 (Q5_K's 32) are
 * computed once into a table of bf16 and each value is looked up by its integer
 * (vpermw); Q6_K and Q8_0 values are computed 16 at a time, with no float32 buffer in
 * between. Against gguf_kernels.c's float dequantisers and a bf16 cast (2026-12-05, the
 * Zen 5 VM, 2 threads, a Q4_K_M 853M model's layers and LM head): the 16-token products
 * 115 -> 106 ms, 4 tokens 69 -> 58 ms; every row dequantised 47 -> 32 ms (its Q4_K rows
 * 35 -> 25, Q6_K 12 -> 8.4). */

#include "gguf_blocks.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <stdlib.h>

#include "../bf16_tile.h"

/* Blocks are prefetched into L2 this far ahead of the one being dequantised: about two
 * tiles, so that the next tile's blocks arrive while this tile's products run (which
 * read no blocks). 8-32 KiB all gave the same: a Q4_K_M model's 16-token products
 * 106 -> 96 ms, 4-token 58 -> 48.5 (2026-12-05). */
#define TILE_PREFETCH_BYTES 16384

static inline __m256i load256(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline __m512 iota16(float start) {
    return _mm512_add_ps(_mm512_set1_ps(start),
                         _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}

/* 32 values: the bf16 table entries (one 16-bit lane each) their 32 integers index. */
static inline void store_lookup(bf16 *out, __m256i q, __m512i table) {
    _mm512_storeu_si512((void *)out, _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(q), table));
}

/* 16 float values into bf16 lanes 0-15 of a table (lanes 16-31 zero). */
static inline __m512i table16(__m512 v) {
    return _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(v));
}

/* Q4_0: value = d * (q - 8); 16 bytes, low nibbles values 0-15, high 16-31. */
static inline void deq_q4_0_bf16(const uint8_t *b, bf16 *out) {
    const __m128i qs = _mm_loadu_si128((const __m128i *)(b + 2)), m4 = _mm_set1_epi8(15);
    const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), m4), _mm_and_si128(qs, m4));
    store_lookup(out, q, table16(_mm512_mul_ps(iota16(-8.f), _mm512_set1_ps(load_fp16(b)))));
}

/* Q8_0: value = d * q. */
static inline void deq_q8_0_bf16(const uint8_t *b, bf16 *out) {
    const __m512 d = _mm512_set1_ps(load_fp16(b));
    const __m128i q0 = _mm_loadu_si128((const __m128i *)(b + 2)), q1 = _mm_loadu_si128((const __m128i *)(b + 18));
    const __m512 lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)));
    const __m512 hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)));
    _mm512_storeu_si512((void *)out, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

/* Q4_K (qh NULL) and Q5_K: group g's value = (d * scale_g) * q - dmin * min_g, q its
 * nibble (and, for Q5_K, bit g of qh[l] as the fifth bit); each 64 values are 32 bytes,
 * low nibbles the first 32 (group 2j), high nibbles the next (group 2j + 1). */
static inline void deq_k_minmax_bf16(const uint8_t *b, const uint8_t *qh, const uint8_t *q, bf16 *out) {
    const float d = load_fp16(b), dmin = load_fp16(b + 2);
    const __m256i m4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
    const __m256i high = qh ? load256(qh) : _mm256_setzero_si256();
    const __m512 lo16 = iota16(0.f), hi16 = iota16(16.f);
    for (int j = 0; j < 4; ++j) {
        const __m256i v = load256(q + 32 * j);
        __m256i nib[2] = {_mm256_and_si256(v, m4), _mm256_and_si256(_mm256_srli_epi16(v, 4), m4)};
        for (int h = 0; h < 2; ++h) {
            const int g = 2 * j + h;
            int sc, m;
            scale_min_k4(g, b + 4, &sc, &m);
            const __m512 ds = _mm512_set1_ps(d * (float)sc), dm = _mm512_set1_ps(dmin * (float)m);
            const __m512 first = _mm512_sub_ps(_mm512_mul_ps(ds, lo16), dm);
            __m512i table;
            if (qh) {
                nib[h] = _mm256_or_si256(nib[h], _mm256_slli_epi16(
                                                     _mm256_and_si256(_mm256_srli_epi16(high, g), one), 4));
                table = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(_mm512_mul_ps(ds, hi16), dm), first);
            } else {
                table = table16(first);
            }
            store_lookup(out + 64 * j + 32 * h, nib[h], table);
        }
    }
}

/* Q6_K: value = (d * scale) * (q - 32), 16 values a scale. Per 128 values, ql's 64 bytes
 * hold the low 4 bits (byte l < 32: values l and 64 + l, low nibble first; byte 32 + l:
 * values 32 + l and 96 + l) and qh's 32 the top 2 (byte l: of l, 32 + l, 64 + l, 96 + l). */
static inline void deq_q6_k_bf16(const uint8_t *b, bf16 *out) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = load_fp16(b + 208);
    const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3), off = _mm256_set1_epi8(32);
    for (int n = 0; n < 2; ++n) {
        /* each value's 6 bits put together 32 bytes at a time, less 32: int8 in [-32, 32) */
        const __m256i a = load256(ql), c = load256(ql + 32), e = load256(qh);
        const __m256i q[4] = {
            _mm256_or_si256(_mm256_and_si256(a, m4), _mm256_slli_epi16(_mm256_and_si256(e, m2), 4)),
            _mm256_or_si256(_mm256_and_si256(c, m4),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(e, 2), m2), 4)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), m4),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(e, 4), m2), 4)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c, 4), m4),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(e, 6), m2), 4))};
        for (int i = 0; i < 4; ++i) { /* values 32i + [0, 32): scales 2i (first 16) and 2i + 1 */
            const __m256i v = _mm256_sub_epi8(q[i], off);
            const __m512 lo = _mm512_mul_ps(_mm512_set1_ps(d * (float)sc[2 * i]),
                                            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v))));
            const __m512 hi = _mm512_mul_ps(_mm512_set1_ps(d * (float)sc[2 * i + 1]),
                                            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1))));
            _mm512_storeu_si512((void *)(out + 32 * i), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
        out += 128;
        ql += 64;
        qh += 32;
        sc += 8;
    }
}

/* Rows [0, rows) of the block-format weight at w (row r at w + r * row_bytes),
 * dequantised and rounded to bfloat16 into tile[r * ldt + i], i < k. Inlined per type. */
static inline __attribute__((always_inline)) void deq_rows_bf16(const int qtype, const uint8_t *w,
                                                                int64_t row_bytes, int64_t k, int rows,
                                                                bf16 *tile, int64_t ldt) {
    const int bs = block_size(qtype), bb = block_bytes(qtype);
    for (int r = 0; r < rows; ++r) {
        const uint8_t *row = w + r * row_bytes;
        bf16 *out = tile + r * ldt;
        for (int64_t kb = 0; kb < k; kb += bs) {
            const uint8_t *blk = row + (kb / bs) * bb;
            for (int off = 0; off < bb; off += 64)
                _mm_prefetch((const char *)blk + TILE_PREFETCH_BYTES + off, _MM_HINT_T1);
            switch (qtype) {
            case T_Q4_0: deq_q4_0_bf16(blk, out + kb); break;
            case T_Q8_0: deq_q8_0_bf16(blk, out + kb); break;
            case T_Q4_K: deq_k_minmax_bf16(blk, NULL, blk + 16, out + kb); break;
            case T_Q5_K: deq_k_minmax_bf16(blk, blk + 16, blk + 48, out + kb); break;
            default: deq_q6_k_bf16(blk, out + kb); break;
            }
        }
    }
}

#define DEQ_CASE(t) case t: deq_rows_bf16(t, w, row_bytes, k, rows, tile, ldt); break;
static void dequantize_tile_bf16(int qtype, const uint8_t *w, int64_t row_bytes, int64_t k, int rows, bf16 *tile,
                                 int64_t ldt) {
    switch (qtype) {
        DEQ_CASE(T_Q4_0) DEQ_CASE(T_Q8_0) DEQ_CASE(T_Q4_K) DEQ_CASE(T_Q5_K) DEQ_CASE(T_Q6_K)
    }
}
#undef DEQ_CASE

/* out[i * ldo : i * ldo + k] = row i of the block-format weight w dequantised and rounded
 * to bfloat16, for i < n (a prefill's row tiles, without a float32 copy first). Returns
 * 0, or -1 for an unknown type. */
int gguf_dequantize_rows_bf16(int qtype, const uint8_t *w, int64_t row_bytes, int64_t k, int64_t n, bf16 *out,
                              int64_t ldo, int num_threads) {
    if (block_bytes(qtype) == 0) return -1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (n * k >= (1 << 16))
    for (int64_t i = 0; i < n; ++i)
        dequantize_tile_bf16(qtype, w + i * row_bytes, row_bytes, k, 1, out + i * ldo, ldo);
    return 0;
}

/* As gguf_gemm_q8_shards (n shards sharing one input, y[t * ldy + o_i + r] = W_i[r, :] .
 * x[t, :], y_dtype as out_t's), for bfloat16 x (row stride ldx) through dequantised bf16
 * tiles. Returns 0; -1 for an unknown type (nothing written); -3 when a thread's tile
 * cannot be allocated. */
int gguf_gemm_bf16_shards(int n, const int *qtypes, const uint8_t *const *w, const int64_t *rows,
                          const int64_t *row_bytes, int64_t k, const bf16 *x, int64_t ldx, int64_t m, void *y,
                          int y_dtype, int64_t ldy, int num_threads) {
    if (y_dtype < 0 || y_dtype > 2) return -1;
    const out_t yo = {y, y_dtype, ldy};
    int64_t tiles = 0;
    for (int i = 0; i < n; ++i) {
        if (block_bytes(qtypes[i]) == 0) return -1;
        tiles += (rows[i] + BF16_TILE_ROWS - 1) / BF16_TILE_ROWS;
    }
    const int64_t ldt = (k + 31) / 32 * 32;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        bf16 *tile = aligned_alloc(64, (size_t)(BF16_TILE_ROWS * ldt) * sizeof(bf16));
        if (!tile) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t g = 0; g < tiles; ++g) {
            if (!tile) continue;
            const tile_pos_t at = tile_position(rows, g, BF16_TILE_ROWS);
            const int i = at.shard, nr = at.rows;
            const int64_t offset = at.offset, r0 = at.r0;
            dequantize_tile_bf16(qtypes[i], w[i] + r0 * row_bytes[i], row_bytes[i], k, nr, tile, ldt);
            for (int64_t m0 = 0; m0 < m; m0 += BF16_TILE_TOKENS) {
                const int nt = (int)(m - m0 < BF16_TILE_TOKENS ? m - m0 : BF16_TILE_TOKENS);
                float out[BF16_TILE_ROWS * BF16_TILE_TOKENS];
                _mm512_storeu_ps(out, bf16_run_tile(tile, ldt, x + m0 * ldx, ldx, k, nr, nt, NULL, 0, 1));
                for (int t = 0; t < nt; ++t)
                    for (int r = 0; r < nr; ++r)
                        out_store(&yo, m0 + t, offset + r0 + r, out[t * BF16_TILE_ROWS + r]); /* lane 4t + r */
            }
        }
        free(tile);
    }
    return failed ? -3 : 0;
}
#else
int gguf_dequantize_rows_bf16(int qtype, const uint8_t *w, int64_t row_bytes, int64_t k, int64_t n, uint16_t *out,
                              int64_t ldo, int num_threads) {
    (void)qtype; (void)w; (void)row_bytes; (void)k; (void)n; (void)out; (void)ldo; (void)num_threads;
    return -2;
}

int gguf_gemm_bf16_shards(int n, const int *qtypes, const uint8_t *const *w, const int64_t *rows,
                          const int64_t *row_bytes, int64_t k, const uint16_t *x, int64_t ldx, int64_t m, void *y,
                          int y_dtype, int64_t ldy, int num_threads) {
    (void)n; (void)qtypes; (void)w; (void)rows; (void)row_bytes; (void)k; (void)x; (void)ldx; (void)m; (void)y;
    (void)y_dtype; (void)ldy; (void)num_threads;
    return -2;
}
#endif
