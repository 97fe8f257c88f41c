/* K-quant (Q4_K, Q5_K, Q6_K), Q8_0 and Q4_0 rows times 8 or more tokens (Q8_0: 16, where
 * the build has bf16 tiles: gguf_int8_tile_min_tokens), in integers
 * (gguf_gemm_int8_tiles): a concurrent decode's batches and every prefill. Its contract
 * and where it is taken are in gguf_kernels.py, which compiles it with gguf_kernels.c (the
 * block layouts), and is its only caller.
 *
 * The activations are quantised per token and per 32 values to int8, dx = amax / 127,
 * rounded to nearest even: the granularity of vLLM's GGUF kernels (their Q8_1) and of
 * llama.cpp's Q4_0/Q8_0 products, finer than llama.cpp's per 256 for the K-quants (Q8_K,
 * gguf_vnni.c's for K-quant rows), which flipped a greedy token of
 * tests/test_gguf_quantised.py's tiny model where this does not. The weights'
 * integers stay integers: each tile of 16 rows is unpacked, once per call, into a
 * per-thread buffer of bytes laid out for vpdpbusd with one row per 32-bit lane (lane r
 * holds 4 consecutive values of row r), so a 64-byte load of the buffer and one token's 4
 * activations broadcast give 64 products for 16 rows, and each token's sums stay in the
 * lanes of their rows: no horizontal sums. Per 32 values and token, the integer sum is
 * scaled in float by the token's dx and the 16 rows' d * scale (Q6_K: two groups of 16,
 * two scales; Q4_0/Q8_0: each block's d); a Q4_K/Q5_K min, dmin * min * sum(x), is one
 * fused multiply-add from the sums of x taken while quantising. vpdpbusd multiplies
 * unsigned weight bytes: Q6_K's codes are q + 32, Q4_0's q + 8, Q8_0's q + 128 (their sign
 * bits flipped at unpacking), so each group's integer sum starts at -offset * sum(xq).
 * The unpacking (a 16 x 16 transpose of 32-bit words per 64 values) costs about a fifth
 * of a 16-token K-quant product and nothing next to a prefill's; Q8_0's, 8 bits a value,
 * keeps its tiles behind the bf16 tiles below about 12 tokens.
 *
 * Error against float activations: at most sum_i |w_i| * dx_i / 2 per output (the
 * activations' rounding), plus float rounding of the scaled sums (each integer sum is
 * exact). Against the bf16 tiles and the prefill's bf16 GEMM on dequantised tiles, which
 * it replaces for these types (2026-12-05, the Zen 5 VM, 2 threads): a 5632 x 2048 Q4_K
 * weight 1.12 -> 0.73 ms at 8 tokens, 1.36 -> 0.92 at 16, 114 -> 84 at 2048; a 2048 x
 * 5632 Q6_K one 1.19 -> 0.77, 1.42 -> 0.97 and 110 -> 86 ms. A 5632 x 2048 Q8_0 weight
 * (2026-12-06, Zen 4): 4.2 -> 3.1 ms at 64 tokens, 8.0 -> 5.7 at 128, 31.4 -> 20.6 at 512. */

#include "gguf_blocks.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
#include <omp.h>
#include <stdlib.h>

#define TILE_ROWS 16  /* one row per 32-bit lane */
/* Each row's blocks are prefetched into L2 this many blocks ahead of the unpacking (16
 * streams a tile): 16-token products of a Q4_K_M layer 3-15% faster than none, within
 * the noise between 2 and 16 (2026-12-05). */
#define PREFETCH_BLOCKS 8
#define TILE_TOKENS 8 /* tokens sharing each load of the unpacked tile (Q6_K: 24 of 32 registers hold sums) */

/* The quantised activations of every token, read by every thread. */
typedef struct {
    int64_t k;
    int8_t *xq;     /* [m][k], natural order */
    float *dx;      /* [m][k / 32]: dx of each 32 */
    float *xs32;    /* [m][k / 32]: dx * sum(xq) per 32 (Q4_K/Q5_K mins) */
    int32_t *is16;  /* [m][k / 16]: 32 * sum(xq) per 16 (the offsets: Q6_K per 16, Q4_0/Q8_0 per 32) */
} qx_t;

