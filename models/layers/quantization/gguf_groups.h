/* The bookkeeping of gguf_gemm_q8_groups (gguf_vnni.c, gguf_avx2.c: each its own
 * quantisation and rows): which groups share quantised activations, and which rows each
 * thread takes. Static inline: each includer compiles its own copy. */
#ifndef GGUF_GROUPS_H
#define GGUF_GROUPS_H

#include <stdint.h>

#include "gguf_blocks.h"

/* The work of one row times m tokens, in units where a row's read counts 2 a pass over
 * MAX_TOKENS tokens: a one-token row of Q8_0 or Q4_K took 1, two tokens 1.2, four 1.9-2.3,
 * eight 3-4.2 times one token's (1536 x 1024 from memory, 2026-12-07, the Zen 4 VM). */
static inline int64_t group_row_cost(int64_t m) { return m + 2 * ((m + MAX_TOKENS - 1) / MAX_TOKENS); }

/* Numbers the quantised activations: group i reads the m[i] consecutive slots from
 * slot[i], shared by every group with the same x, m and scheme (a fused layer's shards,
 * a one-token step's experts); owner[i] is 1 where group i is the first of those (its
 * caller quantises them there). Returns the number of slots. n is small (a layer's
 * shards, a decode batch's experts): the search for an earlier match is quadratic. */
static inline int64_t group_slots(int n, const void *const *x, const int64_t *m, const int *scheme, int64_t *slot,
                                  int *owner) {
    int64_t slots = 0;
    for (int i = 0; i < n; ++i) {
        int j = 0;
        while (j < i && !(x[j] == x[i] && m[j] == m[i] && scheme[j] == scheme[i])) ++j;
        owner[i] = j == i;
        slot[i] = j == i ? slots : slot[j];
        if (j == i) slots += m[i];
    }
    return slots;
}

/* Rows [*r0, *r1) of a group of `rows` rows, whose work starts at `start` and costs `cost`
 * a row, that the thread taking work [w0, w1) does: the rows whose work starts there (a
 * contiguous run of the groups' rows, as a static schedule would split them by work).
 * A group of no tokens (cost 0) has no rows to do. */
static inline void group_rows(int64_t w0, int64_t w1, int64_t start, int64_t cost, int64_t rows, int64_t *r0,
                              int64_t *r1) {
    if (cost <= 0) {
        *r0 = *r1 = 0;
        return;
    }
    const int64_t a = w0 > start ? (w0 - start + cost - 1) / cost : 0;
    const int64_t b = w1 > start ? (w1 - start + cost - 1) / cost : 0;
    *r0 = a < rows ? a : rows;
    *r1 = b < rows ? b : rows;
}

#endif
