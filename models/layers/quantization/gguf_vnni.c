/* GGUF block products with int8 activations (gguf_gemm_q8_groups, and on every build
 * gguf_gemm_q8_shards, its one-input form, whichever of this file and gguf_avx2.c
 * computes the groups): the blocks' integers multiplied by int8-quantised activations
 * with AVX-512 VNNI. Its contract is in gguf_kernels.py, which compiles it with
 * gguf_kernels.c (the block layouts); gguf_moe.c calls the groups. */

#include <stdlib.h>

#include "gguf_blocks.h"

/* ---- int8 activations (llama.cpp's way): x quantised to int8 with a float scale dx
 * (amax / 127, rounded to nearest), the weights' integers multiplied by them with AVX-512
 * VNNI (vpdpbusd: 64 u8 x s8 products per instruction).
 *
 * Q4_0 and Q8_0: x quantised per 32 values, scales applied per 16 values in float.
 * The K-quants (Q4_K, Q5_K, Q6_K): x quantised per 256 values (llama.cpp's Q8_K), so a
 * super-block's group sums are scaled by its integer group scales in integer
 * arithmetic (vpdpwssd) and converted to float once: a Q4_K super-block takes about 17
 * cycles on one core where float scales per 16 values took 31 (2026-12-05, the Zen 5
 * VM). Q4_K and Q5_K rows are read in their own order: a 64-byte load of nibbles holds,
 * in its low nibbles, values [0, 32) and [64, 96) of its 128 (and the high nibbles the
 * two 32s between), so x is quantised into that order once per call (ORDER_K4) and each
 * load feeds two dot products without shuffles. The other types read x in natural
 * order.
 *
 * Error against float activations: at most sum_i |w_i| * dx_i / 2 per output (the
 * activations' rounding, dx that of the value's 32 or 256), plus float rounding. */
#ifdef GGUF_INT8_VNNI
#include <omp.h>

#include "gguf_groups.h"
#include "gguf_quantize_x.h"

#define PREFETCH_BYTES 12288

static inline int fp16_bits(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return h;
}

static inline __m256i load256(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline __m512i join256(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}
/* 16-bit lanes shifted right by a in the low 256 bits, by b in the high ones */
static inline __m512i srl_halves(__m512i v, int a, int b) {
    return _mm512_srlv_epi16(v, join256(_mm256_set1_epi16((short)a), _mm256_set1_epi16((short)b)));
}

/* One super-chunk s (values [256s, 256s + 256)) of a Q4_0 or Q8_0 row: its 256
 * unsigned weight integers as four 64-value vectors (natural order), each vector's
 * per-lane weight scale, and per 16 values the offset that multiplies the x sum. Values
 * at or past k are zero. */
static inline __attribute__((always_inline)) void unpack_256(int qtype, const uint8_t *row, int64_t s, int64_t k,
                                                             __m512i w[4], __m512 ws[4], __m512 *gmin) {
    /* lanes of 4 values: 64c + 4l, whose 16-value group is 4c + l / 4 */
    const __m512i by16 = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const int bb = qtype == T_Q4_0 ? 18 : 34;
    __m256i half[8];
    const int nb = 256 * s + 256 <= k ? 8 : (int)((k - 256 * s) / 32); /* blocks in this 256 */
    const uint8_t *b0 = row + 8 * s * bb;
    /* the eight fp16 d, put together in a register (eight scalar stores read back as
     * one vector miss store forwarding: that stall was half a Q8_0 block's time) */
    __m128i dh = _mm_setzero_si128();
#define D16(i) if ((i) < nb) dh = _mm_insert_epi16(dh, fp16_bits(b0 + (i) * bb), (i))
    D16(0); D16(1); D16(2); D16(3); D16(4); D16(5); D16(6); D16(7);
#undef D16
    for (int i = 0; i < 8; ++i) {
        half[i] = _mm256_setzero_si256();
        if (i >= nb) continue;
        const uint8_t *b = b0 + i * bb;
        if (qtype == T_Q4_0) {
            const __m128i qs = _mm_loadu_si128((const __m128i *)(b + 2)), m = _mm_set1_epi8(15);
            half[i] = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), m), _mm_and_si128(qs, m));
        } else { /* int8 + 128, as unsigned */
            half[i] = _mm256_xor_si256(load256(b + 2), _mm256_set1_epi8((char)0x80));
        }
    }
    /* each 32-block's d for the 8 lanes of its values (exact: fp16 -> float) */
    const __m512 dv = _mm512_castps256_ps512(_mm256_cvtph_ps(dh));
    for (int c = 0; c < 4; ++c) {
        w[c] = join256(half[2 * c], half[2 * c + 1]);
        ws[c] = _mm512_permutexvar_ps(
            _mm512_add_epi32(_mm512_srli_epi32(by16, 1), _mm512_set1_epi32(2 * c)), dv);
    }
    /* per 16 values: 8 d or 128 d, each 32-block's for its two 16s */
    *gmin = _mm512_mul_ps(_mm512_set1_ps(qtype == T_Q4_0 ? 8.f : 128.f),
                          _mm512_permutexvar_ps(_mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0), dv));
}

