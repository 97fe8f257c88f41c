/* Dequantise a tile of float8_e4m3fn weight rows into float32 or bfloat16 scratch:
 *
 *     out[r, c] = fp8(w[r0 + r, c]) * scale[(r0 + r) / block_n, c / block_k]
 *
 * for r in [0, rows), c in [0, cols). Per-channel scales are block_n = 1, block_k >= cols;
 * 128x128 blocks are block_n = block_k = 128. The product is formed in float32 and
 * rounded once to the output dtype (dtype 0 float32, 1 bfloat16), which is what
 * `q.float() * scale` followed by `.to(dtype)` gives in torch. torch's own fp8 -> float
 * conversion on the CPU runs at ~7 ns per element; here it is a few integer ops per 16
 * elements with AVX-512 (the exponent rebiased in place, subnormals through an int ->
 * float conversion), and the same arithmetic one element at a time elsewhere and for a
 * run's tail. Rows are spread over the caller's OpenMP threads. Called from
 * fp8_kernels.py only, which checks shapes, strides and dtypes.
 */

#include <stdint.h>
#include <string.h>

#include "../../../distributed/bf16_convert.h"

#define INLINE static inline __attribute__((always_inline))

/* e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities, 0x7f/0xff NaN. */
INLINE float fp8_e4m3_to_float(uint8_t b) {
    const uint32_t sign = (uint32_t)(b & 0x80) << 24, exp = (b >> 3) & 0xf, man = b & 0x7;
    const uint32_t normal = sign | ((exp + 120) << 23) | (man << 20);
    float f;
    memcpy(&f, &normal, sizeof f);
    const float sub = (float)man * 0x1p-9f; /* exp == 0: man * 2^-6 * 2^-3 */
    const float sub_signed = sign ? -sub : sub;
    const uint32_t nan_bits = 0x7fc00000u;
    float nan;
    memcpy(&nan, &nan_bits, sizeof nan);
    return exp == 0 ? sub_signed : ((exp == 0xf && man == 0x7) ? nan : f);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

/* 16 bytes of e4m3 -> 16 floats times s: the same arithmetic as fp8_e4m3_to_float. */
INLINE __m512 fp8x16_to_float(const uint8_t *src, __m512 s) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)src));
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x80)), 24);
    const __m512i mag = _mm512_and_si512(v, _mm512_set1_epi32(0x7f));
    /* exp:man shifted into float32's exponent:mantissa, exponent rebiased by 127 - 7. */
    const __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23));
    const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(0x1p-9f)); /* exp == 0 */
    const __mmask16 is_sub = _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8));
    const __mmask16 is_nan = _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7f));
    __m512i bits = _mm512_mask_blend_epi32(is_sub, normal, _mm512_castps_si512(sub));
    bits = _mm512_mask_blend_epi32(is_nan, bits, _mm512_set1_epi32(0x7fc00000));
    return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(bits, sign)), s);
}

/* One run of columns sharing scale s; returns the first column it left to the scalar loop. */
INLINE int64_t dequant_run_simd(const uint8_t *src, int64_t c0, int64_t c1, float s, int dtype, void *dst_row) {
    const __m512 sv = _mm512_set1_ps(s);
    int64_t c = c0;
    for (; c + 16 <= c1; c += 16) {
        const __m512 f = fp8x16_to_float(src + c, sv);
        if (dtype == 0) {
            _mm512_storeu_ps((float *)dst_row + c, f);
        } else {
            /* Round to nearest even (NaN stays NaN), as float_to_bf16 and torch do. */
            const __m512i u = _mm512_castps_si512(f);
            const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
            __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
            const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                          _mm512_set1_epi32(0x7f800000));
            r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7fc0));
            _mm256_storeu_si256((__m256i *)((uint16_t *)dst_row + c), _mm512_cvtepi32_epi16(r));
        }
    }
    return c;
}
#else
INLINE int64_t dequant_run_simd(const uint8_t *src, int64_t c0, int64_t c1, float s, int dtype, void *dst_row) {
    (void)src, (void)c1, (void)s, (void)dtype, (void)dst_row;
    return c0;
}
#endif