/* 16 activations of token row x (x_dtype 1: bfloat16, 2: float16) as float32. */
static inline __m512 load_x16(const uint16_t *x, int x_dtype) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)x);
    return x_dtype == 1 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)) : _mm512_cvtph_ps(h);
}

static void quantize_token(const uint16_t *x, int x_dtype, const qx_t *q, int64_t t) {
    const int64_t k = q->k;
    int8_t *xq = q->xq + t * k;
    for (int64_t g = 0; g < k / 32; ++g) {
        const __m512 a = load_x16(x + 32 * g, x_dtype), c = load_x16(x + 32 * g + 16, x_dtype);
        const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
        const float dx = mx / 127.f, inv = mx > 0.f ? 127.f / mx : 0.f;
        /* x * inv rounded to nearest even (the default rounding mode), as gguf_quantize_x.h rounds it */
        const __m512i ia = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv)));
        const __m512i ic = _mm512_cvtps_epi32(_mm512_mul_ps(c, _mm512_set1_ps(inv)));
        _mm_storeu_si128((__m128i *)(xq + 32 * g), _mm512_cvtepi32_epi8(ia));
        _mm_storeu_si128((__m128i *)(xq + 32 * g + 16), _mm512_cvtepi32_epi8(ic));
        const int sa = _mm512_reduce_add_epi32(ia), sc = _mm512_reduce_add_epi32(ic);
        q->dx[t * (k / 32) + g] = dx;
        q->xs32[t * (k / 32) + g] = dx * (float)(sa + sc);
        q->is16[t * (k / 16) + 2 * g] = 32 * sa;
        q->is16[t * (k / 16) + 2 * g + 1] = 32 * sc;
    }
}

/* r[i] (16 words of row i) -> r[c] (word c of every row): a 16 x 16 transpose. */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; ++i) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; ++i) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
    }
}

static inline __m512i join256(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* A Q4_K/Q5_K 256-block's scales for 16 rows (lane r: row r's dword at bytes 0, 4, 8, 12
 * of its block: fp16 d and dmin, then the 12 bytes of 6-bit (scale, min) pairs, as
 * scale_min_k4 reads them) -> s1[g * 16 + r] = d * scale_g, s2[...] = dmin * min_g. */
static inline void k4_scales(__m512i dd, __m512i u0, __m512i u1, __m512i u2, float *s1, float *s2) {
    const __m512i m2 = _mm512_set1_epi32(3), m4 = _mm512_set1_epi32(15), m6 = _mm512_set1_epi32(63);
    const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dd));
    const __m512 dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dd, 16)));
    for (int g = 0; g < 8; ++g) {
        __m512i sc, mn;
        if (g < 4) {
            sc = _mm512_and_si512(_mm512_srli_epi32(u0, 8 * g), m6);
            mn = _mm512_and_si512(_mm512_srli_epi32(u1, 8 * g), m6);
        } else {
            const int h = 8 * (g - 4);
            sc = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u2, h), m4),
                                 _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u0, h + 6), m2), 4));
            mn = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u2, h + 4), m4),
                                 _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u1, h + 6), m2), 4));
        }
        _mm512_store_ps(s1 + g * 16, _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc)));
        _mm512_store_ps(s2 + g * 16, _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mn)));
    }
}

/* Values [64j, 64j + 64) of one 256-value run (a K-quant block, 8 Q4_0/Q8_0 blocks) as
 * unsigned bytes, natural order: Q4_K/Q5_K's q (0-15, 0-31), Q6_K's q before its - 32
 * (0-63), Q4_0's before its - 8 (0-15), Q8_0's plus 128 (0-255). */
