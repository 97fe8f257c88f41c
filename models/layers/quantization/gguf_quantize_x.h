/* The activations of gguf_vnni.c's int8 products: each token's values read as float32
 * (x_row) and quantised to int8 with a float scale dx = amax / 127 (rounded to nearest),
 * per 32 values in natural order or per 256 in a row type's order, with the sums the
 * offsets and mins multiply (quantize_x). gguf_vnni.c, which needs AVX-512 for these,
 * is the only includer; the layouts are described there. */
#ifndef GGUF_QUANTIZE_X_H
#define GGUF_QUANTIZE_X_H

#include "gguf_blocks.h"

/* How x is quantised for a row type: per 32 values in natural order (Q4_0, Q8_0), per
 * 256 in Q4_K/Q5_K's nibble order, per 256 in natural order (Q6_K). */
enum { ORDER_NATURAL = 0, ORDER_K4 = 1, ORDER_NATURAL256 = 2, N_ORDERS = 3 };

static int x_order(int qtype) {
    return (qtype == T_Q4_K || qtype == T_Q5_K) ? ORDER_K4 : qtype == T_Q6_K ? ORDER_NATURAL256 : ORDER_NATURAL;
}

typedef struct {
    int8_t *xq;  /* [kpad], in the row type's order */
    /* ORDER_NATURAL (per 32): */
    float *dxl;  /* [kpad / 4]: dx per dpbusd lane (4 values), in the same order */
    float *xs16; /* [kpad / 16]: dx * sum of xq per 16 values, natural order (the offsets multiply it);
                  * also ORDER_NATURAL256's */
    /* ORDER_K4 and ORDER_NATURAL256 (per 256), in the same memory as dxl: */
    float *dxs;  /* [kpad / 256]: dx per 256 values */
    float *xs32; /* [kpad / 32]: ORDER_K4's dx * sum of xq per 32 values, natural order (the mins multiply it) */
} qx_t;

/* Where 32-group g's values start in x's order: natural, or for ORDER_K4 within its
 * 256: vector v = 2 (g / 4) + g % 2 of four 64s, half (g % 4) / 2. */
static inline int64_t group_pos(int order, int64_t g) {
    if (order != ORDER_K4) return 32 * g;
    const int64_t gs = g % 8;
    return 256 * (g / 8) + 64 * (2 * (gs / 4) + gs % 2) + 32 * ((gs % 4) / 2);
}

static void quantize_x(const float *x, int64_t k, int64_t kpad, int order, qx_t *q) {
    memset(q->xq, 0, (size_t)kpad);
    if (order != ORDER_NATURAL) { /* per 256 (K-quant rows have k % 256 == 0) */
        for (int64_t s = 0; s < k / 256; ++s) {
            __m512 amax = _mm512_setzero_ps();
            for (int i = 0; i < 256; i += 16)
                amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(x + 256 * s + i)));
            const float m = _mm512_reduce_max_ps(amax), dx = m / 127.f, inv = m > 0.f ? 127.f / m : 0.f;
            q->dxs[s] = dx;
            for (int64_t g = 8 * s; g < 8 * s + 8; ++g) {
                const __m512 scale = _mm512_set1_ps(inv);
                const __m512i ia = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 32 * g), scale));
                const __m512i ic = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 32 * g + 16), scale));
                const int64_t pos = group_pos(order, g);
                _mm_storeu_si128((__m128i *)(q->xq + pos), _mm512_cvtepi32_epi8(ia));
                _mm_storeu_si128((__m128i *)(q->xq + pos + 16), _mm512_cvtepi32_epi8(ic));
                if (order == ORDER_K4) {
                    q->xs32[g] = dx * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(ia, ic));
                } else {
                    q->xs16[2 * g] = dx * (float)_mm512_reduce_add_epi32(ia);
                    q->xs16[2 * g + 1] = dx * (float)_mm512_reduce_add_epi32(ic);
                }
            }
        }
        return;
    }
    memset(q->dxl, 0, (size_t)kpad / 4 * sizeof(float));
    memset(q->xs16, 0, (size_t)kpad / 16 * sizeof(float));
    for (int64_t g = 0; g < k / 32; ++g) {
        const __m512 a = _mm512_loadu_ps(x + 32 * g), c = _mm512_loadu_ps(x + 32 * g + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
        const float dx = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        const int64_t pos = group_pos(order, g);
        /* x * inv rounded to nearest even (the default rounding mode: nearbyintf's) */
        const __m512i ia = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv)));
        const __m512i ic = _mm512_cvtps_epi32(_mm512_mul_ps(c, _mm512_set1_ps(inv)));
        _mm_storeu_si128((__m128i *)(q->xq + pos), _mm512_cvtepi32_epi8(ia));
        _mm_storeu_si128((__m128i *)(q->xq + pos + 16), _mm512_cvtepi32_epi8(ic));
        q->xs16[2 * g] = dx * (float)_mm512_reduce_add_epi32(ia);
        q->xs16[2 * g + 1] = dx * (float)_mm512_reduce_add_epi32(ic);
        _mm256_storeu_ps(q->dxl + pos / 4, _mm256_set1_ps(dx));
    }
}

/* Token t's k activations as float32 (x_dtype 0: float32, 1: bfloat16, 2: float16). */
static const float *x_row(const void *x, int x_dtype, int64_t ldx, int64_t t, int64_t k, float *buf) {
    if (x_dtype == 0) return (const float *)x + t * ldx;
    const uint16_t *h = (const uint16_t *)x + t * ldx;
    for (int64_t i = 0; i < k; ++i) buf[i] = x_dtype == 1 ? bf16_to_float(h[i]) : load_fp16((const uint8_t *)(h + i));
    return buf;
}

#endif
