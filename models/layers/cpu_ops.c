/* Fused CPU kernels for the small layers: residual add + RMSNorm, neox rotary embedding
 * of q and k, Qwen3's per-head q/k norm with the rotary, and the rows' argmax. Each
 * replaces a chain of torch ops (five for a bf16 RMSNorm, seven per tensor for the
 * rotary), each a dispatch and a pass over memory, by one pass.
 *
 * The contract (shapes, strides, dtypes, who calls) is in cpu_ops.py, which compiles
 * this file and is its only caller. dtype 0 is float32, 1 bfloat16, 2 float16 (the 16-bit
 * ones computed in float32 and rounded where torch's ops round, in their own format). Rows are spread
 * over the caller's OpenMP threads (torch's libgomp) when a call is large enough to pay
 * for it; every row's arithmetic is sequential and does not depend on the schedule, so
 * results do not depend on the thread count.
 *
 * Compiled with -ffp-contract=off and without -ffast-math: every product and sum is
 * rounded where torch's op chain rounds it (in the dtype for bfloat16), so the rotary
 * equals the torch path bit for bit, and the norm differs from it only in the order
 * its sum of squares is added up.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../distributed/bf16_convert.h"
#include "../../distributed/fp16_convert.h"

#define INLINE static inline __attribute__((always_inline))
#define LANES 16 /* independent partial sums: the compiler vectorises them without reassociating */

typedef uint16_t bf16_t;
typedef uint16_t half_t; /* a bfloat16 (dtype 1) or float16 (dtype 2) value's bits */

INLINE float half_to_float(int dtype, half_t h) { return dtype == 2 ? fp16_to_float(h) : bf16_to_float(h); }
INLINE half_t float_to_half(int dtype, float x) { return dtype == 2 ? float_to_fp16(x) : float_to_bf16(x); }
/* x rounded to the 16-bit dtype and back: the value an op of that dtype stores. */
INLINE float round_half(int dtype, float x) { return half_to_float(dtype, float_to_half(dtype, x)); }

/* Float16 8 values at a time with F16C's conversions (round to nearest even, as
 * float_to_fp16): GCC vectorises the bfloat16 loops' bit arithmetic but leaves each
 * float16 conversion scalar, which made a float16 RMSNorm and rotary 5-7x the bf16 ones'
 * time (16 rows of 2048, 2026-12-07, the Zen 4 VM). The loops below take 8 at a time
 * where the build has F16C and finish the row's tail one by one, with the same roundings. */
#if defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
#define F16X8 1
#define F16_ROUNDING (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
INLINE __m256 f16x8_load(const half_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
INLINE void f16x8_store(half_t *p, __m256 v) { _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(v, F16_ROUNDING)); }
INLINE __m256 f16x8_round(__m256 v) { return _mm256_cvtph_ps(_mm256_cvtps_ph(v, F16_ROUNDING)); }
#else
#define F16X8 0
#endif

/* `call` with `dt` the constant dtype (0, 1 or 2), so each inlined loop is compiled per format. */
#define BY_DTYPE(dtype, call) \
    do { \
        if ((dtype) == 1) { const int dt = 1; call; } \
        else if ((dtype) == 2) { const int dt = 2; call; } \
        else { const int dt = 0; call; } \
    } while (0)

/* The sum of squares of v[0..n) in LANES running sums (lane l takes every LANES-th
 * element from l), added up in lane order: a fixed order the compiler vectorises. */
INLINE float sum_squares(const float *v, int64_t n) {
    float lanes[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; ++l) lanes[l] += v[i + l] * v[i + l];
    for (int l = 0; i < n; ++i, ++l) lanes[l] += v[i] * v[i];
    float sum = 0.f;
    for (int l = 0; l < LANES; ++l) sum += lanes[l];
    return sum;
}