static inline __m512i unpack64(int qtype, const uint8_t *blk, int j) {
    const __m512i b4 = _mm512_set1_epi8(15), b1 = _mm512_set1_epi8(1), b2 = _mm512_set1_epi8(3);
    if (qtype == T_Q8_0) { /* blocks 2j and 2j + 1 of the run: 32 codes each after the fp16 d, sign bits flipped */
        const __m512i q = join256(_mm256_loadu_si256((const __m256i *)(blk + 68 * j + 2)),
                                  _mm256_loadu_si256((const __m256i *)(blk + 68 * j + 36)));
        return _mm512_xor_si512(q, _mm512_set1_epi8((char)0x80));
    }
    if (qtype == T_Q4_0) { /* blocks 2j and 2j + 1: 16 bytes each, low nibbles values 0-15, high 16-31 */
        const __m256i q = _mm256_loadu2_m128i((const __m128i *)(blk + 36 * j + 20),
                                              (const __m128i *)(blk + 36 * j + 2));
        const __m256i m = _mm256_set1_epi8(15);
        const __m256i l = _mm256_and_si256(q, m), h = _mm256_and_si256(_mm256_srli_epi16(q, 4), m);
        /* l: [low nibbles of 2j | of 2j + 1], h likewise -> values of block 2j, then of 2j + 1 */
        return join256(_mm256_permute2x128_si256(l, h, 0x20), _mm256_permute2x128_si256(l, h, 0x31));
    }
    if (qtype != T_Q6_K) { /* 32 bytes of nibbles: low nibbles group 2j, high 2j + 1 */
        const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + (qtype == T_Q4_K ? 16 : 48) + 32 * j));
        __m512i v = _mm512_and_si512(join256(q, _mm256_srli_epi16(q, 4)), b4);
        if (qtype == T_Q5_K) { /* fifth bits: bit 2j (low half) and 2j + 1 (high) of qh[l] */
            const __m256i h = _mm256_loadu_si256((const __m256i *)(blk + 16));
            const __m512i hb = join256(_mm256_srli_epi16(h, 2 * j), _mm256_srli_epi16(h, 2 * j + 1));
            v = _mm512_or_si512(v, _mm512_slli_epi16(_mm512_and_si512(hb, b1), 4));
        }
        return v;
    }
    /* Q6_K, half n = j / 2: ql byte l < 32 holds values l (low nibble) and 64 + l (high),
     * byte 32 + l values 32 + l and 96 + l; qh byte l the top 2 bits of l, 32 + l, 64 + l,
     * 96 + l. Even j: low nibbles and qh bits 0-3; odd j: high nibbles and bits 4-7. */
    const uint8_t *ql = blk + 64 * (j / 2), *qh = blk + 128 + 32 * (j / 2);
    const int shift = 4 * (j & 1);
    const __m512i lo = join256(_mm256_loadu_si256((const __m256i *)ql), _mm256_loadu_si256((const __m256i *)(ql + 32)));
    const __m256i e = _mm256_loadu_si256((const __m256i *)qh);
    const __m512i hi = join256(e, _mm256_srli_epi16(e, 2));
    return _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lo, shift), b4),
                           _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hi, shift), b2), 4));
}

/* Rows [0, nr) of a tile (row r at w + r * row_bytes; rows nr..15 read as zeros), every
 * 256-value run b: wq[(64 b + c) * 64 + 4 r + i] = value 4c + i of row r's run b; s1[g * 16
 * + r] = d * scale of group g (per 32 values, Q6_K per 16; Q4_0/Q8_0: block g's d), s2 =
 * dmin * min (Q4_K/Q5_K). */
static void unpack_tile(int qtype, const uint8_t *w, int64_t row_bytes, int nr, int64_t nb, uint8_t *wq, float *s1,
                        float *s2) {
    const int bb = block_bytes(qtype) * (256 / block_size(qtype)); /* a run of 256 values: Q4_0/Q8_0 take 8 blocks */
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int)row_bytes));
    const __mmask16 live = (__mmask16)((1u << nr) - 1u);
