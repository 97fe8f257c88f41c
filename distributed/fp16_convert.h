/* One value between IEEE float16 and float32: widening is exact, narrowing rounds to
 * nearest even. F16C's instructions where the compiler targets them; else bit arithmetic
 * (widening) and the compiler's _Float16 (narrowing). Shared by the C kernels that read
 * or write float16 (GGUF blocks' and WNA16 scales, the paged decode kernel's float16
 * cache), beside bf16_convert.h; static inline: each includer compiles its own copy;
 * native_build.FP16_CONVERT_H names it in their sources. */
#ifndef FP16_CONVERT_H
#define FP16_CONVERT_H

#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

static inline float fp16_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
    if (exp == 0x1fu) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        int e = -1;
        do { mant <<= 1; ++e; } while (!(mant & 0x400u));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((mant & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

static inline uint16_t float_to_fp16(float f) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, 0); /* 0: round to nearest even */
#else
    const _Float16 x = (_Float16)f;
    uint16_t h;
    memcpy(&h, &x, sizeof h);
    return h;
#endif
}

#endif
