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
 * float conversion), per 8 with AVX2 (the byte's fields shifted into float32's and
 * scaled by 2^120, subnormals included), and one element at a time elsewhere and for a
 * run's tail. Rows are spread over the caller's OpenMP threads. Called from
 * fp8_kernels.py only, which checks shapes, strides and dtypes.
 *
 * The AVX2 paths against the scalar loop they replaced (2026-12-06, the Zen 3 VM, 2
 * threads, 128x128 blocks, weights from memory): the GEMV 41-49x at 1 row (a 2048x2048
 * weight 18.2 ms -> 375 us, 11 GB/s of fp8), 18-19x at 8 rows; bf16 tiles 2.1-2.2x.
 */

#include <stdint.h>
#include <string.h>

#include "../../../distributed/bf16_convert.h"

#define INLINE static inline __attribute__((always_inline))
#define GEMV_MAX_ROWS 16 /* fp8_kernels.py's */
#define ROW_GROUP 8      /* rows of x one conversion of a weight vector serves */

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
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* The e4m3 values of 8 bytes, exactly (but 0x7f / 0xff, NaN: see nan_fix): the byte moved
 * to the top of its lane and shifted back arithmetically lands sign, exponent and
 * mantissa in float32's fields (the sign's copies cleared), a float whose value is the
 * e4m3 one times 2^-120 (a denormal where e4m3 is subnormal), and one exact multiply by
 * 2^120 gives the e4m3 value. */
INLINE __m256 fp8x8_values(const uint8_t *src) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)src));
    const __m256i fields = _mm256_and_si256(_mm256_srai_epi32(_mm256_slli_epi32(v, 24), 4),
                                            _mm256_set1_epi32((int)0x87ffffffu));
    return _mm256_mul_ps(_mm256_castsi256_ps(fields), _mm256_set1_ps(0x1p120f));
}

/* f (8 values from the bytes at src) with NaN where a byte is 0x7f or 0xff. */
INLINE __m256 nan_fix(const uint8_t *src, __m256 f) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)src));
    const __m256i is_nan = _mm256_cmpeq_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x7f)), _mm256_set1_epi32(0x7f));
    return _mm256_blendv_ps(f, _mm256_set1_ps(__builtin_nanf("")), _mm256_castsi256_ps(is_nan));
}

/* Whether any of the 32 bytes at src is a NaN (0x7f or 0xff). */
INLINE int has_nan32(const uint8_t *src) {
    const __m256i b = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)src), _mm256_set1_epi8(0x7f));
    return _mm256_movemask_epi8(_mm256_cmpeq_epi8(b, _mm256_set1_epi8(0x7f))) != 0;
}

/* 8 bytes of e4m3 -> 8 floats times s: exactly fp8_e4m3_to_float(b) * s, rounded once. */
INLINE __m256 fp8x8_to_float(const uint8_t *src, __m256 s) {
    return nan_fix(src, _mm256_mul_ps(fp8x8_values(src), s));
}

