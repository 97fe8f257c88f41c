/* One value between bfloat16 and float32, as torch converts (c10::BFloat16): widening is
 * exact; narrowing rounds to nearest even, and every NaN becomes 0x7fc0 (c10's scalar
 * rule; torch's vectorised CPU conversion writes 0xffff, also a NaN: no kernel promises
 * torch's bits for a NaN). Shared by the CPU kernels that read or write bfloat16, the
 * models' and the shm all-reduce's (here, below both; static inline: each includer
 * compiles its own copy; native_build.BF16_CONVERT_H names it in their sources); narrowing
 * is branch-free, so that the compiler vectorises loops of it; AVX2 builds also get it 8
 * floats at a time (float_to_bf16x8), for the kernels that write vectors. */
#ifndef BF16_CONVERT_H
#define BF16_CONVERT_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)(((u & 0x7fffffffu) > 0x7f800000u) ? 0x7fc0u : rounded);
}

#if defined(__AVX2__)
#include <immintrin.h>

/* float_to_bf16 of 8 floats at once, in the low 128 bits' 8 lanes of 16. */
static inline __m128i float_to_bf16x8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
#endif

#endif