/* One K-quant row (Q4_K, Q5_K, Q6_K) times nt tokens of per-256 int8 x (ORDER_K4 or
 * ORDER_NATURAL256), into column col of y's rows t0 .. t0 + nt - 1. Per super-block:
 * each group's integer dot products (vpdpbusd, 4 values a lane, at most 4 * 63 * 127 in
 * magnitude: they fit 16 bits), packed to 16 bits and multiplied by the group scales
 * with the pairs summed (vpdpwssd), then once in
 * float by d * dx; minus the offsets' term, per group offset * (dx * sum of x in it):
 * Q4_K/Q5_K's dmin * min_j per 32 values, Q6_K's 32 * d * scale_j per 16.
 * vpackssdw(a, b) interleaves per 128-bit lane L: four 32-bit lanes of a, then four of
 * b; so the scale vector of a pair holds, per L, four of a's group's scale then four of
 * b's. Q4_K/Q5_K vectors 0-3 hold 32-groups (0, 2), (1, 3), (4, 6), (5, 7) (ORDER_K4);
 * Q6_K's hold values in order, so lane L of a pair holds 16-groups L and 4 + L (then
 * 8 + L and 12 + L). Inlined per constant qtype and nt (rows_times_qx). */
static inline __attribute__((always_inline)) void row_k_n(int qtype, const uint8_t *row, int64_t k,
                                                          const qx_t *qx, const int nt, const out_t *y, int64_t t0,
                                                          int64_t col) {
    const __m512i m4 = _mm512_set1_epi8(15), m2 = _mm512_set1_epi8(3), m1 = _mm512_set1_epi8(1);
    const __m512i zero = _mm512_setzero_si512();
    const __m256i k4_idx = _mm256_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1,
                                            2, 2, 2, 2, 3, 3, 3, 3, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m256i q6_idx = _mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 1, 1, 1, 1, 5, 5, 5, 5,
                                            2, 2, 2, 2, 6, 6, 6, 6, 3, 3, 3, 3, 7, 7, 7, 7);
    const int bb = block_bytes(qtype), q6 = qtype == T_Q6_K;
    __m512 acc[MAX_TOKENS], corr[MAX_TOKENS];
    for (int t = 0; t < nt; ++t) acc[t] = corr[t] = _mm512_setzero_ps();
    for (int64_t s = 0; s < k / 256; ++s) {
        const uint8_t *b = row + s * bb;
        /* into L2, 12 KiB ahead (this row's later blocks, then the next rows'): the core's
         * own misses alone kept fewer lines in flight than the memory could serve (a
         * 5632x2048 Q4_K product streamed about 23 GB/s without, 27-31 with; 12 KiB ran
         * a Q4_K_M decode about 2% faster than 4, within this VM's noise) */
        for (int off = 0; off < bb; off += 64) _mm_prefetch((const char *)b + PREFETCH_BYTES + off, _MM_HINT_T1);
        __m512i w[4], s01, s23;
        __m512 offsets; /* per group: 8 lanes (32-groups) or 16 (16-groups) */
        float d;
        if (q6) { /* per 128 values, ql's 64 bytes: [0, 64) low nibbles, [64, 128) high; qh's 32: their top bits */
            /* the 16 scales in both 128-bit lanes, so that vpshufb (AVX2; vpermb would need
             * AVX-512 VBMI, which Cascade Lake lacks) picks from all of them in either lane */
            const __m256i sc = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(b + 192)));
            s01 = _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(sc, q6_idx));
            s23 = _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(sc, _mm256_add_epi8(q6_idx, _mm256_set1_epi8(8))));
            d = load_fp16(b + 208);
            offsets = _mm512_mul_ps(_mm512_set1_ps(32.f * d), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                                  _mm256_castsi256_si128(sc))));
            for (int n = 0; n < 2; ++n) {
                const __m512i q = _mm512_loadu_si512(b + 64 * n), h = _mm512_broadcast_i64x4(load256(b + 128 + 32 * n));
                w[2 * n] = _mm512_or_si512(_mm512_and_si512(q, m4),
                                           _mm512_slli_epi16(_mm512_and_si512(srl_halves(h, 0, 2), m2), 4));
                w[2 * n + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(q, 4), m4),
                                               _mm512_slli_epi16(_mm512_and_si512(srl_halves(h, 4, 6), m2), 4));
            }
        } else { /* the eight 6-bit (scale, min) pairs (scale_min_k4's rule), four to a 32-bit word */
            uint32_t u0, u1, u2; /* loads from the block, not a copy through the stack */
            memcpy(&u0, b + 4, 4);
            memcpy(&u1, b + 8, 4);
            memcpy(&u2, b + 12, 4);
            const uint32_t six = 0x3f3f3f3fu, lo4 = 0x0f0f0f0fu, two = 0x03030303u;
            const uint64_t sc = (uint64_t)(u0 & six) | (uint64_t)((u2 & lo4) | (((u0 >> 6) & two) << 4)) << 32;
            const uint64_t mn = (uint64_t)(u1 & six) | (uint64_t)(((u2 >> 4) & lo4) | (((u1 >> 6) & two) << 4)) << 32;
            const __m256i scb = _mm256_broadcastsi128_si256(_mm_cvtsi64_si128((long long)sc)); /* as Q6_K's */
            s01 = _mm512_cvtepu8_epi16(_mm256_shuffle_epi8(scb, k4_idx));
            s23 = _mm512_cvtepu8_epi16(_mm256_shuffle_epi8(scb, _mm256_add_epi8(k4_idx, _mm256_set1_epi8(4))));
            d = load_fp16(b);
            offsets = _mm512_mul_ps(_mm512_set1_ps(load_fp16(b + 2)),
                                    _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn))));
            const __m512i qh = qtype == T_Q5_K ? _mm512_broadcast_i64x4(load256(b + 16)) : zero;
            const uint8_t *qs = b + (qtype == T_Q4_K ? 16 : 48);
            for (int n = 0; n < 2; ++n) {
                const __m512i q = _mm512_loadu_si512(qs + 64 * n);
                w[2 * n] = _mm512_and_si512(q, m4);
                w[2 * n + 1] = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
                if (qtype == T_Q5_K) { /* the fifth bit of the value in 64-run j, low/high nibble: bit 2j / 2j + 1 */
                    w[2 * n] = _mm512_or_si512(
                        w[2 * n], _mm512_slli_epi16(_mm512_and_si512(srl_halves(qh, 4 * n, 4 * n + 2), m1), 4));
                    w[2 * n + 1] = _mm512_or_si512(
                        w[2 * n + 1], _mm512_slli_epi16(_mm512_and_si512(srl_halves(qh, 4 * n + 1, 4 * n + 3), m1), 4));
                }
            }
        }
        for (int t = 0; t < nt; ++t) {
            const int8_t *x = qx[t].xq + 256 * s;
            __m512i dp[4];
            for (int v = 0; v < 4; ++v) dp[v] = _mm512_dpbusd_epi32(zero, w[v], _mm512_loadu_si512(x + 64 * v));
            const __m512i sum = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(zero, _mm512_packs_epi32(dp[0], dp[1]), s01),
                                                    _mm512_packs_epi32(dp[2], dp[3]), s23);
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(d * qx[t].dxs[s]), acc[t]);
            corr[t] = _mm512_fmadd_ps(offsets, q6 ? _mm512_loadu_ps(qx[t].xs16 + 16 * s)
                                                  : _mm512_maskz_loadu_ps(0xff, qx[t].xs32 + 8 * s), corr[t]);
        }
    }
    for (int t = 0; t < nt; ++t) out_store(y, t0 + t, col, _mm512_reduce_add_ps(_mm512_sub_ps(acc[t], corr[t])));
}

