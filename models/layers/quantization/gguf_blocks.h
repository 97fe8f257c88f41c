/* What the GGUF kernels (gguf_kernels.c: float products and dequantisers; gguf_vnni.c:
 * int8 products; gguf_bf16.c: bf16 tiles) share: ggml's type ids, the blocks' sizes,
 * their fp16 scales and the K-quants' 6-bit scale pairs, and how a product's outputs are
 * stored. The block layouts are described in gguf_kernels.c. */
#ifndef GGUF_BLOCKS_H
#define GGUF_BLOCKS_H

#include <stdint.h>
#include <string.h>
#include <math.h>

#include "../../../distributed/bf16_convert.h"
#include "../../../distributed/fp16_convert.h"
#if defined(__F16C__) || defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* Which int8 products the build has (gguf_gemm_q8_shards, gguf_gemm_int8_tiles):
 * gguf_vnni.c's and gguf_vnni_tiles.c's with AVX-512 VNNI, else gguf_avx2.c's and
 * gguf_avx2_tiles.c's with AVX2 (vpmaddubsw), else none (the entries answer -2). */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define GGUF_INT8_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define GGUF_INT8_AVX2 1
#endif

#define LANES 16
#define MAX_TOKENS 8 /* tokens sharing one dequantised block; more are done in chunks */
#define QK 256       /* the largest block */
#define MAYBE_UNUSED __attribute__((unused)) /* the portable dequantisers, where AVX-512 replaces them */

enum { T_Q4_0 = 2, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14 }; /* ggml's type ids */

static inline float load_fp16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return fp16_to_float(h);
}

#if defined(__F16C__)
/* Where a product's outputs go: element (t, c) at p + t * ld + c, as float32 (dtype 0),
 * bfloat16 (1) or float16 (2), each rounded once to nearest even from the float sum as
 * torch's .to() rounds it (a NaN becomes torch's bfloat16 NaN), so that a 16-bit layer
 * gets its output without a float32 copy and a cast. */
typedef struct {
    void *p;
    int dtype;
    int64_t ld;
} out_t;

static inline void out_store(const out_t *y, int64_t t, int64_t c, float v) {
    const int64_t i = t * y->ld + c;
    if (y->dtype == 0)
        ((float *)y->p)[i] = v;
    else
        ((uint16_t *)y->p)[i] = y->dtype == 1 ? float_to_bf16(v) : _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);
}
#endif

/* The K-quants' j-th (scale, min) pair of 6 bits each, from their 12 packed bytes. */
static inline void scale_min_k4(int j, const uint8_t *s, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Where tile g falls when n shards of rows[i] rows each are cut into tiles of
 * `tile_rows` rows, shard after shard (gguf_gemm_bf16_shards, gguf_gemm_int8_tiles): its
 * shard, the shard's first output column (the rows of the shards before it), and the
 * tile's first row and row count within the shard. */
typedef struct {
    int shard;
    int64_t offset, r0;
    int rows;
} tile_pos_t;

static inline tile_pos_t tile_position(const int64_t *rows, int64_t g, int tile_rows) {
    tile_pos_t pos = {0, 0, 0, 0};
    while (g >= (rows[pos.shard] + tile_rows - 1) / tile_rows) {
        g -= (rows[pos.shard] + tile_rows - 1) / tile_rows;
        pos.offset += rows[pos.shard++];
    }
    pos.r0 = g * tile_rows;
    pos.rows = (int)(rows[pos.shard] - pos.r0 < tile_rows ? rows[pos.shard] - pos.r0 : tile_rows);
    return pos;
}

#ifdef GGUF_INT8_AVX2
/* Values [i, i + 8) of a token's row x as float32 (x_dtype 0: float32, 1: bfloat16, 2:
 * float16): what the AVX2 products quantise (gguf_avx2.c, gguf_avx2_tiles.c). */
static inline __m256 x_load8(const void *x, int x_dtype, int64_t i) {
    if (x_dtype == 0) return _mm256_loadu_ps((const float *)x + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + i));
    if (x_dtype == 1) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

/* The largest of v's 8 lanes. */
static inline float hmax8(__m256 v) {
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    return _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
}

/* The sum of v's 8 32-bit lanes. */
static inline int32_t hsum8_epi32(__m256i v) {
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    return _mm_cvtsi128_si32(s4);
}

/* A K-quant super-block's code bytes as vectors of 32 (gguf_avx2.c, gguf_avx2_tiles.c):
 * Q4_K: qs (4); Q5_K: qh, then qs (5); Q6_K: per 128 values ql's two 32 bytes and qh's
 * 32 (6). k_raw_count gives how many. */
static inline int k_raw_count(int qtype) { return qtype == T_Q4_K ? 4 : qtype == T_Q5_K ? 5 : 6; }

static inline __attribute__((always_inline)) void k_raw_avx2(int qtype, const uint8_t *b, __m256i raw[6]) {
    static const int q6_offsets[6] = {0, 32, 128, 64, 96, 160};
    for (int i = 0; i < k_raw_count(qtype); ++i)
        raw[i] = _mm256_loadu_si256((const __m256i *)(b + (qtype == T_Q6_K ? q6_offsets[i] : 16 + 32 * i)));
}

/* The 256 codes from k_raw_avx2's vectors, as 8 vectors of 32 unsigned bytes: value 32v
 * + l in byte l of w[v] (Q6_K's before its - 32). Byte-wise, so it gives the same from
 * vectors whose bytes were moved together (gguf_avx2_tiles.c's transposed rows). Q4_K/
 * Q5_K: each 32 bytes of nibbles hold values [64j, 64j + 32) low and the next 32 high,
 * the fifth bit of value l of group v being bit v of qh[l]; Q6_K: per 128 values, ql's
 * 64 bytes (low nibbles, then high) and qh's 32 (two top bits each). */
static inline __attribute__((always_inline)) void k_codes_from_raw(int qtype, const __m256i raw[6], __m256i w[8]) {
    const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3), m1 = _mm256_set1_epi8(1);
    if (qtype == T_Q6_K) {
        for (int n = 0; n < 2; ++n)
            for (int i = 0; i < 4; ++i) { /* quarter i: ql[l] or ql[l + 32], low or high nibble */
                const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(raw[3 * n + i % 2], 4 * (i / 2)), m4);
                const __m256i top = _mm256_and_si256(_mm256_srli_epi16(raw[3 * n + 2], 2 * i), m2);
                w[4 * n + i] = _mm256_or_si256(lo, _mm256_slli_epi16(top, 4));
            }
        return;
    }
    const int q5 = qtype == T_Q5_K;
    for (int j = 0; j < 4; ++j) {
        const __m256i q = raw[q5 + j];
        w[2 * j] = _mm256_and_si256(q, m4);
        w[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        if (q5)
            for (int h = 0; h < 2; ++h)
                w[2 * j + h] = _mm256_or_si256(
                    w[2 * j + h], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(raw[0], 2 * j + h), m1), 4));
    }
}

static inline __attribute__((always_inline)) void k_codes_avx2(int qtype, const uint8_t *b, __m256i w[8]) {
    __m256i raw[6];
    k_raw_avx2(qtype, b, raw);
    k_codes_from_raw(qtype, raw, w);
}
#endif

static inline int block_size(int qtype) { return (qtype == T_Q4_0 || qtype == T_Q8_0) ? 32 : 256; }
static inline int block_bytes(int qtype) {
    switch (qtype) {
    case T_Q4_0: return 18;
    case T_Q8_0: return 34;
    case T_Q4_K: return 144;
    case T_Q5_K: return 176;
    case T_Q6_K: return 210;
    default: return 0;
    }
}

#endif