#define GATHER(off) _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, rows, (const void *)(wb + (off)), 1)
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *wb = w + b * bb;
        /* each row's stream PREFETCH_BLOCKS runs ahead, into L2; past the row's end, the
         * same row of the next tile (a thread's next, under the static schedule) */
        const uint8_t *ahead = b + PREFETCH_BLOCKS < nb ? wb + PREFETCH_BLOCKS * bb
                                                         : w + TILE_ROWS * row_bytes + (b + PREFETCH_BLOCKS - nb) * bb;
        for (int r = 0; r < nr; ++r)
            for (int off = 0; off < bb; off += 64) _mm_prefetch((const char *)ahead + r * row_bytes + off, _MM_HINT_T1);
        if (qtype == T_Q8_0 || qtype == T_Q4_0) { /* each block's fp16 d, read as its first 32-bit word's low half */
            for (int g = 0; g < 8; ++g)
                _mm512_store_ps(s1 + (b * 8 + g) * 16, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(GATHER(g * bb / 8))));
        } else if (qtype != T_Q6_K) { /* fp16 d, dmin, then the 12 bytes of (scale, min) pairs (scale_min_k4) */
            k4_scales(GATHER(0), GATHER(4), GATHER(8), GATHER(12), s1 + b * 8 * 16, s2 + b * 8 * 16);
        } else { /* 16 int8 scales at 192, fp16 d at 208 (read from 206: not past the row) */
            const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(GATHER(206), 16)));
            for (int i = 0; i < 4; ++i) {
                const __m512i u = GATHER(192 + 4 * i);
                for (int j = 0; j < 4; ++j) {
                    const __m512i sc = _mm512_srai_epi32(_mm512_slli_epi32(u, 24 - 8 * j), 24);
                    _mm512_store_ps(s1 + (b * 16 + 4 * i + j) * 16, _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc)));
                }
            }
        }
        for (int j = 0; j < 4; ++j) {
            __m512i v[16];
            for (int r = 0; r < 16; ++r) v[r] = r < nr ? unpack64(qtype, wb + r * row_bytes, j) : _mm512_setzero_si512();
            transpose16(v);
            for (int c = 0; c < 16; ++c) _mm512_store_si512((void *)(wq + (b * 64 + 16 * j + c) * 64), v[c]);
        }
    }
#undef GATHER
}

/* acc += wv (unsigned bytes) . the 4 signed bytes at p broadcast to every lane: the
 * broadcast as the instruction's memory operand ({1to16}), which the compiler does not
 * fold from _mm512_set1_epi32 (a separate vpbroadcastd per product). */
static inline __m512i dpbusd_bcast(__m512i acc, __m512i wv, const int8_t *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(wv), "m"(*(const int32_t *)p));
    return acc;
}

/* acc[t] (lane r: row r) = the tile times tokens [0, nt) of the quantised activations
 * (xq at the first token; dx, xs32 and is16 likewise). Inlined once per nt. */
static inline __attribute__((always_inline)) void tile_times_tokens(int qtype, int nt, const uint8_t *wq,
                                                                    const float *s1, const float *s2,
                                                                    const int8_t *xq, const float *dx,
                                                                    const float *xs32, const int32_t *is16,
                                                                    int64_t k, int offset, __m512 acc[TILE_TOKENS]) {
    for (int t = 0; t < nt; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t u = 0; u < k / 32; ++u) { /* the 32 values sharing one dx */
        const uint8_t *wu = wq + u * 8 * 64;
        const int8_t *xu = xq + 32 * u;
        if (qtype == T_Q8_0) { /* Q8_0 or Q4_0, one block: (sum - offset * sum(xq)) * dx * d, the sum starting at
                                * the offset's part (the codes are unsigned: Q8_0's + 128, Q4_0's + 8) */
            __m512i sum[TILE_TOKENS];
            for (int t = 0; t < nt; ++t) { /* is16 holds 32 * sum(xq) per 16 values */
                const int32_t *xs = is16 + t * (k / 16) + 2 * u;
                sum[t] = _mm512_set1_epi32(-offset * ((xs[0] + xs[1]) / 32));
            }
            for (int c = 0; c < 8; ++c) {
                const __m512i wv = _mm512_load_si512((const void *)(wu + 64 * c));
                for (int t = 0; t < nt; ++t) sum[t] = dpbusd_bcast(sum[t], wv, xu + t * k + 4 * c);
            }
            const __m512 scale = _mm512_load_ps(s1 + u * 16);
            for (int t = 0; t < nt; ++t) {
                const __m512 dot = _mm512_mul_ps(_mm512_cvtepi32_ps(sum[t]), _mm512_set1_ps(dx[t * (k / 32) + u]));
                acc[t] = _mm512_fmadd_ps(dot, scale, acc[t]);
            }
        } else if (qtype != T_Q6_K) { /* one group: sum * dx * (d * scale) - (dmin * min) * xs32 */
            __m512i sum[TILE_TOKENS];
            for (int t = 0; t < nt; ++t) sum[t] = _mm512_setzero_si512();
            for (int c = 0; c < 8; ++c) {
                const __m512i wv = _mm512_load_si512((const void *)(wu + 64 * c));
                for (int t = 0; t < nt; ++t) sum[t] = dpbusd_bcast(sum[t], wv, xu + t * k + 4 * c);
            }
            const __m512 scale = _mm512_load_ps(s1 + u * 16), mins = _mm512_load_ps(s2 + u * 16);
            for (int t = 0; t < nt; ++t) {
                const __m512 dot = _mm512_mul_ps(_mm512_cvtepi32_ps(sum[t]), _mm512_set1_ps(dx[t * (k / 32) + u]));
                acc[t] = _mm512_fnmadd_ps(mins, _mm512_set1_ps(xs32[t * (k / 32) + u]), _mm512_fmadd_ps(dot, scale, acc[t]));
            }
        } else { /* two groups of 16, each sum starting at -32 * sum(xq): (sum_a * scale_a + sum_b * scale_b) * dx */
            __m512i lo[TILE_TOKENS], hi[TILE_TOKENS];
            for (int t = 0; t < nt; ++t) {
                lo[t] = _mm512_set1_epi32(-is16[t * (k / 16) + 2 * u]);
                hi[t] = _mm512_set1_epi32(-is16[t * (k / 16) + 2 * u + 1]);
            }
            for (int c = 0; c < 4; ++c) {
                const __m512i wa = _mm512_load_si512((const void *)(wu + 64 * c));
                const __m512i wb = _mm512_load_si512((const void *)(wu + 64 * (c + 4)));
                for (int t = 0; t < nt; ++t) {
                    lo[t] = dpbusd_bcast(lo[t], wa, xu + t * k + 4 * c);
                    hi[t] = dpbusd_bcast(hi[t], wb, xu + t * k + 16 + 4 * c);
                }
            }
            const __m512 scale_lo = _mm512_load_ps(s1 + 2 * u * 16), scale_hi = _mm512_load_ps(s1 + (2 * u + 1) * 16);
            for (int t = 0; t < nt; ++t) {
                const __m512 both = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi[t]), scale_hi,
                                                    _mm512_mul_ps(_mm512_cvtepi32_ps(lo[t]), scale_lo));
                acc[t] = _mm512_fmadd_ps(both, _mm512_set1_ps(dx[t * (k / 32) + u]), acc[t]);
            }
        }
    }
}

