/* Weight-only int4/int8 linear layers on the CPU, a few tokens at a time, from the WNA16
 * layout (wna16_blocks.h).
 *
 * wna16_gemv: y[m, n] = sum_k x[m, k] w[n, k] for a few tokens (decode): each block is
 * decoded once into registers and used for every token of the tile, so the weight is
 * streamed once per call at its packed size; tiles for AVX-512 and for AVX2 (whose build
 * rearranges x to the order its decoding gives the inputs in), a portable loop
 * elsewhere. wna16_gemv_int4_bf16: the same for int4
 * weights and bfloat16 tokens, by bfloat16 dot products (AVX-512 BF16). Larger batches
 * dequantise tiles (wna16_dequant.c) for a GEMM.
 *
 * The contract (shapes, who calls) is in wna16_cpu.py, which compiles this file and is
 * its only caller. Rows are spread over the caller's OpenMP threads; each row's sums run
 * in a fixed order, so results do not depend on the thread count.
 */

#include "wna16_blocks.h"

#define TOKENS 4 /* tokens per tile: at most 8 (rows x tokens) x 2 halves = 16 accumulators */
#define PREFETCH_BYTES (64 << 10) /* how far ahead wna16_gemv asks for the codes */

#ifdef __AVX512F__
/* Rows n0 .. n0+NR-1 (NR 1, 2 or 4) against MT tokens (1..TOKENS), NR * MT <= 8:
 * specialised per (NR, MT), so the NR * MT * 2 accumulators stay in registers. A
 * group's broadcast scale and zero are computed when the group changes (blocks of a
 * group are consecutive), not per block. */
INLINE void tile(int bits, const uint8_t *wq, int64_t row_bytes, const void *scales, int scale_dtype,
                 const uint8_t *zeros,
                 const int32_t *block_group, int64_t n0, const int NR, int64_t kp, int64_t g_count, const float *x,
                 int64_t ldx, const int MT, float *y, int64_t ldy) {
    __m512 acc[4][TOKENS][2];
    __m512 sv[4], table[4];
    __m512i zv[4];
    for (int r = 0; r < NR; ++r) {
        sv[r] = table[r] = _mm512_setzero_ps();
        zv[r] = _mm512_setzero_si512();
        for (int t = 0; t < MT; ++t) acc[r][t][0] = acc[r][t][1] = _mm512_setzero_ps();
    }
    const int64_t blocks = kp / BLOCK;
    int32_t current = -1;
    for (int64_t b = 0; b < blocks; ++b) {
        const int32_t g = block_group[b];
        if (g != current) {
            current = g;
            for (int r = 0; r < NR; ++r) {
                sv[r] = _mm512_set1_ps(load_scale(scales, (n0 + r) * g_count + g, scale_dtype));
                zv[r] = _mm512_set1_epi32(zeros[(n0 + r) * g_count + g]);
                if (bits == 4) table[r] = int4_table(zv[r], sv[r]);
            }
        }
        __m512 w[4][2];
        for (int r = 0; r < NR; ++r)
            decode_block(bits, wq + (n0 + r) * row_bytes, b, zv[r], sv[r], table[r], &w[r][0], &w[r][1]);
        for (int t = 0; t < MT; ++t) {
            const __m512 x0 = _mm512_loadu_ps(x + t * ldx + b * BLOCK);
            const __m512 x1 = _mm512_loadu_ps(x + t * ldx + b * BLOCK + 16);
            for (int r = 0; r < NR; ++r) {
                acc[r][t][0] = _mm512_fmadd_ps(w[r][0], x0, acc[r][t][0]);
                acc[r][t][1] = _mm512_fmadd_ps(w[r][1], x1, acc[r][t][1]);
            }
        }
    }
    for (int r = 0; r < NR; ++r)
        for (int t = 0; t < MT; ++t)
            y[t * ldy + n0 + r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][t][0], acc[r][t][1]));
}