/* One row times nt tokens, into column col of y's rows t0 .. t0 + nt - 1. Inlined into
 * one copy per constant nt (rows_times_qx), so the running sums stay in registers
 * instead of a stack array indexed at run time (whose store-to-load forwarding, on every
 * fused multiply-add, set the pace before). */
static inline __attribute__((always_inline)) void row_times_qx_n(int qtype, const uint8_t *row, int64_t k,
                                                                 const qx_t *qx, const int nt, const out_t *y,
                                                                 int64_t t0, int64_t col) {
    /* one running sum per 64-value chunk c: four independent chains of fused
     * multiply-adds, where one chain (four per super-chunk) set the pace */
    __m512 acc[4][MAX_TOKENS], corr[MAX_TOKENS];
    for (int t = 0; t < nt; ++t) {
        corr[t] = _mm512_setzero_ps();
        for (int c = 0; c < 4; ++c) acc[c][t] = _mm512_setzero_ps();
    }
    for (int64_t s = 0; s < (k + 255) / 256; ++s) {
        __m512i w[4];
        __m512 ws[4], gm;
        unpack_256(qtype, row, s, k, w, ws, &gm);
        for (int c = 0; c < 4; ++c) {
            const int64_t v = 256 * s + 64 * c;
            for (int t = 0; t < nt; ++t) {
                const __m512i dp = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[c], _mm512_loadu_si512(qx[t].xq + v));
                acc[c][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dp),
                                            _mm512_mul_ps(ws[c], _mm512_loadu_ps(qx[t].dxl + v / 4)), acc[c][t]);
            }
        }
        for (int t = 0; t < nt; ++t) corr[t] = _mm512_fmadd_ps(gm, _mm512_loadu_ps(qx[t].xs16 + 16 * s), corr[t]);
    }
    for (int t = 0; t < nt; ++t) {
        const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[0][t], acc[1][t]), _mm512_add_ps(acc[2][t], acc[3][t]));
        out_store(y, t0 + t, col, _mm512_reduce_add_ps(_mm512_sub_ps(sum, corr[t])));
    }
}

