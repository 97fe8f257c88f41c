/* Rows of a WNA16 weight (wna16_blocks.h) dequantised into a tile for a larger batch's
 * GEMM (wna16_cpu.py's tiles; the caller bounds the tile):
 *
 * wna16_dequant: rows [r0, r0 + rows) of w as float32, or rounded to bfloat16 (for
 * bfloat16 activations); vectorised with AVX-512 or AVX2 (on the Zen 3 VM, 2026-12-06, a
 * 4096x1024 int4 weight to bfloat16 in 0.71-0.77 ms where the scalar loop took 1.08-1.26,
 * 2 threads: 1.1-1.2x a 16-32-token product), portable C elsewhere. Rows are spread over
 * the caller's OpenMP threads. The contract is in wna16_cpu.py, its only caller.
 */

#include "wna16_blocks.h"

/* 32 floats of w into row `out` at element `col`: float32, or rounded to bfloat16. */
INLINE void store_block(const float *w, void *out, int64_t col, int out_bf16) {
    if (out_bf16) {
        for (int j = 0; j < BLOCK; ++j) ((uint16_t *)out)[col + j] = float_to_bf16(w[j]);
    } else {
        memcpy((float *)out + col, w, BLOCK * sizeof(float));
    }
}

/* out [rows, Kp] (row stride ldo elements; float32, or bfloat16 when out_bf16) = w[r0 .. r0 + rows).
 * Returns 0. */
int wna16_dequant(int bits, const uint8_t *wq, const void *scales, int scale_dtype, const uint8_t *zeros,
                  const int32_t *block_group, int64_t r0, int64_t rows, int64_t kp, int64_t g_count, void *out,
                  int64_t ldo, int out_bf16, int num_threads) {
    const int64_t row_bytes = kp * bits / 8;
    const int64_t elem = out_bf16 ? 2 : 4;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * kp >= (1 << 15))
    for (int64_t i = 0; i < rows; ++i) {
        const int64_t n = r0 + i;
        char *row_out = (char *)out + i * ldo * elem;
        for (int64_t b = 0; b < kp / BLOCK; ++b) {
            const int32_t g = block_group[b];
#if defined(__AVX512F__)
            __m512 w0, w1;
            const __m512i zv = _mm512_set1_epi32(zeros[n * g_count + g]);
            const __m512 sv = _mm512_set1_ps(load_scale(scales, n * g_count + g, scale_dtype));
            decode_block(bits, wq + n * row_bytes, b, zv, sv, int4_table(zv, sv), &w0, &w1);
            if (out_bf16) { /* float_to_bf16 8 lanes at a time (its rounding, NaN and subnormals) */
                const __m256 v[4] = {_mm512_castps512_ps256(w0), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(w0), 1)),
                                     _mm512_castps512_ps256(w1), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(w1), 1))};
                for (int i = 0; i < 4; ++i)
                    _mm_storeu_si128((__m128i *)((uint16_t *)row_out + b * BLOCK + 8 * i), float_to_bf16x8(v[i]));
            } else {
                _mm512_storeu_ps((float *)row_out + b * BLOCK, w0);
                _mm512_storeu_ps((float *)row_out + b * BLOCK + 16, w1);
            }
#elif defined(__AVX2__)
            __m256 v[4];
            decode_block_avx2(bits, wq + n * row_bytes, b, _mm256_set1_epi32(zeros[n * g_count + g]),
                              _mm256_set1_ps(load_scale(scales, n * g_count + g, scale_dtype)), v);
            for (int i = 0; i < 4; ++i) {
                if (out_bf16)
                    _mm_storeu_si128((__m128i *)((uint16_t *)row_out + b * BLOCK + 8 * i), float_to_bf16x8(v[i]));
                else
                    _mm256_storeu_ps((float *)row_out + b * BLOCK + 8 * i, v[i]);
            }
#else
            float w[BLOCK];
            decode_block_scalar(bits, wq + n * row_bytes, b, load_scale(scales, n * g_count + g, scale_dtype),
                                zeros[n * g_count + g], w);
            store_block(w, row_out, b * BLOCK, out_bf16);
#endif
        }
    }
    return 0;
}
