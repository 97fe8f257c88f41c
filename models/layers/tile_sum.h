/* Sixteen registers of 16 partial sums each, summed across into one register: lane 4t + r
 * holds the total of v[r][t] (r, t < 4), in four rounds of shuffle-and-add, each halving
 * the registers, in place of 16 separate reductions. `integer` (a constant where this is
 * inlined) adds the lanes as int32 (exact sums; the shuffles only move bits), else as
 * float32. Shared by the bf16 register tile (bf16_tile.h) and the VNNI int8 GEMM
 * (quantization/kernels/int8_cpu.c). Needs AVX-512 F. */
#ifndef TILE_SUM_H
#define TILE_SUM_H

#include <immintrin.h>

static inline __attribute__((always_inline)) __m512 tile_add(__m512 a, __m512 b, const int integer) {
    return integer ? _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)))
                   : _mm512_add_ps(a, b);
}

static inline __attribute__((always_inline)) __m512 tile_sum16(__m512 v[4][4], const int integer) {
    __m512 b[8], c[4], d[2];
    for (int j = 0; j < 8; j++) { /* halves: lanes 0-7 of v 2j, 8-15 of v 2j+1 */
        __m512 lo = v[(2 * j) / 4][(2 * j) % 4], hi = v[(2 * j + 1) / 4][(2 * j + 1) % 4];
        b[j] = tile_add(_mm512_shuffle_f32x4(lo, hi, 0x44), _mm512_shuffle_f32x4(lo, hi, 0xEE), integer);
    }
    for (int j = 0; j < 4; j++) /* quarters: 128-bit lane q holds v 4j + q */
        c[j] = tile_add(_mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], 0x88),
                        _mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], 0xDD), integer);
    for (int j = 0; j < 2; j++) /* pairs within each 128-bit lane */
        d[j] = tile_add(_mm512_shuffle_ps(c[2 * j], c[2 * j + 1], 0x44),
                        _mm512_shuffle_ps(c[2 * j], c[2 * j + 1], 0xEE), integer);
    return tile_add(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD), integer);
}

#endif