/* One row times nt tokens (any nt up to MAX_TOKENS): each super-chunk unpacked once
 * into registers, then the tokens one after another, each token's running sums loaded
 * and stored once per super-chunk. Unrolling every token instead (row_times_qx_n) runs
 * out of registers past two tokens and spills in the inner loop. */
static void row_times_qx_many(int qtype, const uint8_t *row, int64_t k, const qx_t *qx, int nt, const out_t *y,
                              int64_t t0, int64_t col) {
    __m512 acc[MAX_TOKENS], corr[MAX_TOKENS];
    for (int t = 0; t < nt; ++t) acc[t] = corr[t] = _mm512_setzero_ps();
    for (int64_t s = 0; s < (k + 255) / 256; ++s) {
        __m512i w[4];
        __m512 ws[4], gm;
        unpack_256(qtype, row, s, k, w, ws, &gm);
        for (int t = 0; t < nt; ++t) {
            const int8_t *xq = qx[t].xq + 256 * s;
            const float *dxl = qx[t].dxl + 64 * s;
            __m512 a = acc[t];
            for (int c = 0; c < 4; ++c) {
                const __m512i dp = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[c], _mm512_loadu_si512(xq + 64 * c));
                a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dp), _mm512_mul_ps(ws[c], _mm512_loadu_ps(dxl + 16 * c)), a);
            }
            acc[t] = a;
            corr[t] = _mm512_fmadd_ps(gm, _mm512_loadu_ps(qx[t].xs16 + 16 * s), corr[t]);
        }
    }
    for (int t = 0; t < nt; ++t) out_store(y, t0 + t, col, _mm512_reduce_add_ps(_mm512_sub_ps(acc[t], corr[t])));
}