static void tile_times_qx(int qtype, int nt, const uint8_t *wq, const float *s1, const float *s2, const qx_t *q,
                          int64_t t0, __m512 acc[TILE_TOKENS]) {
    const int64_t k = q->k;
    const int8_t *xq = q->xq + t0 * k;
    const float *dx = q->dx + t0 * (k / 32), *xs32 = q->xs32 + t0 * (k / 32);
    const int32_t *is16 = q->is16 + t0 * (k / 16);
#define CASE(n)                                                                                          \
    case n:                                                                                              \
        if (qtype == T_Q6_K) tile_times_tokens(T_Q6_K, n, wq, s1, s2, xq, dx, xs32, is16, k, 0, acc);       \
        else if (qtype == T_Q8_0) tile_times_tokens(T_Q8_0, n, wq, s1, s2, xq, dx, xs32, is16, k, 128, acc); \
        else if (qtype == T_Q4_0) tile_times_tokens(T_Q8_0, n, wq, s1, s2, xq, dx, xs32, is16, k, 8, acc);  \
        else tile_times_tokens(T_Q4_K, n, wq, s1, s2, xq, dx, xs32, is16, k, 0, acc);                      \
        break;
    switch (nt) { CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) }
#undef CASE
}

static inline int tile_type(int qtype) {
    return qtype == T_Q4_K || qtype == T_Q5_K || qtype == T_Q6_K || qtype == T_Q8_0 || qtype == T_Q4_0;
}

/* From how many tokens gguf_gemm_int8_tiles takes rows of `qtype` (ggml's id) in place of
 * the int8 rows (gguf_vnni.c) and bf16 tiles (gguf_bf16.c); 0 where it never does. Every
 * caller's rule (gguf_kernels.py reads it). From 8 tokens; Q8_0
 * rows from 16 where the build has bf16 tiles (5632 x 2048 from memory, 2 threads, bf16
 * tiles / int8 tiles, 2026-12-06 on Zen 4: 8 tokens 0.85 / 0.94 ms, 16 1.32 / 1.21, 64
 * 4.2 / 3.1; Q4_0 8 tokens 0.86 / 0.72). */
int gguf_int8_tile_min_tokens(int qtype) {
#ifdef __AVX512BF16__
    if (qtype == T_Q8_0) return 16;
#endif
    return tile_type(qtype) ? 8 : 0;
}

