/* e4m3 bytes as bfloat16, exactly: an e4m3 value is a bfloat16 (3 mantissa bits fit in 7).
 * Shared by fp8_bf16.c (VDPBF16PS products) and fp8_amx.c (AMX tiles). Needs AVX-512 BW
 * (each includer checks). Static inline: each includer compiles its own copy.
 */
#ifndef FP8_CONVERT_H
#define FP8_CONVERT_H

#include <immintrin.h>
#include <stdint.h>

/* bfloat16 bits of m * 2^-9, e4m3's subnormals (exponent 0, mantissa m), by m. */
static const uint16_t FP8_SUBNORMAL_BF16[32] = {0x0000, 0x3b00, 0x3b80, 0x3bc0, 0x3c00, 0x3c20, 0x3c40, 0x3c60};

/* The e4m3 bytes of v (one per 16-bit lane) as bfloat16, exactly, in 10 integer ops:
 * normals have the exponent rebiased in place (+120), subnormals come from FP8_SUBNORMAL_BF16
 * (a permute indexed by the byte, whose low 5 bits are m there), NaN (0x7f, 0xff) stays
 * NaN, the sign moves to bit 15. */
static inline __attribute__((always_inline)) __m512i fp8x32_to_bf16(__m256i bytes) {
    const __m512i v = _mm512_cvtepu8_epi16(bytes);
    const __m512i mag = _mm512_and_si512(v, _mm512_set1_epi16(0x7f));
    __m512i bits = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(120 << 7));
    const __mmask32 sub = _mm512_testn_epi16_mask(v, _mm512_set1_epi16(0x78));
    bits = _mm512_mask_permutexvar_epi16(bits, sub, v, _mm512_loadu_si512((const void *)FP8_SUBNORMAL_BF16));
    bits = _mm512_mask_mov_epi16(bits, _mm512_cmpeq_epi16_mask(mag, _mm512_set1_epi16(0x7f)),
                                 _mm512_set1_epi16(0x7fc0));
    /* bits | ((v << 8) & 0x8000): imm 0xf8 is A | (B & C) */
    return _mm512_ternarylogic_epi32(bits, _mm512_slli_epi16(v, 8), _mm512_set1_epi16((short)0x8000), 0xf8);
}

#endif