/* Rows [r0, r1) of one shard (row r at w + r * row_bytes, its outputs column c0 + r of
 * y's rows t0 .. t0 + nt - 1) times nt tokens: type and token count chosen once per
 * call, so each row runs a loop compiled for them (constant block layout and prefetches,
 * no type tests, the sums in registers; a Q4_K super-block 6.4 -> 5.7 ns on one core,
 * Q6_K 9.2 -> 7.7, 2026-12-05). */
#define ROWS(call) for (int64_t r = r0; r < r1; ++r) call; break;
#define K_CASE(qt, n) case n: ROWS(row_k_n(qt, w + r * row_bytes, k, qx, n, y, t0, c0 + r))
#define K_TYPE(qt) \
    case qt: switch (nt) { K_CASE(qt, 1) K_CASE(qt, 2) K_CASE(qt, 3) K_CASE(qt, 4) K_CASE(qt, 5) K_CASE(qt, 6) \
                           K_CASE(qt, 7) K_CASE(qt, 8) } break;

static void rows_times_qx(int qtype, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, int64_t k,
                          const qx_t *qx, int nt, const out_t *y, int64_t t0, int64_t c0) {
    if (x_order(qtype) != ORDER_NATURAL) {
        switch (qtype) { K_TYPE(T_Q4_K) K_TYPE(T_Q5_K) K_TYPE(T_Q6_K) }
        return;
    }
    switch (nt) {
    case 1: ROWS(row_times_qx_n(qtype, w + r * row_bytes, k, qx, 1, y, t0, c0 + r))
    case 2: ROWS(row_times_qx_n(qtype, w + r * row_bytes, k, qx, 2, y, t0, c0 + r))
    default: ROWS(row_times_qx_many(qtype, w + r * row_bytes, k, qx, nt, y, t0, c0 + r))
    }
}
#undef K_TYPE
#undef K_CASE
#undef ROWS

/* The products of n weights, each times its own tokens: weight i (`rows[i]` rows of
 * `qtypes[i]` blocks at w[i], row r at w[i] + r * row_bytes[i]) times the m[i] tokens
 * at x[i] (x_dtype as x_row's, row stride ldx), into y[i] (y_dtype: out_t's; row stride
 * ldy): y[i][t * ldy + r] = W_i[r, :] . x_i[t, :]. Each input is quantised to int8 once
 * per order its groups read (groups with the same x and m share it: gguf_groups.h), and
 * one parallel loop runs over every group's rows, each thread a contiguous run of them
 * weighted by their tokens. Callers: gguf_gemm_q8_shards (one input), gguf_moe.c (an
 * expert a group). Returns 0; -1 for an unknown type or dtype (nothing written); -2 when
 * this build has no VNNI; -3 when scratch cannot be allocated. */
