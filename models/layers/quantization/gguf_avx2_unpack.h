/* The AVX2 int8 tiles' weights (gguf_avx2_tiles.c, its only includer): a tile of 16
 * rows, CHUNK super-blocks (Q8_0: CHUNK / 2 runs of 256 values) at a time, unpacked into a
 * per-thread buffer with one row per 32-bit lane, and the prefetch of the rows a chunk
 * ahead. See gguf_avx2_tiles.c for the layout's use and the numbers. */
#ifndef GGUF_AVX2_UNPACK_H
#define GGUF_AVX2_UNPACK_H

#include "../avx2_transpose.h"
#include "gguf_blocks.h"

#include <immintrin.h>

#define TILE_ROWS 16 /* two vectors of 8 rows, one row per 32-bit lane */
#define CHUNK 4      /* super-blocks unpacked at a time: 16 KB of bytes */

/* One tile's CHUNK super-blocks, unpacked. Vectors indexed [super-block][...][v], v the
 * 8-row half of the tile. */
typedef struct {
    __m256i w[CHUNK][8][8][2]; /* [group of 32][step of 4 values][v] */
    __m256i sc[CHUNK][16][2];  /* (scale, scale) per lane: per 32 (Q4_K/Q5_K), per 16 (Q6_K) */
    __m256i corr[CHUNK][8][2]; /* Q6_K: 128 * sum(scale * (q - 32)) per 32 */
    __m256 mn[CHUNK][8][2];    /* Q4_K/Q5_K: dmin * min per 32 */
    __m256 d[CHUNK][2];        /* d per row */
    __m256 dq[CHUNK][8][2];    /* Q8_0: d per row and block of 32 (slot c: its c-th 256 values) */
} tile_t;

/* Q8_0's 256 values in slot c: 16-bit, two per 32-bit lane, [block][pair][v], taking
 * w[2c] and w[2c + 1] (twice the K-quants' bytes). */
#define Q8_W(u, c) ((__m256i(*)[16][2])(u)->w[2 * (c)])

/* The bytes of `qtype` rows holding 256 values. */
static inline int sb_bytes(int qtype) { return block_bytes(qtype) * (256 / block_size(qtype)); }

/* 8 bytes as 8 lanes of (byte, byte) 16-bit pairs: unsigned, or signed (Q6_K's scales). */
static inline __m256i byte_pairs(__m128i b8, int is_signed) {
    const __m128i twice = _mm_unpacklo_epi8(b8, b8);
    return is_signed ? _mm256_cvtepi8_epi16(twice) : _mm256_cvtepu8_epi16(twice);
}

/* Q4_K/Q5_K's 8 (scale, min) pairs of 6 bits from their 12 packed bytes (scale_min_k4),
 * as bytes: scale j in byte j of *sc, min j in byte j of *mn. */
static inline void scales_mins(const uint8_t *s, uint64_t *sc, uint64_t *mn) {
    uint32_t a, b, c;
    memcpy(&a, s, 4);
    memcpy(&b, s + 4, 4);
    memcpy(&c, s + 8, 4);
    *sc = (a & 0x3f3f3f3fu) | (uint64_t)((c & 0x0f0f0f0fu) | ((a >> 2) & 0x30303030u)) << 32;
    *mn = (b & 0x3f3f3f3fu) | (uint64_t)(((c >> 4) & 0x0f0f0f0fu) | ((b >> 2) & 0x30303030u)) << 32;
}

/* Super-block s of rows [0, nr) (nr <= 16; rows past nr are zeros) into u's slot c.
 * The rows' raw code bytes are transposed (4 to 6 vectors per row, Q4_K to Q6_K, rather
 * than the 8 vectors of decoded codes) and decoded after: the decoding is byte-wise. */
