/* The WNA16 layout's blocks (wna16_layout.py), decoded: shared by wna16_cpu.c (the GEMVs)
 * and wna16_dequant.c (the tiles), which one library builds from (wna16_cpu.py).
 *
 *   qweight  uint8 [N, Kp*bits/8]  per output row, blocks of 32 inputs. 4 bits: block b is
 *            bytes [16b, 16b+16); byte j holds input 32b+j in its low nibble and input
 *            32b+16+j in its high nibble. 8 bits: byte k is input k.
 *   scales   [N, G] float32, float16 or bfloat16 (scale_dtype 0, 1, 2: the checkpoint's, kept
 *            when exact), zeros uint8 [N, G]: w[n, k] = (q[n, k] - zeros[n, g]) * scales[n, g]
 *            with g = block_group[k / 32] (every block lies in one group).
 *
 * Every decoder gives (q - z) * s with q - z exact: one float32 rounding per weight, the
 * same value on every path (wna16_cpu.c's AVX2 GEMV, which decodes its own way, applies s
 * to each block's sum instead). Static inline: each includer compiles its own copy. */
#ifndef WNA16_BLOCKS_H
#define WNA16_BLOCKS_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../../../distributed/bf16_convert.h"
#include "../../../../distributed/fp16_convert.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define INLINE static inline __attribute__((always_inline))

/* Scale i as float32, exactly, from its stored dtype (read once per group, not per block). */
INLINE float load_scale(const void *scales, int64_t i, int scale_dtype) {
    if (scale_dtype == 0) return ((const float *)scales)[i];
    const uint16_t h = ((const uint16_t *)scales)[i];
    return scale_dtype == 2 ? bf16_to_float(h) : fp16_to_float(h);
}
#define BLOCK 32

/* One block of row `n` as floats (q - z) * s, into w[0..32). */
INLINE void decode_block_scalar(int bits, const uint8_t *row, int64_t b, float s, int z, float *w) {
    if (bits == 4) {
        const uint8_t *p = row + b * 16;
        for (int j = 0; j < 16; ++j) {
            w[j] = (float)((int)(p[j] & 15) - z) * s;
            w[j + 16] = (float)((int)(p[j] >> 4) - z) * s;
        }
    } else {
        const uint8_t *p = row + b * BLOCK;
        for (int j = 0; j < BLOCK; ++j) w[j] = (float)((int)p[j] - z) * s;
    }
}

#ifdef __AVX512F__
/* The block as two vectors of 16, (q - z) * s with q - z exact in int32: one rounding,
 * as the formats define the weight. `zv` and `sv` are the block's group's z and s,
 * broadcast; for 4 bits, `table` holds the group's 16 possible weights, (j - z) * s,
 * and a code is its index (vpermps reads an index's low 4 bits only, so the nibbles
 * need no mask). */
INLINE void decode_block(int bits, const uint8_t *row, int64_t b, __m512i zv, __m512 sv, __m512 table, __m512 *w0,
                         __m512 *w1) {
    if (bits == 4) {
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(row + b * 16));
        *w0 = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(bytes), table);
        *w1 = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_srli_epi16(bytes, 4)), table);
        return;
    }
    const __m128i lo = _mm_loadu_si128((const __m128i *)(row + b * BLOCK));
    const __m128i hi = _mm_loadu_si128((const __m128i *)(row + b * BLOCK + 16));
    *w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(lo), zv)), sv);
    *w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(hi), zv)), sv);
}

/* The 16 weights an int4 code can stand for in a group: (j - z) * s, j = 0..15. */
INLINE __m512 int4_table(__m512i zv, __m512 sv) {
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(iota, zv)), sv);
}

#endif

#if !defined(__AVX512F__) && defined(__AVX2__)
/* The block as four vectors of 8, (q - z) * s with q - z exact in int32: one rounding,
 * the value decode_block_scalar gives. `zv` and `sv` are the group's z and s, broadcast. */
INLINE void decode_block_avx2(int bits, const uint8_t *row, int64_t b, __m256i zv, __m256 sv, __m256 w[4]) {
    __m128i lo, hi; /* inputs 0-15 and 16-31 of the block, one code a byte */
    if (bits == 4) {
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(row + b * 16)), m4 = _mm_set1_epi8(15);
        lo = _mm_and_si128(bytes, m4);
        hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), m4);
    } else {
        lo = _mm_loadu_si128((const __m128i *)(row + b * BLOCK));
        hi = _mm_loadu_si128((const __m128i *)(row + b * BLOCK + 16));
    }
    const __m128i q[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int i = 0; i < 4; ++i)
        w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(q[i]), zv)), sv);
}
#endif

#endif