#elif defined(__AVX2__)
/* The same tile with AVX2 (no AVX-512: Zen 3, older Intel), without widening shuffles: a
 * block's 16 (int4) or 32 (int8) bytes are broadcast to both halves of a vector and each
 * 32-bit lane shifted by its own count (vpsrlvd) and masked to one code, so the lanes
 * hold the block's inputs in the order X_ORDER, in which the caller has laid out x
 * (`permute_x`). Each (row, token) sums (q - z) x over the block (q - z exact) and adds
 * that sum times the block's scale to its accumulator: the scale is applied per block,
 * not per weight, which saves a multiply per 8 weights and rounds differently from the
 * AVX-512 tile (float32 either way). Tiles of NR * MT <= 4 keep the accumulators, the
 * shift counts and the rows' scales and zero points in the 16 registers (tiles of up to 4
 * rows spilled accumulators: 1.1-1.2x slower at 1-2 tokens). On the Zen 3 VM, 2026-12-06,
 * 2.0-2.3x the portable loop it replaces (docs/benchmarks.md). */
static const int32_t X_ORDER[BLOCK] = {0,  4,  8,  12, 1,  5,  9,  13, 2,  6,  10, 14, 3,  7,  11, 15,
                                       16, 20, 24, 28, 17, 21, 25, 29, 18, 22, 26, 30, 19, 23, 27, 31};

INLINE __m256 sum8(__m256 v) { /* the 8 lanes' sum, in a fixed order */
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm256_castps128_ps256(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

/* Lanes 0-3 shifted by `lo`, 4-7 by `hi`. */
INLINE __m256i shifts(int lo, int hi) { return _mm256_setr_epi32(lo, lo, lo, lo, hi, hi, hi, hi); }

/* Vector i (0..3) of block b of a row: its codes minus the zero point `zf`, as floats. */
INLINE __m256 codes_minus_zero(const int BITS, const uint8_t *row, int64_t b, int i, __m256 zf) {
    __m256i v, shift;
    if (BITS == 4) {
        v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(row + b * 16)));
        shift = i == 0 ? shifts(0, 8) : i == 1 ? shifts(16, 24) : i == 2 ? shifts(4, 12) : shifts(20, 28);
    } else {
        v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(row + b * BLOCK + 16 * (i >> 1))));
        shift = i & 1 ? shifts(16, 24) : shifts(0, 8);
    }
    const __m256i q = _mm256_and_si256(_mm256_srlv_epi32(v, shift), _mm256_set1_epi32(BITS == 4 ? 15 : 255));
    return _mm256_sub_ps(_mm256_cvtepi32_ps(q), zf);
}

INLINE void tile(const int BITS, const uint8_t *wq, int64_t row_bytes, const void *scales, int scale_dtype,
                 const uint8_t *zeros,
                 const int32_t *block_group, int64_t n0, const int NR, int64_t kp, int64_t g_count, const float *x,
                 int64_t ldx, const int MT, float *y, int64_t ldy) {
    __m256 acc[2][TOKENS], sv[2], zf[2];
    for (int r = 0; r < NR; ++r) {
        sv[r] = zf[r] = _mm256_setzero_ps();
        for (int t = 0; t < MT; ++t) acc[r][t] = _mm256_setzero_ps();
    }
    const int64_t blocks = kp / BLOCK;
    int32_t current = -1;
    for (int64_t b = 0; b < blocks; ++b) {
        const int32_t g = block_group[b];
        if (g != current) {
            current = g;
            for (int r = 0; r < NR; ++r) {
                sv[r] = _mm256_set1_ps(load_scale(scales, (n0 + r) * g_count + g, scale_dtype));
                zf[r] = _mm256_set1_ps((float)zeros[(n0 + r) * g_count + g]);
            }
        }
        for (int r = 0; r < NR; ++r) {
            const uint8_t *row = wq + (n0 + r) * row_bytes;
            __m256 part[TOKENS];
            for (int i = 0; i < 4; ++i) {
                const __m256 w = codes_minus_zero(BITS, row, b, i, zf[r]);
                for (int t = 0; t < MT; ++t) {
                    const __m256 xv = _mm256_loadu_ps(x + t * ldx + b * BLOCK + 8 * i);
                    part[t] = i == 0 ? _mm256_mul_ps(w, xv) : _mm256_fmadd_ps(w, xv, part[t]);
                }
            }
            for (int t = 0; t < MT; ++t) acc[r][t] = _mm256_fmadd_ps(part[t], sv[r], acc[r][t]);
        }
    }
    for (int r = 0; r < NR; ++r)
        for (int t = 0; t < MT; ++t) y[t * ldy + n0 + r] = _mm256_cvtss_f32(sum8(acc[r][t]));
}