/* One row: x (+= res), then out = w * x / sqrt(mean(x^2) + eps). `scratch` holds n floats. */
INLINE void norm_row(int dtype, char *x, const char *res, const char *w, char *out, int64_t n, float eps,
                     float *scratch) {
    const float *v;
    if (dtype) {
        half_t *xb = (half_t *)x;
        const half_t *rb = (const half_t *)res;
        int64_t i = 0;
#if F16X8
        if (dtype == 2 && rb)
            for (; i + 8 <= n; i += 8) {
                const __m256 sum = f16x8_round(_mm256_add_ps(f16x8_load(xb + i), f16x8_load(rb + i)));
                f16x8_store(xb + i, sum);
                _mm256_storeu_ps(scratch + i, sum);
            }
        else if (dtype == 2)
            for (; i + 8 <= n; i += 8) _mm256_storeu_ps(scratch + i, f16x8_load(xb + i));
#endif
        if (rb) {
            for (; i < n; ++i) {
                const half_t sum = float_to_half(dtype, half_to_float(dtype, xb[i]) + half_to_float(dtype, rb[i]));
                xb[i] = sum;
                scratch[i] = half_to_float(dtype, sum);
            }
        } else {
            for (; i < n; ++i) scratch[i] = half_to_float(dtype, xb[i]);
        }
        v = scratch;
    } else {
        float *xf = (float *)x;
        const float *rf = (const float *)res;
        if (rf)
            for (int64_t i = 0; i < n; ++i) xf[i] = xf[i] + rf[i];
        v = xf;
    }
    const float inv = 1.f / sqrtf(sum_squares(v, n) / (float)n + eps);
    if (dtype) {
        /* As the HF reference: normalise in float32, round to the dtype, then its scale. */
        const half_t *wb = (const half_t *)w;
        half_t *ob = (half_t *)out;
        int64_t i = 0;
#if F16X8
        if (dtype == 2)
            for (const __m256 vinv = _mm256_set1_ps(inv); i + 8 <= n; i += 8)
                f16x8_store(ob + i, _mm256_mul_ps(f16x8_load(wb + i),
                                                  f16x8_round(_mm256_mul_ps(_mm256_loadu_ps(v + i), vinv))));
#endif
        for (; i < n; ++i)
            ob[i] = float_to_half(dtype, half_to_float(dtype, wb[i]) * round_half(dtype, v[i] * inv));
    } else {
        const float *wf = (const float *)w;
        float *of = (float *)out;
        for (int64_t i = 0; i < n; ++i) of[i] = v[i] * inv * wf[i];
    }
}

/* `rows` rows of `n` elements at row strides (in elements) x_stride, res_stride,
 * out_stride; res may be NULL (no residual). Returns 0, or 1 when a thread's scratch
 * row could not be allocated (then some rows were not computed). */
int cpu_rms_norm(int dtype, void *x, int64_t x_stride, const void *res, int64_t res_stride, const void *w,
                 void *out, int64_t out_stride, int64_t rows, int64_t n, float eps, int num_threads) {
    const int64_t esize = dtype ? 2 : 4;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (rows * n >= (1 << 16))
    {
        float *scratch = dtype ? malloc(sizeof(float) * n) : NULL;
        if (dtype && !scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r)
            if (!dtype || scratch)
                BY_DTYPE(dtype, norm_row(dt, (char *)x + r * x_stride * esize,
                                         res ? (const char *)res + r * res_stride * esize : NULL, (const char *)w,
                                         (char *)out + r * out_stride * esize, n, eps, scratch));
        free(scratch);
    }
    return failed;
}

/* Neox rotary of `heads` heads of `head_size` in one token's row x, in place: per head,
 * halves x1, x2 become (x1 cos - x2 sin, x2 cos + x1 sin), each product and sum rounded
 * as torch rounds them (16-bit dtypes: cos and sin rounded to the dtype first, as
 * `.to(dtype)`). */
INLINE void rotate_row(int dtype, char *x, int64_t heads, int64_t head_size, const float *cos, const float *sin) {
    const int64_t half = head_size / 2;
    for (int64_t h = 0; h < heads; ++h) {
        if (dtype) {
            half_t *x1 = (half_t *)x + h * head_size, *x2 = x1 + half;
            int64_t i = 0;
#if F16X8
            if (dtype == 2)
                for (; i + 8 <= half; i += 8) {
                    const __m256 c = f16x8_round(_mm256_loadu_ps(cos + i)), s = f16x8_round(_mm256_loadu_ps(sin + i));
                    const __m256 a = f16x8_load(x1 + i), b = f16x8_load(x2 + i);
                    f16x8_store(x1 + i, _mm256_sub_ps(f16x8_round(_mm256_mul_ps(a, c)),
                                                      f16x8_round(_mm256_mul_ps(b, s))));
                    f16x8_store(x2 + i, _mm256_add_ps(f16x8_round(_mm256_mul_ps(b, c)),
                                                      f16x8_round(_mm256_mul_ps(a, s))));
                }
#endif
            for (; i < half; ++i) {
                const float c = round_half(dtype, cos[i]), s = round_half(dtype, sin[i]);
                const float a = half_to_float(dtype, x1[i]), b = half_to_float(dtype, x2[i]);
                const float first = round_half(dtype, round_half(dtype, a * c) - round_half(dtype, b * s));
                const float second = round_half(dtype, round_half(dtype, b * c) + round_half(dtype, a * s));
                x1[i] = float_to_half(dtype, first);
                x2[i] = float_to_half(dtype, second);
            }
        } else {
            float *x1 = (float *)x + h * head_size, *x2 = x1 + half;
            for (int64_t i = 0; i < half; ++i) {
                const float a = x1[i], b = x2[i];
                const float first = a * cos[i] - b * sin[i];
                x2[i] = b * cos[i] + a * sin[i];
                x1[i] = first;
            }
        }
    }
}