int gguf_gemm_q8_groups(int n, const int *qtypes, const uint8_t *const *w, const int64_t *rows,
                        const int64_t *row_bytes, int64_t k, const void *const *x, const int64_t *m, int x_dtype,
                        int64_t ldx, void *const *y, int y_dtype, int64_t ldy, int num_threads) {
    for (int i = 0; i < n; ++i)
        if (block_bytes(qtypes[i]) == 0) return -1;
    if (x_dtype < 0 || x_dtype > 2 || y_dtype < 0 || y_dtype > 2) return -1;
    if (n <= 0) return 0;
    const int64_t kpad = (k + 255) / 256 * 256;
    const size_t per_token = (size_t)kpad + ((size_t)kpad / 4 + (size_t)kpad / 16) * sizeof(float);
    int64_t *slot = malloc(2 * sizeof(int64_t) * (size_t)n + 2 * sizeof(int) * (size_t)n);
    if (!slot) return -3;
    int64_t *work = slot + n; /* where each group's work starts */
    int *order = (int *)(work + n), *owner = order + n;
    int64_t total = 0, rows_total = 0;
    for (int i = 0; i < n; ++i) {
        order[i] = x_order(qtypes[i]);
        work[i] = total;
        total += rows[i] * group_row_cost(m[i]);
        rows_total += rows[i];
    }
    const int64_t slots = group_slots(n, x, m, order, slot, owner);
    uint8_t *scratch = malloc(per_token * (size_t)slots + (size_t)k * sizeof(float));
    qx_t *qx = malloc(sizeof(qx_t) * (size_t)(slots ? slots : 1));
    if (!scratch || !qx) {
        free(scratch);
        free(qx);
        free(slot);
        return -3;
    }
    float *xbuf = (float *)(scratch + per_token * (size_t)slots);
    for (int i = 0; i < n; ++i) {
        if (!owner[i]) continue;
        for (int64_t t = 0; t < m[i]; ++t) {
            uint8_t *base = scratch + (size_t)(slot[i] + t) * per_token;
            float *f = (float *)(base + kpad);
            qx[slot[i] + t] = (qx_t){(int8_t *)base, f, f + kpad / 4, f, f + kpad / 256};
            quantize_x(x_row(x[i], x_dtype, ldx, t, k, xbuf), k, kpad, order[i], &qx[slot[i] + t]);
        }
    }
#pragma omp parallel num_threads(num_threads) if (rows_total * k >= (1 << 15))
    {
        const int64_t nth = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t w0 = total * id / nth, w1 = total * (id + 1) / nth;
        for (int i = 0; i < n; ++i) {
            int64_t r0, r1;
            group_rows(w0, w1, work[i], group_row_cost(m[i]), rows[i], &r0, &r1);
            const out_t out = {y[i], y_dtype, ldy};
            for (int64_t t0 = 0; t0 < m[i] && r0 < r1; t0 += MAX_TOKENS)
                rows_times_qx(qtypes[i], w[i], row_bytes[i], r0, r1, k, qx + slot[i] + t0,
                              (int)(m[i] - t0 < MAX_TOKENS ? m[i] - t0 : MAX_TOKENS), &out, t0, 0);
        }
    }
    free(scratch);
    free(qx);
    free(slot);
    return 0;
}
#endif

#if defined(GGUF_INT8_AVX2)
int gguf_gemm_q8_groups(int n, const int *qtypes, const uint8_t *const *w, const int64_t *rows,
                        const int64_t *row_bytes, int64_t k, const void *const *x, const int64_t *m, int x_dtype,
                        int64_t ldx, void *const *y, int y_dtype, int64_t ldy, int num_threads); /* gguf_avx2.c */
#elif !defined(GGUF_INT8_VNNI)
int gguf_gemm_q8_groups(int n, const int *qtypes, const uint8_t *const *w, const int64_t *rows,
                        const int64_t *row_bytes, int64_t k, const void *const *x, const int64_t *m, int x_dtype,
                        int64_t ldx, void *const *y, int y_dtype, int64_t ldy, int num_threads) {
    (void)n; (void)qtypes; (void)w; (void)rows; (void)row_bytes; (void)k; (void)x; (void)m; (void)x_dtype;
    (void)ldx; (void)y; (void)y_dtype; (void)ldy; (void)num_threads;
    return -2;
}
#endif

/* The product of n weights sharing one input (a fused layer's shards: q, k, v; gate,
 * up), each `rows[i]` rows of `qtypes[i]` blocks at w[i] (row r at w[i] + r *
 * row_bytes[i]), with tokens t < m of x (x_dtype as x_row's, row stride ldx):
 * y[t * ldy + o_i + r] = W_i[r, :] . x[t, :] (y_dtype: out_t's), o_i the rows of the
 * shards before i: gguf_gemm_q8_groups with one input, x quantised once per order its
 * shards read. Returns as that does. */
int gguf_gemm_q8_shards(int n, const int *qtypes, const uint8_t *const *w, const int64_t *rows,
                        const int64_t *row_bytes, int64_t k, const void *x, int x_dtype, int64_t ldx, int64_t m,
                        void *y, int y_dtype, int64_t ldy, int num_threads) {
    if (n <= 0) return 0;
    const void *xs[n]; /* a layer's few shards: on the stack, no allocation a decode call */
    void *ys[n];
    int64_t ms[n], o = 0;
    for (int i = 0; i < n; o += rows[i++]) {
        xs[i] = x;
        ms[i] = m;
        ys[i] = (uint8_t *)y + (size_t)o * (y_dtype == 0 ? sizeof(float) : sizeof(uint16_t));
    }
    return gguf_gemm_q8_groups(n, qtypes, w, rows, row_bytes, k, xs, ms, x_dtype, ldx, ys, y_dtype, ldy, num_threads);
}
