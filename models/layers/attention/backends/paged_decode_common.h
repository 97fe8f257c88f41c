/* What paged_decode.c's attend() and its ISA copies (paged_decode_avx512.h,
 * paged_decode_avx2.h) share: the call's arguments (Args), the dtypes, the first position
 * a sequence's query sees (sliding windows), the soft cap, the softmax's exponentials and
 * the output row's store. Included by paged_decode.c and by each ISA header, so that no
 * header depends on definitions in the file that includes it. Compiled as part of
 * paged_decode.c only (with its -ffast-math: see there). */
#ifndef PAGED_DECODE_COMMON_H
#define PAGED_DECODE_COMMON_H

#include <stdint.h>
#include <string.h>
#include <math.h>

#include "../../../../distributed/bf16_convert.h"
#include "../../../../distributed/fp16_convert.h"

#define INLINE static inline __attribute__((always_inline))

/* The dtypes `dt` names (paged_decode.py's _DTYPES): q, the cache and the output share one. */
enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

/* `n` elements at `src` (of dtype `dt`) as float32: `src` itself, or `scratch` filled
 * with the conversion. */
INLINE const float *as_float(const void *src, int dt, float *scratch, int64_t n) {
    if (dt == DT_F32) return (const float *)src;
    const uint16_t *b = (const uint16_t *)src;
    for (int64_t i = 0; i < n; ++i) scratch[i] = dt == DT_BF16 ? bf16_to_float(b[i]) : fp16_to_float(b[i]);
    return scratch;
}

/* Output row o[0..D) (of dtype `dt`) = acc[0..D) * inv. */
INLINE void store_row(void *o, int dt, const float *acc, float inv, int64_t D) {
    if (dt == DT_F32) {
        for (int64_t d = 0; d < D; ++d) ((float *)o)[d] = acc[d] * inv;
    } else {
        uint16_t *h = (uint16_t *)o;
        for (int64_t d = 0; d < D; ++d) h[d] = dt == DT_BF16 ? float_to_bf16(acc[d] * inv) : float_to_fp16(acc[d] * inv);
    }
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

#endif