/* One run of columns sharing scale s; returns the first column it left to the scalar loop. */
INLINE int64_t dequant_run_simd(const uint8_t *src, int64_t c0, int64_t c1, float s, int dtype, void *dst_row) {
    const __m256 sv = _mm256_set1_ps(s);
    int64_t c = c0;
    for (; c + 8 <= c1; c += 8) {
        const __m256 f = fp8x8_to_float(src + c, sv);
        if (dtype == 0)
            _mm256_storeu_ps((float *)dst_row + c, f);
        else
            _mm_storeu_si128((__m128i *)((uint16_t *)dst_row + c), float_to_bf16x8(f));
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

/* total[0..M) += sum_c x[m, c] * fp8(src[c]) * srow[c / block_k] over one weight row of
 * K values: the vector loops by ISA, a run's tail one value at a time. Inlined per
 * constant M, so that the accumulators stay in registers. With AVX2, the values of 32
 * bytes are converted without NaN handling unless has_nan32 finds one, and one or two
 * rows of x keep 4 or 2 running sums each, so that the fused multiply-adds do not wait
 * on one another. */
INLINE void gemv_row(const int64_t M, const float *x, int64_t x_stride, const uint8_t *src, const float *srow,
                     int64_t K, int64_t block_k, float *total) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    __m512 acc[ROW_GROUP];
    for (int64_t m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
#elif defined(__AVX2__) && defined(__FMA__)
    enum { U = 4 };
    const int chains = M == 1 ? 4 : M == 2 ? 2 : 1;
    __m256 acc[ROW_GROUP][U];
    for (int64_t m = 0; m < M; ++m)
        for (int u = 0; u < U; ++u) acc[m][u] = _mm256_setzero_ps();
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
#elif defined(__AVX2__) && defined(__FMA__)
        const __m256 sv = _mm256_set1_ps(s);
        for (; c + 32 <= c1; c += 32) {
            const int nan = has_nan32(src + c);
            for (int v = 0; v < 4; ++v) {
                __m256 wf = _mm256_mul_ps(fp8x8_values(src + c + 8 * v), sv);
                if (nan) wf = nan_fix(src + c + 8 * v, wf);
                for (int64_t m = 0; m < M; ++m)
                    acc[m][v % chains] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * x_stride + c + 8 * v), wf,
                                                         acc[m][v % chains]);
            }
        }
        for (; c + 8 <= c1; c += 8) {
            const __m256 wf = fp8x8_to_float(src + c, sv);
            for (int64_t m = 0; m < M; ++m)
                acc[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * x_stride + c), wf, acc[m][0]);
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
#elif defined(__AVX2__) && defined(__FMA__)
        const __m256 a = _mm256_add_ps(_mm256_add_ps(acc[m][0], acc[m][1]), _mm256_add_ps(acc[m][2], acc[m][3]));
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        total[m] += _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
#endif
    }
}

/* out[m, n] = sum_c x[m, c] * fp8(w[n, c]) * scale[n / block_n, c / block_k] for a few
 * rows of x (M <= GEMV_MAX_ROWS, float32 [M, K], rows x_stride apart): the decode case,
 * and a mixture-of-experts step's tokens per expert, where reading the weight once, as
 * bytes, is most of the cost. Each weight row is converted a vector at a time in
 * registers and used by up to ROW_GROUP rows of x; more rows take a second pass over
 * the weight row, from L1 (against dequantised tiles and a GEMM, 9-16 rows of x in two
 * passes took 0.65-0.8x the time: 2026-12-06, the Zen 3 VM). Nothing is written but the
 * output (float32 dtype 0, bfloat16 dtype 1). Output rows n are spread over the
 * threads; each sum runs in a fixed order, whatever their number. */
int fp8_gemv(const float *x, int64_t x_stride, int64_t M, const uint8_t *w, int64_t w_stride, int64_t N, int64_t K,
             const float *scale, int64_t scale_stride, int64_t block_n, int64_t block_k, int dtype, void *out,
             int64_t out_stride, int num_threads) {
    if (M < 1 || M > GEMV_MAX_ROWS) return 1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (N * K >= (1 << 16))
    for (int64_t n = 0; n < N; ++n) {
        const uint8_t *src = w + n * w_stride;
        const float *srow = scale + (n / block_n) * scale_stride;
        float total[GEMV_MAX_ROWS] = {0};
        for (int64_t g = 0; g < M; g += ROW_GROUP) {
            const float *xg = x + g * x_stride;
            switch (M - g < ROW_GROUP ? M - g : ROW_GROUP) { /* a copy per row count */
            case 1: gemv_row(1, xg, x_stride, src, srow, K, block_k, total + g); break;
            case 2: gemv_row(2, xg, x_stride, src, srow, K, block_k, total + g); break;
            case 3: gemv_row(3, xg, x_stride, src, srow, K, block_k, total + g); break;
            case 4: gemv_row(4, xg, x_stride, src, srow, K, block_k, total + g); break;
            case 5: gemv_row(5, xg, x_stride, src, srow, K, block_k, total + g); break;
            case 6: gemv_row(6, xg, x_stride, src, srow, K, block_k, total + g); break;
            case 7: gemv_row(7, xg, x_stride, src, srow, K, block_k, total + g); break;
            default: gemv_row(8, xg, x_stride, src, srow, K, block_k, total + g); break;
            }
        }
        for (int64_t m = 0; m < M; ++m) {
            if (dtype == 0)
                ((float *)out)[m * out_stride + n] = total[m];
            else
                ((uint16_t *)out)[m * out_stride + n] = float_to_bf16(total[m]);
        }
    }
    return 0;
}
