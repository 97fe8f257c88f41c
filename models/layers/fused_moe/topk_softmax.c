/* The router's top-k in one C call on the CPU: router.py's `fused_topk` (vLLM's
 * topk_softmax) for a batch of router logits, in place of four torch ops (softmax, topk,
 * sum, divide) whose dispatch cost a decode step more than their arithmetic: 50-60 us a
 * layer at one token, against 3-4 for this call (2026-12-06, the Zen 3 VM).
 *
 * Per token: the logits (float32, bfloat16 or float16; widened exactly) minus their
 * maximum, expf of each, their sum in expert order, each times 1 / sum: the softmax over
 * every expert in float32, as torch.softmax(..., dtype=float32) computes it up to its
 * exp's last-place rounding. The k largest probabilities in descending order, NaN above
 * every number (as torch.topk ranks it) and ties to the lower expert id (torch.topk breaks
 * them in no stated order); with `renormalize`, each divided by their sum (in the order
 * kept). Rows are independent: the result does not depend on the thread count.
 *
 * Returns 0; -1 (nothing written) for top_k outside [1, experts], more than MAX_EXPERTS
 * experts or an unknown dtype. */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "../../../distributed/bf16_convert.h"
#include "../../../distributed/fp16_convert.h"

#define MAX_EXPERTS 1024 /* a row's probabilities live on the stack */

static inline float logit(const void *row, int dtype, int64_t e) {
    switch (dtype) {
    case 1: return bf16_to_float(((const uint16_t *)row)[e]);
    case 2: return fp16_to_float(((const uint16_t *)row)[e]);
    default: return ((const float *)row)[e];
    }
}

/* Whether probability a ranks above b for torch.topk: NaN above every number. */
static inline int above(float a, float b) { return isnan(a) ? !isnan(b) : a > b; }

/* logits [tokens, experts] (row stride `stride` elements, dtype 0 float32, 1 bfloat16, 2
 * float16) -> weights float32 and ids int64 [tokens, top_k], contiguous. */
int topk_softmax(const void *logits, int dtype, int64_t stride, int64_t tokens, int64_t experts, int64_t top_k,
                 int renormalize, float *weights, int64_t *ids, int num_threads) {
    if (top_k < 1 || top_k > experts || experts > MAX_EXPERTS || dtype < 0 || dtype > 2) return -1;
    const size_t elem = dtype == 0 ? sizeof(float) : sizeof(uint16_t);
#pragma omp parallel for num_threads(num_threads) schedule(static) if (tokens * experts >= (1 << 12))
    for (int64_t t = 0; t < tokens; ++t) {
        const void *row = (const uint8_t *)logits + (size_t)(t * stride) * elem;
        float p[MAX_EXPERTS];
        float max = logit(row, dtype, 0);
        for (int64_t e = 1; e < experts; ++e) {
            const float v = logit(row, dtype, e);
            max = v > max || isnan(v) ? v : max;
        }
        float sum = 0.f;
        for (int64_t e = 0; e < experts; ++e) sum += p[e] = expf(logit(row, dtype, e) - max);
        const float inv = 1.f / sum;
        for (int64_t e = 0; e < experts; ++e) p[e] *= inv;
        float *w = weights + t * top_k;
        int64_t *id = ids + t * top_k;
        int64_t kept = 0; /* the top so far, in rank order: one pass, each expert inserted after its equals */
        for (int64_t e = 0; e < experts; ++e) {
            if (kept == top_k && !above(p[e], w[top_k - 1])) continue;
            int64_t j = kept < top_k ? kept++ : top_k - 1;
            for (; j > 0 && above(p[e], w[j - 1]); --j) w[j] = w[j - 1], id[j] = id[j - 1];
            w[j] = p[e], id[j] = e;
        }
        if (renormalize) {
            float total = 0.f;
            for (int64_t j = 0; j < top_k; ++j) total += w[j];
            for (int64_t j = 0; j < top_k; ++j) w[j] /= total;
        }
    }
    return 0;
}
