/* GGUF block formats read in place: a GEMV/small-GEMM that dequantises one block at a
 * time into a float buffer in L1 and multiplies it with every token's activations
 * (gguf_gemm), and a row dequantiser (a tiled larger-batch GEMM's tiles, an embedding's
 * looked-up rows). The product with int8-quantised activations (AVX-512 VNNI) is in
 * gguf_vnni.c, the bf16 tiles in gguf_bf16.c; what they share is in gguf_blocks.h.
 *
 * The contract (types, shapes, strides, who calls) is in gguf_kernels.py, which compiles
 * this file and is its only caller. The block layouts are llama.cpp's (ggml-common.h),
 * written here from their documented layout:
 *   Q4_0 (32 values, 18 bytes): fp16 d; 16 bytes, low nibbles values 0-15, high 16-31;
 *        value = d * (nibble - 8).
 *   Q8_0 (32, 34): fp16 d; 32 int8 q; value = d * q.
 *   Q4_K (256, 144): fp16 d, fp16 dmin; 12 bytes of eight 6-bit (scale, min) pairs;
 *        128 bytes of nibbles: each 64 values take 32 bytes, low nibbles first;
 *        value = (d * scale) * q - (dmin * min).
 *   Q5_K (256, 176): as Q4_K plus 32 bytes qh holding each value's fifth bit.
 *   Q6_K (256, 210): 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits), 16 int8
 *        scales, fp16 d; value = (d * scale) * (q - 32).
 * Every value is computed in the order gguf-py's dequantisers compute it, with
 * -ffp-contract=off, so a dequantised row equals theirs bit for bit; the dot products
 * accumulate with explicit fmaf in LANES running sums per token, added up in lane order:
 * a fixed order, so results do not depend on the thread count.
 *
 * Portable C: the loops are written so that the compiler vectorises them for the build
 * CPU (-march=native: AVX-512 here, AVX2 or scalar elsewhere).
 */

#include "gguf_blocks.h"

MAYBE_UNUSED static void deq_q4_0(const uint8_t *b, float *y) {
    const float d = load_fp16(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < 16; ++j) {
        y[j] = d * (float)((int)(qs[j] & 15) - 8);
        y[j + 16] = d * (float)((int)(qs[j] >> 4) - 8);
    }
}

MAYBE_UNUSED static void deq_q8_0(const uint8_t *b, float *y) {
    const float d = load_fp16(b);
    const int8_t *qs = (const int8_t *)(b + 2);
    for (int j = 0; j < 32; ++j) y[j] = d * (float)qs[j];
}

/* Q4_K (qh NULL) and Q5_K: each 64 values are 32 bytes of nibbles (+ one qh bit each:
 * the fifth bit of value l of sub-block j is bit j of qh[l]). */
MAYBE_UNUSED static void deq_k_minmax(const uint8_t *b, const uint8_t *qh, const uint8_t *q, float *y) {
    const float d = load_fp16(b), dmin = load_fp16(b + 2);
    for (int j = 0; j < 4; ++j) {
        int sc, m;
        scale_min_k4(2 * j, b + 4, &sc, &m);
        const float d1 = d * (float)sc, m1 = dmin * (float)m;
        scale_min_k4(2 * j + 1, b + 4, &sc, &m);
        const float d2 = d * (float)sc, m2 = dmin * (float)m;
        for (int l = 0; l < 32; ++l) {
            const int lo = (q[l] & 15) | (qh ? ((qh[l] >> (2 * j)) & 1) << 4 : 0);
            const int hi = (q[l] >> 4) | (qh ? ((qh[l] >> (2 * j + 1)) & 1) << 4 : 0);
            y[64 * j + l] = d1 * (float)lo - m1;
            y[64 * j + 32 + l] = d2 * (float)hi - m2;
        }
        q += 32;
    }
}