/* x [m, kp] (row stride ldx) with each block's inputs in X_ORDER, into xp [m, kp]. */
static void permute_x(const float *x, int64_t ldx, int64_t m, int64_t kp, float *xp) {
    for (int64_t t = 0; t < m; ++t)
        for (int64_t b = 0; b < kp / BLOCK; ++b)
            for (int j = 0; j < BLOCK; ++j) xp[t * kp + b * BLOCK + j] = x[t * ldx + b * BLOCK + X_ORDER[j]];
}
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
/* bits as a constant (4 or 8), so each tile's decoding is compiled without a branch */
#define TILE_CASE(NR, MT)                                                                                      \
    (bits == 4 ? tile(4, wq, row_bytes, scales, scale_dtype, zeros, block_group, n, NR, kp, g_count, x, ldx, MT, \
                      y, ldy)                                                                                  \
               : tile(8, wq, row_bytes, scales, scale_dtype, zeros, block_group, n, NR, kp, g_count, x, ldx, MT, \
                      y, ldy))

#if !defined(__AVX512F__)
/* AVX2: pairs of rows against 1 or 2 tokens, single rows against 3 or 4. */
static void rows_tile(int bits, const uint8_t *wq, int64_t row_bytes, const void *scales, int scale_dtype,
                      const uint8_t *zeros, const int32_t *block_group, int64_t n, int nr, int64_t kp,
                      int64_t g_count, const float *x, int64_t ldx, int mt, float *y, int64_t ldy) {
    if (mt <= 2) {
        for (; nr >= 2; nr -= 2, n += 2) {
            if (mt == 1) TILE_CASE(2, 1);
            else TILE_CASE(2, 2);
        }
        if (nr == 1) {
            if (mt == 1) TILE_CASE(1, 1);
            else TILE_CASE(1, 2);
        }
        return;
    }
    for (; nr > 0; --nr, ++n) {
        if (mt == 3) TILE_CASE(1, 3);
        else TILE_CASE(1, 4);
    }
}
#else
static void rows_tile(int bits, const uint8_t *wq, int64_t row_bytes, const void *scales, int scale_dtype,
                 const uint8_t *zeros,
                      const int32_t *block_group, int64_t n, int nr, int64_t kp, int64_t g_count, const float *x,
                      int64_t ldx, int mt, float *y, int64_t ldy) {
    if (nr == 4 && mt == 1) TILE_CASE(4, 1);
    else if (nr == 4 && mt == 2) TILE_CASE(4, 2);
    else if (nr >= 2) {
        for (int64_t r = 0; r + 2 <= nr; r += 2, n += 2) switch (mt) {
            case 1: TILE_CASE(2, 1); break;
            case 2: TILE_CASE(2, 2); break;
            case 3: TILE_CASE(2, 3); break;
            default: TILE_CASE(2, 4); break;
            }
        if (nr & 1)
            rows_tile(bits, wq, row_bytes, scales, scale_dtype, zeros, block_group, n, 1, kp, g_count, x, ldx, mt, y,
                      ldy);
    } else switch (mt) {
        case 1: TILE_CASE(1, 1); break;
        case 2: TILE_CASE(1, 2); break;
        case 3: TILE_CASE(1, 3); break;
        default: TILE_CASE(1, 4); break;
        }
}
#endif
#else
/* Portable: one row against up to TOKENS tokens, a block decoded into 32 floats at a time. */
static void rows_tile(int bits, const uint8_t *wq, int64_t row_bytes, const void *scales, int scale_dtype,
                 const uint8_t *zeros,
                      const int32_t *block_group, int64_t n0, int nr, int64_t kp, int64_t g_count, const float *x,
                      int64_t ldx, int mt, float *y, int64_t ldy) {
    for (int64_t n = n0; n < n0 + nr; ++n) {
        float acc[TOKENS][BLOCK];
        memset(acc, 0, sizeof acc);
        for (int64_t b = 0; b < kp / BLOCK; ++b) {
            const int32_t g = block_group[b];
            float w[BLOCK];
            decode_block_scalar(bits, wq + n * row_bytes, b, load_scale(scales, n * g_count + g, scale_dtype),
                                zeros[n * g_count + g], w);
            for (int t = 0; t < mt; ++t)
                for (int j = 0; j < BLOCK; ++j) acc[t][j] += w[j] * x[t * ldx + b * BLOCK + j];
        }
        for (int t = 0; t < mt; ++t) {
            float sum = 0.f;
            for (int j = 0; j < BLOCK; ++j) sum += acc[t][j];
            y[t * ldy + n] = sum;
        }
    }
}
#endif