void fp8_dequant_rows(const uint8_t *w, int64_t w_stride, int64_t r0, int64_t rows, int64_t cols,
                      const float *scale, int64_t scale_stride, int64_t block_n, int64_t block_k, int dtype,
                      void *out, int64_t out_stride, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * cols >= (1 << 15))
    for (int64_t r = 0; r < rows; ++r) {
        const uint8_t *src = w + (r0 + r) * w_stride;
        const float *srow = scale + ((r0 + r) / block_n) * scale_stride;
        for (int64_t c0 = 0; c0 < cols; c0 += block_k) {
            const int64_t c1 = c0 + block_k < cols ? c0 + block_k : cols;
            const float s = srow[c0 / block_k];
            void *dst_row = dtype == 0 ? (void *)((float *)out + r * out_stride)
                                       : (void *)((uint16_t *)out + r * out_stride);
            const int64_t tail = dequant_run_simd(src, c0, c1, s, dtype, dst_row);
            if (dtype == 0) {
                float *dst = (float *)dst_row;
                for (int64_t c = tail; c < c1; ++c) dst[c] = fp8_e4m3_to_float(src[c]) * s;
            } else {
                uint16_t *dst = (uint16_t *)dst_row;
                for (int64_t c = tail; c < c1; ++c) dst[c] = float_to_bf16(fp8_e4m3_to_float(src[c]) * s);
            }
        }
    }
}

/* out[m, n] = sum_c x[m, c] * fp8(w[n, c]) * scale[n / block_n, c / block_k] for a few
 * rows of x (M <= GEMV_MAX_ROWS, float32 [M, K], rows x_stride apart): the decode case,
 * where reading the weight once, as bytes, is the whole cost. Each weight row is
 * converted 16 values at a time in registers and used by every x row; nothing is
 * written but the output (float32 dtype 0, bfloat16 dtype 1). Output rows n are spread
 * over the threads; each sum runs in a fixed order, whatever their number. */
#define GEMV_MAX_ROWS 8
int fp8_gemv(const float *x, int64_t x_stride, int64_t M, const uint8_t *w, int64_t w_stride, int64_t N, int64_t K,
             const float *scale, int64_t scale_stride, int64_t block_n, int64_t block_k, int dtype, void *out,
             int64_t out_stride, int num_threads) {
    if (M > GEMV_MAX_ROWS) return 1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (N * K >= (1 << 16))
    for (int64_t n = 0; n < N; ++n) {
        const uint8_t *src = w + n * w_stride;
        const float *srow = scale + (n / block_n) * scale_stride;
        float total[GEMV_MAX_ROWS] = {0};
#if defined(__AVX512F__) && defined(__AVX512BW__)
        __m512 acc[GEMV_MAX_ROWS];
        for (int64_t m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
#endif
        for (int64_t c0 = 0; c0 < K; c0 += block_k) {
            const int64_t c1 = c0 + block_k < K ? c0 + block_k : K;
            const float s = srow[c0 / block_k];
            int64_t c = c0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
            const __m512 sv = _mm512_set1_ps(s);
            for (; c + 16 <= c1; c += 16) {
                const __m512 wf = fp8x16_to_float(src + c, sv);
                for (int64_t m = 0; m < M; ++m)
                    acc[m] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * x_stride + c), wf, acc[m]);
            }
#endif
            for (; c < c1; ++c) {
                const float wf = fp8_e4m3_to_float(src[c]) * s;
                for (int64_t m = 0; m < M; ++m) total[m] += x[m * x_stride + c] * wf;
            }
        }
        for (int64_t m = 0; m < M; ++m) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
            total[m] += _mm512_reduce_add_ps(acc[m]);
#endif
            if (dtype == 0)
                ((float *)out)[m * out_stride + n] = total[m];
            else
                ((uint16_t *)out)[m * out_stride + n] = float_to_bf16(total[m]);
        }
    }
    return 0;
}
