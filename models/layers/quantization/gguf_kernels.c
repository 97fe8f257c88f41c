/* GGUF block formats read in place: a GEMV/small-GEMM that dequantises one block at a
 * time into a float buffer in L1 and multiplies it with every token's activations
 * (gguf_gemm), one that multiplies the blocks' integers with int8-quantised activations
 * by AVX-512 VNNI (gguf_gemm_q8, at the end of this file), and a row dequantiser (a
 * tiled larger-batch GEMM's tiles, an embedding's looked-up rows).
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

#include <stdint.h>
#include <string.h>
#include <math.h>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define LANES 16
#define MAX_TOKENS 8 /* tokens sharing one dequantised block; more are done in chunks */
#define QK 256       /* the largest block */
#define MAYBE_UNUSED __attribute__((unused)) /* the portable dequantisers, where AVX-512 replaces them */

enum { T_Q4_0 = 2, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14 }; /* ggml's type ids */

static inline float fp16_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
    if (exp == 0x1fu) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        int e = -1;
        do { mant <<= 1; ++e; } while (!(mant & 0x400u));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((mant & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float load_fp16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h); /* exact, as the portable conversion */
#else
    return fp16_to_float(h);
#endif
}

static int block_size(int qtype) { return (qtype == T_Q4_0 || qtype == T_Q8_0) ? 32 : 256; }
static int block_bytes(int qtype) {
    switch (qtype) {
    case T_Q4_0: return 18;
    case T_Q8_0: return 34;
    case T_Q4_K: return 144;
    case T_Q5_K: return 176;
    case T_Q6_K: return 210;
    default: return 0;
    }
}

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

/* The K-quants' j-th (scale, min) pair of 6 bits each, from their 12 packed bytes. */
static inline void scale_min_k4(int j, const uint8_t *s, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
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

/* ---- int8 activations (llama.cpp's way): x quantised per 32 values to int8 with a
 * float scale dx (amax / 127, rounded to nearest), the weights' integers multiplied by
 * them with AVX-512 VNNI (vpdpbusd: 64 u8 x s8 products per instruction), scales
 * applied per 16 values in float. Error against float activations: at most
 * sum_i |w_i| * dx_i / 2 per output (the activations' rounding), plus float rounding. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <stdlib.h>

typedef struct {
    int8_t *xq;  /* [kpad] */
    float *dxl;  /* [kpad / 4]: each 64 values' dx per dpbusd lane (lanes 0-7, 8-15: the two 32-groups) */
    float *xs16; /* [kpad / 16]: dx * sum of xq per 16 values (the weights' offsets/mins multiply it) */
} qx_t;

static void quantize_x(const float *x, int64_t k, int64_t kpad, qx_t *q) {
    memset(q->xq, 0, (size_t)kpad);
    memset(q->dxl, 0, (size_t)kpad / 4 * sizeof(float));
    memset(q->xs16, 0, (size_t)kpad / 16 * sizeof(float));
    for (int64_t g = 0; g < k / 32; ++g) {
        float amax = 0.f;
        for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(x[32 * g + i]));
        const float dx = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        int s[2] = {0, 0};
        for (int i = 0; i < 32; ++i) {
            const int v = (int)nearbyintf(x[32 * g + i] * inv);
            q->xq[32 * g + i] = (int8_t)v;
            s[i / 16] += v;
        }
        q->xs16[2 * g] = dx * (float)s[0];
        q->xs16[2 * g + 1] = dx * (float)s[1];
        for (int l = 0; l < 8; ++l) q->dxl[(g / 2) * 16 + (g % 2) * 8 + l] = dx;
    }
}