MAYBE_UNUSED static void deq_q6_k(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = load_fp16(b + 208);
    for (int n = 0; n < 2; ++n) { /* 128 values: 64 bytes of ql, 32 of qh, 8 scales */
        float ds[8];
        for (int i = 0; i < 8; ++i) ds[i] = d * (float)sc[i];
        for (int l = 0; l < 32; ++l) {
            const int is = l / 16;
            const int q1 = (int)((ql[l] & 15) | (((qh[l] >> 0) & 3) << 4)) - 32;
            const int q2 = (int)((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32;
            const int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            const int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            y[l] = ds[is] * (float)q1;
            y[l + 32] = ds[is + 2] * (float)q2;
            y[l + 64] = ds[is + 4] * (float)q3;
            y[l + 96] = ds[is + 6] * (float)q4;
        }
        y += 128;
        ql += 64;
        qh += 32;
        sc += 8;
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
/* The same dequantisers, 16 values per instruction: the same operations in the same
 * order (products, then differences, never fused), so the same bits. */
static inline __m512i u8x16(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline __m512 to_ps(__m512i v) { return _mm512_cvtepi32_ps(v); }

static void deq_q4_0_avx512(const uint8_t *b, float *y) {
    const __m512 d = _mm512_set1_ps(load_fp16(b));
    const __m512i q = u8x16(b + 2), eight = _mm512_set1_epi32(8), mask = _mm512_set1_epi32(15);
    _mm512_store_ps(y, _mm512_mul_ps(d, to_ps(_mm512_sub_epi32(_mm512_and_si512(q, mask), eight))));
    _mm512_store_ps(y + 16, _mm512_mul_ps(d, to_ps(_mm512_sub_epi32(_mm512_srli_epi32(q, 4), eight))));
}

static void deq_q8_0_avx512(const uint8_t *b, float *y) {
    const __m512 d = _mm512_set1_ps(load_fp16(b));
    for (int h = 0; h < 2; ++h)
        _mm512_store_ps(y + 16 * h, _mm512_mul_ps(d, to_ps(_mm512_cvtepi8_epi32(
                                            _mm_loadu_si128((const __m128i *)(b + 2 + 16 * h))))));
}

static void deq_k_minmax_avx512(const uint8_t *b, const uint8_t *qh, const uint8_t *q, float *y) {
    const float d = load_fp16(b), dmin = load_fp16(b + 2);
    const __m512i mask = _mm512_set1_epi32(15), one = _mm512_set1_epi32(1);
    for (int j = 0; j < 4; ++j) {
        int sc, m;
        scale_min_k4(2 * j, b + 4, &sc, &m);
        const __m512 d1 = _mm512_set1_ps(d * (float)sc), m1 = _mm512_set1_ps(dmin * (float)m);
        scale_min_k4(2 * j + 1, b + 4, &sc, &m);
        const __m512 d2 = _mm512_set1_ps(d * (float)sc), m2 = _mm512_set1_ps(dmin * (float)m);
        for (int h = 0; h < 2; ++h) {
            const __m512i v = u8x16(q + 16 * h);
            __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_srli_epi32(v, 4);
            if (qh) {
                const __m512i bits = u8x16(qh + 16 * h);
                lo = _mm512_or_si512(lo, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(bits, 2 * j), one), 4));
                hi = _mm512_or_si512(hi, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(bits, 2 * j + 1), one), 4));
            }
            _mm512_store_ps(y + 64 * j + 16 * h, _mm512_sub_ps(_mm512_mul_ps(d1, to_ps(lo)), m1));
            _mm512_store_ps(y + 64 * j + 32 + 16 * h, _mm512_sub_ps(_mm512_mul_ps(d2, to_ps(hi)), m2));
        }
        q += 32;
    }
}

static void deq_q6_k_avx512(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = load_fp16(b + 208);
    const __m512i mask = _mm512_set1_epi32(15), three = _mm512_set1_epi32(3), off = _mm512_set1_epi32(32);
    for (int n = 0; n < 2; ++n) {
        for (int h = 0; h < 2; ++h) { /* l in [16h, 16h + 16): scales is = h */
            const __m512i a = u8x16(ql + 16 * h), c = u8x16(ql + 32 + 16 * h), e = u8x16(qh + 16 * h);
            const __m512i q1 = _mm512_or_si512(_mm512_and_si512(a, mask), _mm512_slli_epi32(_mm512_and_si512(e, three), 4));
            const __m512i q2 = _mm512_or_si512(_mm512_and_si512(c, mask),
                                               _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(e, 2), three), 4));
            const __m512i q3 = _mm512_or_si512(_mm512_srli_epi32(a, 4),
                                               _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(e, 4), three), 4));
            const __m512i q4 = _mm512_or_si512(_mm512_srli_epi32(c, 4),
                                               _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(e, 6), three), 4));
            _mm512_store_ps(y + 16 * h, _mm512_mul_ps(_mm512_set1_ps(d * (float)sc[h]), to_ps(_mm512_sub_epi32(q1, off))));
            _mm512_store_ps(y + 32 + 16 * h, _mm512_mul_ps(_mm512_set1_ps(d * (float)sc[h + 2]), to_ps(_mm512_sub_epi32(q2, off))));
            _mm512_store_ps(y + 64 + 16 * h, _mm512_mul_ps(_mm512_set1_ps(d * (float)sc[h + 4]), to_ps(_mm512_sub_epi32(q3, off))));
            _mm512_store_ps(y + 96 + 16 * h, _mm512_mul_ps(_mm512_set1_ps(d * (float)sc[h + 6]), to_ps(_mm512_sub_epi32(q4, off))));
        }
        y += 128;
        ql += 64;
        qh += 32;
        sc += 8;
    }
}