/* y [M, N] (row stride ldy) = x [M, Kp] (row stride ldx, float32) times w^T. Returns 0,
 * or 1 when the AVX2 build's scratch (x rearranged, 4 bytes an input a token) could not
 * be allocated (nothing computed). */
int wna16_gemv(int bits, const uint8_t *wq, const void *scales, int scale_dtype,
                 const uint8_t *zeros, const int32_t *block_group,
               int64_t n_rows, int64_t kp, int64_t g_count, const float *x, int64_t ldx, int64_t m, float *y,
               int64_t ldy, int num_threads) {
    const int64_t row_bytes = kp * bits / 8;
    const int64_t quads = (n_rows + 3) / 4;
#if !defined(__AVX512F__) && defined(__AVX2__)
    float *xp = malloc((size_t)(m * kp) * sizeof(float));
    if (xp == NULL) return 1;
    permute_x(x, ldx, m, kp, xp);
    x = xp, ldx = kp;
#endif
    /* each quad asks for the quad PREFETCH_BYTES of codes ahead (into L2): a few tokens'
     * tiles consume the codes faster than the hardware prefetchers bring them */
    const int64_t ahead = PREFETCH_BYTES / (4 * row_bytes) + 1; /* quads */
#pragma omp parallel for num_threads(num_threads) schedule(static) if (n_rows * kp >= (1 << 15))
    for (int64_t q = 0; q < quads; ++q) {
        const int64_t n = 4 * q;
        const int nr = n + 4 <= n_rows ? 4 : (int)(n_rows - n);
        if (q + ahead < quads)
            for (int64_t off = 0; off < 4 * row_bytes; off += 64)
                __builtin_prefetch(wq + 4 * (q + ahead) * row_bytes + off, 0, 2);
        for (int64_t t0 = 0; t0 < m; t0 += TOKENS) {
            const int mt = m - t0 < TOKENS ? (int)(m - t0) : TOKENS;
            rows_tile(bits, wq, row_bytes, scales, scale_dtype, zeros, block_group, n, nr, kp, g_count, x + t0 * ldx,
                      ldx, mt, y + t0 * ldy, ldy);
        }
    }
#if !defined(__AVX512F__) && defined(__AVX2__)
    free(xp);
#endif
    return 0;
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* The int4 GEMV for bfloat16 activations (a few tokens), two blocks (64 inputs) a step with
 * bfloat16 dot products (vdpbf16ps, 32 products an instruction) and no table lookups:
 *
 *   a code q becomes the bfloat16 128 + q (exponent of 128, q in the mantissa: one
 *   ternary-logic op), so each row sums s_g * (128 + q) * x exactly as bfloat16 products
 *   in float32, and the row's zero term, sum_g s_g * (z_g + 128) * X_g (X_g: group g's sum
 *   of x), is subtracted once per row at the end.
 *
 * `xp` holds x in bfloat16 rearranged per 64 inputs to match: words 0..15 and 16..31 of
 * the "low" vector are inputs 0..15 and 32..47 (the low nibbles of two blocks), of the
 * "high" vector inputs 16..31 and 48..63. dpbf16 lane i sums words 2i and 2i + 1, so
 * lanes 0..7 hold the first block and 8..15 the second: each half gets its block's
 * scale. Rows n0 .. n0 + 3. */
/* Scales [i, i + count) (count <= 16) as float32, the rest of the vector 0. */
INLINE __m512 load_scales16(const void *scales, int64_t i, int count, int scale_dtype) {
    const __mmask16 mask = (__mmask16)((1u << count) - 1u);
    if (scale_dtype == 0) return _mm512_maskz_loadu_ps(mask, (const float *)scales + i);
    const __m256i h = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)scales + i);
    if (scale_dtype == 1) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Row n's zero term: sum_g s_g * (z_g + 128) * X_g, 16 groups at a time. */