static inline __m256i load256(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline __m512i join256(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* One super-chunk s (values [256s, 256s + 256)) of a row: its 256 unsigned weight
 * integers in x's order as four 64-value vectors, and per 16 values the weight scale
 * and the offset/min that multiplies the x sum. Values at or past k are zero. */
static void unpack_256(int qtype, const uint8_t *row, int64_t s, int64_t k, __m512i w[4], float wsc[16],
                       float gmin[16]) {
    const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3), m1 = _mm256_set1_epi8(1);
    if (qtype == T_Q4_0 || qtype == T_Q8_0) {
        const int bb = qtype == T_Q4_0 ? 18 : 34;
        __m256i half[8];
        for (int i = 0; i < 8; ++i) {
            half[i] = _mm256_setzero_si256();
            wsc[2 * i] = wsc[2 * i + 1] = gmin[2 * i] = gmin[2 * i + 1] = 0.f;
            if (256 * s + 32 * i >= k) continue;
            const uint8_t *b = row + (8 * s + i) * bb;
            const float d = load_fp16(b);
            wsc[2 * i] = wsc[2 * i + 1] = d;
            if (qtype == T_Q4_0) {
                const __m128i qs = _mm_loadu_si128((const __m128i *)(b + 2)), m = _mm_set1_epi8(15);
                half[i] = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), m), _mm_and_si128(qs, m));
                gmin[2 * i] = gmin[2 * i + 1] = 8.f * d;
            } else { /* int8 + 128, as unsigned */
                half[i] = _mm256_xor_si256(load256(b + 2), _mm256_set1_epi8((char)0x80));
                gmin[2 * i] = gmin[2 * i + 1] = 128.f * d;
            }
        }
        for (int c = 0; c < 4; ++c) w[c] = join256(half[2 * c], half[2 * c + 1]);
        return;
    }
    const uint8_t *b = row + s * block_bytes(qtype);
    if (qtype == T_Q4_K || qtype == T_Q5_K) {
        /* The eight 6-bit (scale, min) pairs, unpacked four at a time in 32-bit words
         * (scale_min_k4's rule), then each repeated for its two 16-value groups. */
        uint32_t u[4];
        memcpy(u, b + 4, 12);
        const uint32_t six = 0x3f3f3f3fu, lo4 = 0x0f0f0f0fu, two = 0x03030303u;
        const uint32_t sc[2] = {u[0] & six, (u[2] & lo4) | (((u[0] >> 6) & two) << 4)};
        const uint32_t mn[2] = {u[1] & six, ((u[2] >> 4) & lo4) | (((u[1] >> 6) & two) << 4)};
        const __m128i scb = _mm_loadl_epi64((const __m128i *)sc), mnb = _mm_loadl_epi64((const __m128i *)mn);
        _mm512_store_ps(wsc, _mm512_mul_ps(_mm512_set1_ps(load_fp16(b)),
                                           _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(scb, scb)))));
        _mm512_store_ps(gmin, _mm512_mul_ps(_mm512_set1_ps(load_fp16(b + 2)),
                                            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(mnb, mnb)))));
        const __m256i qh = qtype == T_Q5_K ? load256(b + 16) : _mm256_setzero_si256();
        for (int j = 0; j < 4; ++j) {
            const __m256i q = load256(b + (qtype == T_Q4_K ? 16 : 48) + 32 * j);
            __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), m1), 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j + 1), m1), 4));
            w[j] = join256(lo, hi);
        }
        return;
    }
    /* Q6_K: per half n, (q1, q2) from ql's low nibbles and qh bits 0-3, (q3, q4) from
     * the high nibbles and bits 4-7. */
    const __m512 ds = _mm512_mul_ps(_mm512_set1_ps(load_fp16(b + 208)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                        _mm_loadu_si128((const __m128i *)(b + 192)))));
    _mm512_store_ps(wsc, ds);
    _mm512_store_ps(gmin, _mm512_mul_ps(_mm512_set1_ps(32.f), ds));
    for (int n = 0; n < 2; ++n) {
        const __m256i a = load256(b + 64 * n), c = load256(b + 64 * n + 32), h = load256(b + 128 + 32 * n);
        for (int p = 0; p < 2; ++p) {
            const __m256i lo = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(a, 4 * p), m4),
                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4 * p), m2), 4));
            const __m256i hi = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(c, 4 * p), m4),
                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4 * p + 2), m2), 4));
            w[2 * n + p] = join256(lo, hi);
        }
    }
}