static inline __attribute__((always_inline)) void unpack_superblock_q(const int qtype, const uint8_t *w,
                                                                      int64_t row_bytes, int nr, int64_t s, tile_t *u,
                                                                      int c) {
    const int bb = block_bytes(qtype), q6 = qtype == T_Q6_K, nraw = k_raw_count(qtype);
    const __m256i m32 = _mm256_set1_epi8(32), ones = _mm256_set1_epi8(1);
    for (int v = 0; v < 2; ++v) {
        __m256i raw[6][8]; /* [raw vector][row], then [raw vector][step] */
        __m256i sc_lo[8], sc_hi[8]; /* [row]: (scale, scale) per group (Q6_K: per 16, two halves) */
        __m256 mins[8];             /* [row]: dmin * min per group */
        float d[8];
        for (int r = 0; r < 8; ++r) {
            const uint8_t *b = w + (8 * v + r) * row_bytes + s * bb;
            if (8 * v + r >= nr) {
                for (int i = 0; i < nraw; ++i) raw[i][r] = _mm256_setzero_si256();
                sc_lo[r] = sc_hi[r] = _mm256_setzero_si256();
                mins[r] = _mm256_setzero_ps();
                d[r] = 0.f;
                continue;
            }
            __m256i row_raw[6];
            k_raw_avx2(qtype, b, row_raw);
            for (int i = 0; i < nraw; ++i) raw[i][r] = row_raw[i];
            if (q6) {
                const __m128i s16 = _mm_loadu_si128((const __m128i *)(b + 192));
                sc_lo[r] = byte_pairs(s16, 1);
                sc_hi[r] = byte_pairs(_mm_unpackhi_epi64(s16, s16), 1);
                d[r] = load_fp16(b + 208);
            } else {
                uint64_t sc, mn;
                scales_mins(b + 4, &sc, &mn);
                sc_lo[r] = byte_pairs(_mm_cvtsi64_si128((long long)sc), 0);
                mins[r] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn))),
                                        _mm256_set1_ps(load_fp16(b + 2)));
                d[r] = load_fp16(b);
            }
        }
        transpose8i(sc_lo);
        for (int j = 0; j < 8; ++j) u->sc[c][j][v] = sc_lo[j];
        if (q6) {
            transpose8i(sc_hi);
            for (int j = 0; j < 8; ++j) u->sc[c][8 + j][v] = sc_hi[j];
        } else {
            __m256i m[8];
            for (int r = 0; r < 8; ++r) m[r] = _mm256_castps_si256(mins[r]);
            transpose8i(m);
            for (int g = 0; g < 8; ++g) u->mn[c][g][v] = _mm256_castsi256_ps(m[g]);
        }
        u->d[c][v] = _mm256_loadu_ps(d);
        for (int i = 0; i < nraw; ++i) transpose8i(raw[i]);
        for (int j = 0; j < 8; ++j) { /* step j: values 4j .. 4j + 3 of every group */
            __m256i step_raw[6], codes[8];
            for (int i = 0; i < nraw; ++i) step_raw[i] = raw[i][j];
            k_codes_from_raw(qtype, step_raw, codes);
            for (int g = 0; g < 8; ++g) u->w[c][g][j][v] = q6 ? _mm256_sub_epi8(codes[g], m32) : codes[g];
        }
        if (q6) /* 128 * scale * sum(q - 32) per 16: 4 steps of q - 32 in [-32, 31] sum within a byte */
            for (int g = 0; g < 8; ++g) {
                __m256i(*st)[2] = u->w[c][g]; /* [step][v] */
                const __m256i h0 =
                    _mm256_add_epi8(_mm256_add_epi8(st[0][v], st[1][v]), _mm256_add_epi8(st[2][v], st[3][v]));
                const __m256i h1 =
                    _mm256_add_epi8(_mm256_add_epi8(st[4][v], st[5][v]), _mm256_add_epi8(st[6][v], st[7][v]));
                const __m256i a = _mm256_madd_epi16(_mm256_maddubs_epi16(ones, h0), u->sc[c][2 * g][v]);
                const __m256i b = _mm256_madd_epi16(_mm256_maddubs_epi16(ones, h1), u->sc[c][2 * g + 1][v]);
                u->corr[c][g][v] = _mm256_slli_epi32(_mm256_add_epi32(a, b), 7);
            }
    }
}