INLINE float zero_term(const void *scales, int scale_dtype, const uint8_t *zeros, int64_t n, int64_t g_count,
                       const float *group_sums) {
    __m512 acc = _mm512_setzero_ps();
    const __m512i offset = _mm512_set1_epi32(128);
    for (int64_t g = 0; g < g_count; g += 16) {
        const int count = g_count - g < 16 ? (int)(g_count - g) : 16;
        const __mmask16 mask = (__mmask16)((1u << count) - 1u);
        const __m512 s = load_scales16(scales, n * g_count + g, count, scale_dtype);
        const __m512i z = _mm512_add_epi32(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask, zeros + n * g_count + g)),
                                           offset);
        acc = _mm512_fmadd_ps(_mm512_mul_ps(s, _mm512_cvtepi32_ps(z)), _mm512_maskz_loadu_ps(mask, group_sums + g),
                              acc);
    }
    return _mm512_reduce_add_ps(acc);
}

/* Rows n0 .. n0 + NR - 1 against MT tokens (NR * MT <= 16), specialised per (NR, MT). */
INLINE void int4_bf16_tile(const uint8_t *wq, int64_t row_bytes, const void *scales, int scale_dtype,
                           const uint8_t *zeros, const int32_t *block_group, int64_t n0, const int NR, int64_t kp,
                           int64_t g_count, const __m512bh *xp, const float *group_sums, const int MT, float *y,
                           int64_t ldy) {
    const __m512i low_nibble = _mm512_set1_epi16(0x000f), exp128 = _mm512_set1_epi16(0x4300);
    const int64_t x_stride = kp / 32; /* vectors of 32 bfloat16 per token */
    __m512 total[4][TOKENS], svec[4];
    for (int r = 0; r < NR; ++r) {
        svec[r] = _mm512_setzero_ps();
        for (int t = 0; t < MT; ++t) total[r][t] = _mm512_setzero_ps();
    }
    int32_t cur_a = -1, cur_b = -1;
    for (int64_t c = 0; c < kp / 64; ++c) {
        const int32_t ga = block_group[2 * c], gb = block_group[2 * c + 1];
        if (ga != cur_a || gb != cur_b) {
            cur_a = ga, cur_b = gb;
            for (int r = 0; r < NR; ++r) {
                const int64_t base = (n0 + r) * g_count;
                svec[r] = _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(load_scale(scales, base + ga, scale_dtype)),
                                               _mm512_set1_ps(load_scale(scales, base + gb, scale_dtype)));
            }
        }
        for (int r = 0; r < NR; ++r) {
            const uint8_t *codes = wq + (n0 + r) * row_bytes + c * 32;
            const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)codes));
            /* (bytes & 0xf) | 0x4300, and ((bytes >> 4) & 0xf) | 0x4300: imm 0xf8 is A | (B & C) */
            const __m512i w_lo = _mm512_ternarylogic_epi32(exp128, bytes, low_nibble, 0xf8);
            const __m512i w_hi = _mm512_ternarylogic_epi32(exp128, _mm512_srli_epi16(bytes, 4), low_nibble, 0xf8);
            for (int t = 0; t < MT; ++t) {
                __m512 part = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)w_lo, xp[t * x_stride + 2 * c]);
                part = _mm512_dpbf16_ps(part, (__m512bh)w_hi, xp[t * x_stride + 2 * c + 1]);
                total[r][t] = _mm512_fmadd_ps(svec[r], part, total[r][t]);
            }
        }
    }
    for (int r = 0; r < NR; ++r)
        for (int t = 0; t < MT; ++t)
            y[t * ldy + n0 + r] = _mm512_reduce_add_ps(total[r][t]) -
                                  zero_term(scales, scale_dtype, zeros, n0 + r, g_count, group_sums + t * g_count);
}

#define INT4_BF16_CASE(NR, MT)                                                                                  \
    int4_bf16_tile(wq, row_bytes, scales, scale_dtype, zeros, block_group, n, NR, kp, g_count, xp, group_sums, \
                   MT, y, ldy)

/* Rows n .. n + nr - 1 (nr <= 4) against mt <= TOKENS tokens. One token: one row at a
 * time, as a single stream of codes reads DRAM at about 1.6x the rate four interleaved
 * rows do (a 64 MiB weight on one Zen 5 core: 9.7 against 6.0 GB/s; bfloat16 F.linear
 * 11). More tokens are compute-bound: four rows a tile, 16 accumulators. */