static void row_times_qx(int qtype, const uint8_t *row, int64_t k, const qx_t *qx, int nt, float *y, int64_t ldy) {
    const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    __m512 acc[MAX_TOKENS], corr[MAX_TOKENS];
    for (int t = 0; t < nt; ++t) acc[t] = corr[t] = _mm512_setzero_ps();
    for (int64_t s = 0; s < (k + 255) / 256; ++s) {
        __m512i w[4];
        float wsc[16] __attribute__((aligned(64))), gmin[16] __attribute__((aligned(64)));
        unpack_256(qtype, row, s, k, w, wsc, gmin);
        const __m512 gm = _mm512_load_ps(gmin);
        for (int c = 0; c < 4; ++c) {
            const __m512 ws = _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_load_ps(wsc + 4 * c)));
            const int64_t v = 256 * s + 64 * c;
            for (int t = 0; t < nt; ++t) {
                const __m512i dp = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[c], _mm512_loadu_si512(qx[t].xq + v));
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dp), _mm512_mul_ps(ws, _mm512_loadu_ps(qx[t].dxl + v / 4)),
                                         acc[t]);
            }
        }
        for (int t = 0; t < nt; ++t) corr[t] = _mm512_fmadd_ps(gm, _mm512_loadu_ps(qx[t].xs16 + 16 * s), corr[t]);
    }
    for (int t = 0; t < nt; ++t) y[t * ldy] = _mm512_reduce_add_ps(_mm512_sub_ps(acc[t], corr[t]));
}

/* gguf_gemm with the activations quantised to int8 (see above). Returns 0; -1 for an
 * unknown type; -2 when this build has no VNNI; -3 when scratch cannot be allocated. */
int gguf_gemm_q8(int qtype, const uint8_t *w, int64_t rows, int64_t k, int64_t row_bytes, const float *x,
                 int64_t ldx, int64_t m, float *y, int64_t ldy, int num_threads) {
    if (block_bytes(qtype) == 0) return -1;
    const int64_t kpad = (k + 255) / 256 * 256;
    const size_t per_token = (size_t)kpad + (size_t)kpad / 4 * sizeof(float) + (size_t)kpad / 16 * sizeof(float);
    uint8_t *scratch = malloc(per_token * (size_t)m);
    qx_t *qx = malloc(sizeof(qx_t) * (size_t)m);
    if (!scratch || !qx) {
        free(scratch);
        free(qx);
        return -3;
    }
    for (int64_t t = 0; t < m; ++t) {
        float *f = (float *)(scratch + (size_t)m * kpad) + (size_t)t * (kpad / 4 + kpad / 16);
        qx[t] = (qx_t){(int8_t *)scratch + (size_t)t * kpad, f, f + kpad / 4};
        quantize_x(x + t * ldx, k, kpad, &qx[t]);
    }
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * k >= (1 << 15))
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t t0 = 0; t0 < m; t0 += MAX_TOKENS)
            row_times_qx(qtype, w + r * row_bytes, k, qx + t0, (int)(m - t0 < MAX_TOKENS ? m - t0 : MAX_TOKENS),
                         y + t0 * ldy + r, ldy);
    free(scratch);
    free(qx);
    return 0;
}
#else
int gguf_gemm_q8(int qtype, const uint8_t *w, int64_t rows, int64_t k, int64_t row_bytes, const float *x,
                 int64_t ldx, int64_t m, float *y, int64_t ldy, int num_threads) {
    (void)qtype; (void)w; (void)rows; (void)k; (void)row_bytes; (void)x; (void)ldx; (void)m; (void)y; (void)ldy;
    (void)num_threads;
    return -2;
}
#endif