/* Q8_0 rows [0, nr) (rows past nr are zeros), values [256 s, 256 s + 256), into slot c
 * (0 or 1: each takes two of the K-quants' slots): the codes sign-extended to 16 bits,
 * value pair j of a block in lane r of vector j. The 8 rows' code pairs are transposed as
 * 16-bit elements within each 128-bit half (pairs 0-7 low, 8-15 high: 24 unpacks), then
 * each half widened: a third fewer shuffles than widening first and transposing 32-bit
 * lanes twice. */
static void unpack_q8_0(const uint8_t *w, int64_t row_bytes, int nr, int64_t s, tile_t *u, int c) {
    __m256i(*W)[16][2] = Q8_W(u, c);
    for (int v = 0; v < 2; ++v)
        for (int g = 0; g < 8; ++g) {
            __m256i q[8]; /* [row]: 16 code pairs */
            float d[8];
            for (int r = 0; r < 8; ++r) {
                const uint8_t *b = w + (8 * v + r) * row_bytes + (8 * s + g) * 34;
                if (8 * v + r >= nr) {
                    q[r] = _mm256_setzero_si256();
                    d[r] = 0.f;
                    continue;
                }
                q[r] = _mm256_loadu_si256((const __m256i *)(b + 2));
                d[r] = load_fp16(b);
            }
            __m256i t[8], x[8];
            for (int i = 0; i < 4; ++i) { /* (row 2i, row 2i + 1) pairs interleaved */
                t[2 * i] = _mm256_unpacklo_epi16(q[2 * i], q[2 * i + 1]);
                t[2 * i + 1] = _mm256_unpackhi_epi16(q[2 * i], q[2 * i + 1]);
            }
            for (int h = 0; h < 2; ++h) /* x[4h + j]: pairs 2j and 2j + 1 of rows 4h .. 4h + 3 */
                for (int i = 0; i < 2; ++i) {
                    x[4 * h + 2 * i] = _mm256_unpacklo_epi32(t[4 * h + i], t[4 * h + i + 2]);
                    x[4 * h + 2 * i + 1] = _mm256_unpackhi_epi32(t[4 * h + i], t[4 * h + i + 2]);
                }
            for (int j = 0; j < 4; ++j) { /* pair 2j (lo) and 2j + 1 (hi) of rows 0-7; + 8 in the high halves */
                const __m256i lo = _mm256_unpacklo_epi64(x[j], x[4 + j]), hi = _mm256_unpackhi_epi64(x[j], x[4 + j]);
                W[g][2 * j][v] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(lo));
                W[g][2 * j + 1][v] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(hi));
                W[g][8 + 2 * j][v] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(lo, 1));
                W[g][9 + 2 * j][v] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(hi, 1));
            }
            u->dq[c][g][v] = _mm256_loadu_ps(d);
        }
}

static void unpack_superblock(int qtype, const uint8_t *w, int64_t row_bytes, int nr, int64_t s, tile_t *u, int c) {
    switch (qtype) {
    case T_Q8_0: unpack_q8_0(w, row_bytes, nr, s, u, c); break;
    case T_Q4_K: unpack_superblock_q(T_Q4_K, w, row_bytes, nr, s, u, c); break;
    case T_Q5_K: unpack_superblock_q(T_Q5_K, w, row_bytes, nr, s, u, c); break;
    default: unpack_superblock_q(T_Q6_K, w, row_bytes, nr, s, u, c); break;
    }
}

/* Rows [0, nr) of the tile at w: the bytes [offset, offset + bytes) of each, into L1. */
static inline void prefetch_superblock(const uint8_t *w, int64_t row_bytes, int nr, int64_t offset, int bytes) {
    for (int r = 0; r < nr; ++r)
        for (int b = 0; b < bytes + 64; b += 64) /* + 64: the span need not start a line */
            _mm_prefetch((const char *)(w + r * row_bytes + offset + b), _MM_HINT_T0);
}

#endif