static void int4_bf16_rows(const uint8_t *wq, int64_t row_bytes, const void *scales, int scale_dtype,
                           const uint8_t *zeros, const int32_t *block_group, int64_t n, int nr, int64_t kp,
                           int64_t g_count, const __m512bh *xp, const float *group_sums, int mt, float *y,
                           int64_t ldy) {
    if (mt == 1) {
        for (int r = 0; r < nr; ++r, ++n) INT4_BF16_CASE(1, 1);
        return;
    }
    if (nr == 4) switch (mt) {
        case 2: INT4_BF16_CASE(4, 2); return;
        case 3: INT4_BF16_CASE(4, 3); return;
        default: INT4_BF16_CASE(4, 4); return;
        }
    for (int r = 0; r < nr; ++r, ++n) switch (mt) {
        case 2: INT4_BF16_CASE(1, 2); break;
        case 3: INT4_BF16_CASE(1, 3); break;
        default: INT4_BF16_CASE(1, 4); break;
        }
}

/* y [M, N] (row stride ldy) = x [M, Kp] (bfloat16, row stride ldx) times w^T, for int4
 * weights whose block count is even. Returns 0, or 1 when its scratch could not be
 * allocated (nothing computed). */
int wna16_gemv_int4_bf16(const uint8_t *wq, const void *scales, int scale_dtype, const uint8_t *zeros,
                         const int32_t *block_group, int64_t n_rows, int64_t kp, int64_t g_count, const uint16_t *x,
                         int64_t ldx, int64_t m, float *y, int64_t ldy, int num_threads) {
    const int64_t row_bytes = kp / 2, blocks = kp / BLOCK;
    __m512bh *xp = aligned_alloc(64, (size_t)(m * kp * 2));
    float *group_sums = calloc((size_t)(m * g_count), sizeof(float));
    if (xp == NULL || group_sums == NULL) {
        free(xp), free(group_sums);
        return 1;
    }
    for (int64_t t = 0; t < m; ++t) {
        const uint16_t *xt = x + t * ldx;
        uint16_t *xw = (uint16_t *)xp + t * kp;
        for (int64_t c = 0; c < kp / 64; ++c) {
            const uint16_t *src = xt + 64 * c;
            uint16_t *lo = xw + 64 * c, *hi = lo + 32;
            memcpy(lo, src, 32), memcpy(lo + 16, src + 32, 32);
            memcpy(hi, src + 16, 32), memcpy(hi + 16, src + 48, 32);
        }
        for (int64_t b = 0; b < blocks; ++b) {
            float sum = 0.f;
            for (int j = 0; j < BLOCK; ++j) {
                const uint32_t u = (uint32_t)xt[b * BLOCK + j] << 16;
                float f;
                memcpy(&f, &u, sizeof f);
                sum += f;
            }
            group_sums[t * g_count + block_group[b]] += sum;
        }
    }
    const int64_t quads = (n_rows + 3) / 4;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (n_rows * kp >= (1 << 15))
    for (int64_t q = 0; q < quads; ++q) {
        const int64_t n = 4 * q;
        const int nr = n + 4 <= n_rows ? 4 : (int)(n_rows - n);
        for (int64_t t0 = 0; t0 < m; t0 += TOKENS) {
            const int mt = m - t0 < TOKENS ? (int)(m - t0) : TOKENS;
            int4_bf16_rows(wq, row_bytes, scales, scale_dtype, zeros, block_group, n, nr, kp, g_count,
                           xp + t0 * (kp / 32), group_sums + t0 * g_count, mt, y + t0 * ldy, ldy);
        }
    }
    free(xp), free(group_sums);
    return 0;
}

int wna16_has_gemv_int4_bf16(void) { return 1; }
#else
int wna16_gemv_int4_bf16(const uint8_t *wq, const void *scales, int scale_dtype, const uint8_t *zeros,
                         const int32_t *block_group, int64_t n_rows, int64_t kp, int64_t g_count, const uint16_t *x,
                         int64_t ldx, int64_t m, float *y, int64_t ldy, int num_threads) {
    (void)wq, (void)scales, (void)scale_dtype, (void)zeros, (void)block_group, (void)n_rows, (void)kp;
    (void)g_count, (void)x, (void)ldx, (void)m, (void)y, (void)ldy, (void)num_threads;
    return 2;
}

int wna16_has_gemv_int4_bf16(void) { return 0; }
#endif