/* q [tokens, q_heads * head_size] and k [tokens, k_heads * head_size] at row strides
 * q_stride, k_stride (elements), rotated in place at positions[t]; cos and sin are
 * [num_positions, >= head_size / 2] float32 tables at row stride table_stride. Returns
 * 0, or 2 (before anything is written) when a position is outside the tables. */
int cpu_rotary_neox(int dtype, void *q, int64_t q_stride, int64_t q_heads, void *k, int64_t k_stride,
                    int64_t k_heads, int64_t head_size, const int64_t *positions, const float *cos,
                    const float *sin, int64_t table_stride, int64_t num_positions, int64_t tokens,
                    int num_threads) {
    const int64_t esize = dtype ? 2 : 4;
    for (int64_t t = 0; t < tokens; ++t)
        if (positions[t] < 0 || positions[t] >= num_positions) return 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) \
    if (tokens * (q_heads + k_heads) * head_size >= (1 << 16))
    for (int64_t t = 0; t < tokens; ++t) {
        const float *c = cos + positions[t] * table_stride, *s = sin + positions[t] * table_stride;
        BY_DTYPE(dtype, rotate_row(dt, (char *)q + t * q_stride * esize, q_heads, head_size, c, s);
                 rotate_row(dt, (char *)k + t * k_stride * esize, k_heads, head_size, c, s));
    }
    return 0;
}

/* Qwen3's q/k norm and rotary in one pass (vLLM's fused_qk_norm_rope): per token, each of
 * q's heads normalised with q_weight (RMSNorm over head_size, in place: norm_row reads its
 * row before it writes) and rotated, then k's with k_weight, each head exactly as the
 * separate calls compute it. q, k: [tokens, heads * head_size] at row strides q_stride,
 * k_stride (elements); the weights [head_size] of the dtype; positions, cos, sin as
 * cpu_rotary_neox's. Returns 0; 2 (before anything is written) for a position outside the
 * tables; 1 when a thread's scratch row could not be allocated (16-bit dtypes; some rows
 * were not computed). */
int cpu_qk_norm_rope(int dtype, void *q, int64_t q_stride, int64_t q_heads, void *k, int64_t k_stride,
                     int64_t k_heads, int64_t head_size, const void *q_weight, const void *k_weight, float eps,
                     const int64_t *positions, const float *cos, const float *sin, int64_t table_stride,
                     int64_t num_positions, int64_t tokens, int num_threads) {
    const int64_t esize = dtype ? 2 : 4;
    for (int64_t t = 0; t < tokens; ++t)
        if (positions[t] < 0 || positions[t] >= num_positions) return 2;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (tokens * (q_heads + k_heads) * head_size >= (1 << 13))
    {
        float *scratch = dtype ? malloc(sizeof(float) * head_size) : NULL;
        if (dtype && !scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tokens; ++t) {
            if (dtype && !scratch) continue;
            const float *c = cos + positions[t] * table_stride, *s = sin + positions[t] * table_stride;
            char *qt = (char *)q + t * q_stride * esize, *kt = (char *)k + t * k_stride * esize;
            BY_DTYPE(dtype, {
                for (int64_t h = 0; h < q_heads; ++h) {
                    char *head = qt + h * head_size * esize;
                    norm_row(dt, head, NULL, (const char *)q_weight, head, head_size, eps, scratch);
                }
                for (int64_t h = 0; h < k_heads; ++h) {
                    char *head = kt + h * head_size * esize;
                    norm_row(dt, head, NULL, (const char *)k_weight, head, head_size, eps, scratch);
                }
                rotate_row(dt, qt, q_heads, head_size, c, s);
                rotate_row(dt, kt, k_heads, head_size, c, s);
            });
        }
        free(scratch);
    }
    return failed;
}

/* GCC vector types of LANES lanes: a lane-wise maximum is a loop-carried select that the
 * compiler leaves scalar when written over arrays (0.3-0.7 ns an element here, against
 * under 0.1 ns in these types: one 512-bit register with -march=native on AVX-512). */