/* As gguf_gemm_bf16_shards (n shards sharing one input: y[t * ldy + o_i + r] = W_i[r, :]
 * . x[t, :], y_dtype as out_t's), for K-quant shards (Q4_K, Q5_K, Q6_K) and x in
 * bfloat16 (x_dtype 1) or float16 (2), quantised to int8 per 32 values.
 * Returns 0; -1 for another type or a bad dtype (nothing written); -3 when memory cannot
 * be allocated. */
int gguf_gemm_int8_tiles(int n, const int *qtypes, const uint8_t *const *w, const int64_t *rows,
                         const int64_t *row_bytes, int64_t k, const uint16_t *x, int x_dtype, int64_t ldx, int64_t m,
                         void *y, int y_dtype, int64_t ldy, int num_threads) {
    if (y_dtype < 0 || y_dtype > 2 || x_dtype < 1 || x_dtype > 2 || k % 256) return -1;
    int64_t tiles = 0;
    for (int i = 0; i < n; ++i) {
        if (!tile_type(qtypes[i])) return -1;
        tiles += (rows[i] + TILE_ROWS - 1) / TILE_ROWS;
    }
    const out_t yo = {y, y_dtype, ldy};
    qx_t q = {k, malloc((size_t)(m * k)), malloc((size_t)(m * (k / 32)) * sizeof(float)),
              malloc((size_t)(m * (k / 32)) * sizeof(float)), malloc((size_t)(m * (k / 16)) * sizeof(int32_t))};
    int failed = !q.xq || !q.dx || !q.xs32 || !q.is16;
    if (!failed) {
#pragma omp parallel num_threads(num_threads)
        {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < m; ++t) quantize_token(x + t * ldx, x_dtype, &q, t);
            uint8_t *wq = aligned_alloc(64, (size_t)(TILE_ROWS * k));
            float *s1 = aligned_alloc(64, (size_t)(k / 16 * TILE_ROWS) * sizeof(float));
            float *s2 = aligned_alloc(64, (size_t)(k / 32 * TILE_ROWS) * sizeof(float));
            if (!wq || !s1 || !s2) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(static)
            for (int64_t g = 0; g < tiles; ++g) {
                if (!wq || !s1 || !s2) continue;
                const tile_pos_t at = tile_position(rows, g, TILE_ROWS);
                const int i = at.shard, nr = at.rows;
                const int64_t offset = at.offset, r0 = at.r0;
                unpack_tile(qtypes[i], w[i] + r0 * row_bytes[i], row_bytes[i], nr, k / 256, wq, s1, s2);
                for (int64_t t0 = 0; t0 < m; t0 += TILE_TOKENS) {
                    const int nt = (int)(m - t0 < TILE_TOKENS ? m - t0 : TILE_TOKENS);
                    __m512 acc[TILE_TOKENS];
                    float out[TILE_ROWS];
                    tile_times_qx(qtypes[i], nt, wq, s1, s2, &q, t0, acc);
                    for (int t = 0; t < nt; ++t) {
                        _mm512_storeu_ps(out, acc[t]);
                        for (int r = 0; r < nr; ++r) out_store(&yo, t0 + t, offset + r0 + r, out[r]);
                    }
                }
            }
            free(wq);
            free(s1);
            free(s2);
        }
    }
    free(q.xq);
    free(q.dx);
    free(q.xs32);
    free(q.is16);
    return failed ? -3 : 0;
}
#elif !defined(GGUF_INT8_AVX2) /* gguf_avx2_tiles.c defines them there */
int gguf_int8_tile_min_tokens(int qtype) {
    (void)qtype;
    return 0;
}


int gguf_gemm_int8_tiles(int n, const int *qtypes, const uint8_t *const *w, const int64_t *rows,
                         const int64_t *row_bytes, int64_t k, const uint16_t *x, int x_dtype, int64_t ldx, int64_t m,
                         void *y, int y_dtype, int64_t ldy, int num_threads) {
    (void)n; (void)qtypes; (void)w; (void)rows; (void)row_bytes; (void)k; (void)x; (void)x_dtype; (void)ldx;
    (void)m; (void)y; (void)y_dtype; (void)ldy; (void)num_threads;
    return -2;
}

#endif