/* y must be 64-byte aligned. */
static void deq_block(int qtype, const uint8_t *b, float *y) {
    switch (qtype) {
    case T_Q4_0: deq_q4_0_avx512(b, y); break;
    case T_Q8_0: deq_q8_0_avx512(b, y); break;
    case T_Q4_K: deq_k_minmax_avx512(b, NULL, b + 16, y); break;
    case T_Q5_K: deq_k_minmax_avx512(b, b + 16, b + 48, y); break;
    default: deq_q6_k_avx512(b, y); break;
    }
}
#else
static void deq_block(int qtype, const uint8_t *b, float *y) {
    switch (qtype) {
    case T_Q4_0: deq_q4_0(b, y); break;
    case T_Q8_0: deq_q8_0(b, y); break;
    case T_Q4_K: deq_k_minmax(b, NULL, b + 16, y); break;
    case T_Q5_K: deq_k_minmax(b, b + 16, b + 48, y); break;
    default: deq_q6_k(b, y); break;
    }
}
#endif

/* y[t * ldy] = sum_k row[k] * x[t * ldx + k] for tokens t < m, one weight row of k
 * values (k a multiple of the block size). Each block is dequantised once per chunk of
 * MAX_TOKENS tokens. */
static void row_times_tokens(int qtype, const uint8_t *row, int64_t k, const float *x, int64_t ldx, int64_t m,
                             float *y, int64_t ldy) {
    const int bs = block_size(qtype), bb = block_bytes(qtype);
    float buf[QK] __attribute__((aligned(64)));
    for (int64_t t0 = 0; t0 < m; t0 += MAX_TOKENS) {
        const int nt = (int)(m - t0 < MAX_TOKENS ? m - t0 : MAX_TOKENS);
        float acc[MAX_TOKENS][LANES] __attribute__((aligned(64)));
        memset(acc, 0, sizeof acc);
        for (int64_t kb = 0; kb < k; kb += bs) {
            deq_block(qtype, row + (kb / bs) * bb, buf);
            for (int t = 0; t < nt; ++t) {
                const float *xt = x + (t0 + t) * ldx + kb;
                for (int i = 0; i < bs; i += LANES)
                    for (int l = 0; l < LANES; ++l) acc[t][l] = fmaf(buf[i + l], xt[i + l], acc[t][l]);
            }
        }
        for (int t = 0; t < nt; ++t) {
            float sum = 0.f;
            for (int l = 0; l < LANES; ++l) sum += acc[t][l];
            y[(t0 + t) * ldy] = sum;
        }
    }
}

/* y[t, r] (y + t * ldy + r) = W[r, :] . x[t, :] for rows r < rows of the block-format
 * weight w (row r at w + r * row_bytes) and tokens t < m. Returns 0, or -1 for a type
 * this file does not know (nothing written). */
int gguf_gemm(int qtype, const uint8_t *w, int64_t rows, int64_t k, int64_t row_bytes, const float *x, int64_t ldx,
              int64_t m, float *y, int64_t ldy, int num_threads) {
    if (block_bytes(qtype) == 0) return -1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * k >= (1 << 15))
    for (int64_t r = 0; r < rows; ++r)
        row_times_tokens(qtype, w + r * row_bytes, k, x, ldx, m, y + r, ldy);
    return 0;
}

/* out[i * ldo : i * ldo + k] = the dequantised row ids[i] of w (row i when ids is NULL)
 * for i < n. Returns 0, or -1 for an unknown type. */
int gguf_dequantize_rows(int qtype, const uint8_t *w, int64_t row_bytes, int64_t k, const int64_t *ids, int64_t n,
                         float *out, int64_t ldo, int num_threads) {
    const int bs = block_size(qtype), bb = block_bytes(qtype);
    if (bb == 0) return -1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (n * k >= (1 << 16))
    for (int64_t i = 0; i < n; ++i) {
        const uint8_t *row = w + (ids ? ids[i] : i) * row_bytes;
        float buf[QK] __attribute__((aligned(64)));
        for (int64_t kb = 0; kb < k; kb += bs) {
            deq_block(qtype, row + (kb / bs) * bb, buf);
            memcpy(out + i * ldo + kb, buf, (size_t)bs * sizeof(float));
        }
    }
    return 0;
}