typedef float vfloat __attribute__((vector_size(LANES * 4)));
typedef int32_t vint __attribute__((vector_size(LANES * 4)));
typedef uint32_t vuint __attribute__((vector_size(LANES * 4)));
typedef uint16_t vhalf __attribute__((vector_size(LANES * 2)));

INLINE vfloat load_lanes_f32(const float *p) {
    vfloat v;
    memcpy(&v, p, sizeof v);
    return v;
}

INLINE vfloat load_lanes_bf16(const bf16_t *p) {
    vhalf h;
    memcpy(&h, p, sizeof h);
    const vuint u = __builtin_convertvector(h, vuint) << 16;
    vfloat v;
    memcpy(&v, &u, sizeof v);
    return v;
}

/* The first index of the largest of row[0..n) (n >= 1) and that value; a NaN counts as
 * the largest, the first NaN wins (torch's max). One pass keeps each lane's maximum and
 * the first index it was seen at (and whether the lane saw a NaN); of the lanes holding
 * the overall maximum, the smallest index wins (-0.0 equals 0.0, as in torch's
 * comparison). */
#define ARGMAX_ROW(NAME, T, LOAD_LANES, LOAD)                                                  \
    INLINE int64_t NAME(const T *row, int64_t n, float *value) {                               \
        vfloat m;                                                                              \
        vint at, nans = {0}, index;                                                            \
        for (int l = 0; l < LANES; ++l) {                                                      \
            m[l] = -INFINITY;                                                                  \
            at[l] = index[l] = l;                                                              \
        }                                                                                      \
        int64_t i = 0;                                                                         \
        for (; i + LANES <= n && i + LANES <= INT32_MAX; i += LANES, index += LANES) {         \
            const vfloat v = LOAD_LANES(row + i);                                              \
            const vint gt = v > m;                                                             \
            m = (vfloat)((gt & (vint)v) | (~gt & (vint)m));                                    \
            at = (gt & index) | (~gt & at);                                                    \
            nans |= v != v;                                                                    \
        }                                                                                      \
        float best = -INFINITY;                                                                \
        int64_t best_at = 0;                                                                   \
        int any_nan = 0;                                                                       \
        for (int l = 0; l < LANES; ++l) {                                                      \
            if (m[l] > best || (m[l] == best && at[l] < best_at)) {                            \
                best = m[l];                                                                   \
                best_at = at[l];                                                               \
            }                                                                                  \
            any_nan |= nans[l] != 0;                                                           \
        }                                                                                      \
        for (; i < n; ++i) {                                                                   \
            const float v = LOAD(row[i]);                                                      \
            if (v > best) {                                                                    \
                best = v;                                                                      \
                best_at = i;                                                                   \
            }                                                                                  \
            any_nan |= v != v;                                                                 \
        }                                                                                      \
        if (any_nan) {                                                                         \
            for (i = 0; LOAD(row[i]) == LOAD(row[i]); ++i) {                                   \
            }                                                                                  \
            *value = NAN;                                                                      \
            return i;                                                                          \
        }                                                                                      \
        *value = best;                                                                         \
        return best_at;                                                                        \
    }

INLINE vfloat load_lanes_f16(const half_t *p) {
    float f[LANES];
#if F16X8
    for (int l = 0; l < LANES; l += 8) _mm256_storeu_ps(f + l, f16x8_load(p + l));
#else
    for (int l = 0; l < LANES; ++l) f[l] = fp16_to_float(p[l]);
#endif
    return load_lanes_f32(f);
}

#define LOAD_F32(x) (x)
ARGMAX_ROW(argmax_row_f32, float, load_lanes_f32, LOAD_F32)
ARGMAX_ROW(argmax_row_bf16, bf16_t, load_lanes_bf16, bf16_to_float)
ARGMAX_ROW(argmax_row_f16, half_t, load_lanes_f16, fp16_to_float)

/* For each of `rows` rows of x (row stride x_stride elements), the first maximum of its
 * first n elements: its value (float32) in values[r] and its index in ids[r]. */
int cpu_argmax_rows(int dtype, const void *x, int64_t x_stride, int64_t rows, int64_t n, float *values,
                    int64_t *ids, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * n >= (1 << 18))
    for (int64_t r = 0; r < rows; ++r)
        ids[r] = dtype == 1   ? argmax_row_bf16((const bf16_t *)x + r * x_stride, n, values + r)
                 : dtype == 2 ? argmax_row_f16((const half_t *)x + r * x_stride, n, values + r)
                              : argmax_row_f32((const float *)x + r * x_stride, n, values + r);
    return 0;
}
