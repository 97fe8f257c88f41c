/* What the one-call expert kernels of the quantised formats share (quantization/fp8_moe.c,
 * quantization/gguf_moe.c, quantization/kernels/wna16_moe.c, quantization/kernels/int8_moe.c):
 * a batch's (token, k) pairs sorted by local expert, the activation between an expert's two
 * products, and its outputs added into their tokens' rows. Static inline: each includer
 * compiles its own copy. */
#ifndef EXPERT_PAIRS_H
#define EXPERT_PAIRS_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The pairs p = t * top_k + j of topk_ids [pairs] sorted by local expert, stably: expert
 * e's are order[start[e] .. start[e + 1]) (start: num_local + 1 entries; order and local:
 * `pairs` each, local scratch). Pairs of another rank's expert (-1 in expert_map, which
 * may be NULL: every expert local) are left out. Returns 0, or -1 for an id outside
 * [0, num_experts) or one the map sends past num_local. */
static inline int sort_expert_pairs(const int64_t *topk_ids, int64_t pairs, const int64_t *expert_map,
                                    int64_t num_experts, int64_t num_local, int64_t *local, int64_t *start,
                                    int64_t *order) {
    memset(start, 0, sizeof(int64_t) * (size_t)(num_local + 1));
    for (int64_t p = 0; p < pairs; ++p) {
        const int64_t id = topk_ids[p];
        const int64_t e = id < 0 || id >= num_experts ? -2 : expert_map ? expert_map[id] : id;
        if (e < -1 || e >= num_local) return -1;
        local[p] = e;
        if (e >= 0) ++start[e + 1];
    }
    for (int64_t e = 0; e < num_local; ++e) start[e + 1] += start[e];
    for (int64_t p = 0; p < pairs; ++p) /* stable: pairs keep their order within an expert */
        if (local[p] >= 0) order[start[local[p]]++] = p;
    for (int64_t e = num_local; e > 0; --e) start[e] = start[e - 1]; /* back to each expert's first */
    start[0] = 0;
    return 0;
}

/* A call's scratch: the pairs sorted by expert (`start`, `order`: sort_expert_pairs'), one
 * expert's gathered rows (`x`, x_elem bytes a value) and its gate/up products, activations
 * and outputs (float32), sized for every pair of the batch. */
typedef struct {
    int64_t *local, *start, *order;
    void *x;
    float *gu, *act, *out;
} expert_scratch_t;

static inline void free_expert_scratch(expert_scratch_t *s) {
    free(s->local), free(s->x), free(s->gu), free(s->act), free(s->out);
}

/* Allocate `s` and sort the pairs into it: 0; -3 (nothing held) without memory; -1 (nothing
 * held) for an expert id sort_expert_pairs refuses. */
static inline int expert_scratch(expert_scratch_t *s, const int64_t *topk_ids, int64_t pairs,
                                 const int64_t *expert_map, int64_t num_experts, int64_t num_local, int64_t hidden,
                                 int64_t inter, size_t x_elem) {
    s->local = malloc(sizeof(int64_t) * (size_t)(2 * pairs + num_local + 1));
    s->x = malloc((size_t)pairs * (size_t)hidden * x_elem);
    s->gu = malloc(sizeof(float) * (size_t)pairs * 2 * (size_t)inter);
    s->act = malloc(sizeof(float) * (size_t)pairs * (size_t)inter);
    s->out = malloc(sizeof(float) * (size_t)pairs * (size_t)hidden);
    if (!s->local || !s->x || !s->gu || !s->act || !s->out) {
        free_expert_scratch(s);
        return -3;
    }
    s->start = s->local + pairs, s->order = s->start + num_local + 1;
    if (sort_expert_pairs(topk_ids, pairs, expert_map, num_experts, num_local, s->local, s->start, s->order)) {
        free_expert_scratch(s);
        return -1;
    }
    return 0;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* e^x for 8 floats, our own (glibc's expf is scalar: a decode step's activation, 4 ns an
 * element, took 0.2 ms a layer of 64 pairs on the Zen 3 VM): x = n ln2 + r with |r| <=
 * ln2 / 2 (ln2 in two parts, so r is exact), e^r by Cephes' degree-7 polynomial (its
 * public coefficients), times 2^n built in the exponent bits. Within 1 ulp of expf over
 * [-87.3, 88.3] (every 1000th float checked); x is clamped to that range first, so
 * beyond it e^-87.3 or e^88.3 (and NaN gives e^-87.3): a silu's g / (1 + e^-g) stays
 * within a float's resolution of the true value, and NaN where g is. */
static inline __m256 expert_exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}
#endif

/* act[i, j] = silu(gu[i, j]) * gu[i, inter + j] for n rows of gate then up products,
 * float32: g / (1 + e^-g) * u, e^-g by expert_exp8 where the build has AVX2 and FMA
 * (within a few ulp of expf's), else expf. */
static inline void silu_and_mul(const float *gu, int64_t n, int64_t inter, float *act) {
    for (int64_t i = 0; i < n; ++i) {
        const float *g = gu + i * 2 * inter, *u = g + inter;
        float *a = act + i * inter;
        int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
        const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
        for (; j + 8 <= inter; j += 8) {
            const __m256 gj = _mm256_loadu_ps(g + j);
            const __m256 e = expert_exp8(_mm256_xor_ps(gj, sign));
            _mm256_storeu_ps(a + j, _mm256_mul_ps(_mm256_div_ps(gj, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + j)));
        }
#endif
        for (; j < inter; ++j) a[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
    }
}

/* y[t] += topk_weights[p] * out[i] for the expert's n pairs order[0 .. n) (t = p / top_k),
 * out [n, hidden] and y [tokens, hidden] float32. */
static inline void add_expert_outputs(const int64_t *order, int64_t n, int64_t top_k, const float *topk_weights,
                                      const float *out, int64_t hidden, float *y) {
    for (int64_t i = 0; i < n; ++i) {
        const int64_t p = order[i];
        const float weight = topk_weights[p], *o = out + i * hidden;
        float *yt = y + (p / top_k) * hidden;
        for (int64_t h = 0; h < hidden; ++h) yt[h] += weight * o[h];
    }
}

#endif
