/* One round of ShmAllReduce (shm_allreduce.py) in one call: publish this rank's chunk,
 * wait for every peer's, sum the slots in rank order into the chunk (or, for an
 * all-gather, copy them out in rank order).
 *
 * The Python round costs about 20 us of dispatch for a decode-sized chunk, and a decode
 * step makes two per layer; here it is a few. The protocol, the slots and the result
 * are the Python path's: sums run in float32 in rank order 0..W-1 and a bfloat16
 * result is rounded once, to nearest even (torch's rounding, NaN as 0x7FC0), so every
 * rank gets the same bits whichever path runs. The wait spins at most `max_spins`
 * times and then returns 1, leaving the back-off (yield, sleep, the peers' liveness)
 * to the caller, which calls again with published = 1.
 *
 * shm_allreduce_norm_round is the same round followed, in the same call, by an RMSNorm of
 * the summed rows: the caller passes the norm kernel's entry (models/layers/cpu_ops.c's
 * cpu_rms_norm, whose signature is norm_fn's), so the norm's arithmetic lives in one
 * file and a decode step saves a call per all-reduce.
 *
 * Built with -O3 -march=native -ffp-contract=off: no fused multiply-adds, no fast-math.
 */
#include <stdint.h>
#include <string.h>

#include "../bf16_convert.h"

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1 };

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void sum_f32(float *out, char *const *slots, int world, int64_t n) {
    const float *s0 = (const float *)slots[0];
    const float *s1 = (const float *)slots[1];
    for (int64_t i = 0; i < n; i++) out[i] = s0[i] + s1[i];
    for (int r = 2; r < world; r++) {
        const float *s = (const float *)slots[r];
        for (int64_t i = 0; i < n; i++) out[i] += s[i];
    }
}

static void sum_bf16(uint16_t *out, char *const *slots, int world, int64_t n) {
    enum { BLOCK = 1024 };
    float acc[BLOCK];
    for (int64_t start = 0; start < n; start += BLOCK) {
        int64_t len = n - start < BLOCK ? n - start : BLOCK;
        const uint16_t *s0 = (const uint16_t *)slots[0] + start;
        for (int64_t i = 0; i < len; i++) acc[i] = bf16_to_float(s0[i]);
        for (int r = 1; r < world; r++) {
            const uint16_t *s = (const uint16_t *)slots[r] + start;
            for (int64_t i = 0; i < len; i++) acc[i] += bf16_to_float(s[i]);
        }
        for (int64_t i = 0; i < len; i++) out[start + i] = float_to_bf16(acc[i]);
    }
}

/* What stays the same for every round of one communicator. */
typedef struct {
    char *const *slots[2]; /* per round parity: the W slots */
    int64_t *arrive;       /* the W arrival counters, `stride` int64 apart */
    int64_t stride;
    int32_t world;
    int32_t rank;
} shm_group;

/* cpu_rms_norm's signature: rows x [rows, n] (+= res) normed into out, all row-contiguous. */
typedef int (*norm_fn)(int dtype, void *x, int64_t x_stride, const void *res, int64_t res_stride, const void *w,
                       void *out, int64_t out_stride, int64_t rows, int64_t n, float eps, int num_threads);

/* Publish this rank's `nbytes` of x in its slot of round `seq` (unless `published`) and
 * wait for every peer's. Returns 0 once all have arrived, 1 when a peer had not within
 * max_spins. */
static int publish_and_wait(const shm_group *g, const char *x, int64_t nbytes, int64_t seq, int published,
                            int64_t max_spins) {
    if (!published) {
        memcpy(g->slots[seq & 1][g->rank], x, (size_t)nbytes);
        __atomic_store_n(&g->arrive[g->rank * g->stride], seq, __ATOMIC_RELEASE);
    }
    int64_t spins = 0;
    for (int peer = 0; peer < g->world; peer++) {
        if (peer == g->rank) continue;
        while (__atomic_load_n(&g->arrive[peer * g->stride], __ATOMIC_ACQUIRE) < seq) {
            if (++spins > max_spins) return 1;
            cpu_relax();
        }
    }
    return 0;
}

/* x: this rank's chunk (nbytes, numel elements of dtype), summed over the ranks in place
 * in round `seq`. Returns 0 once done, 1 when a peer had not arrived within max_spins
 * (nothing summed yet), 2 for a dtype it does not take (nothing touched). */
int shm_allreduce_round(const shm_group *g, char *x, int64_t nbytes, int64_t numel, int dtype, int64_t seq,
                        int published, int64_t max_spins) {
    if (dtype != DTYPE_F32 && dtype != DTYPE_BF16) return 2;
    if (publish_and_wait(g, x, nbytes, seq, published, max_spins)) return 1;
    if (g->world < 2) return 0;
    char *const *slots = g->slots[seq & 1];
    if (dtype == DTYPE_F32)
        sum_f32((float *)x, slots, g->world, numel);
    else
        sum_bf16((uint16_t *)x, slots, g->world, numel);
    return 0;
}

/* One round of an all-gather: x is `outer` rows of `row_bytes` (any dtype), and out gets
 * every rank's rows interleaved, [outer][world][row_bytes]: the concatenation along the
 * dimension the rows start at. Returns 0 once done, 1 when a peer had not arrived within
 * max_spins (nothing copied out yet). */
int shm_allgather_round(const shm_group *g, const char *x, int64_t outer, int64_t row_bytes, int64_t seq,
                        int published, int64_t max_spins, char *out) {
    if (publish_and_wait(g, x, outer * row_bytes, seq, published, max_spins)) return 1;
    char *const *slots = g->slots[seq & 1];
    for (int64_t r = 0; r < outer; r++)
        for (int j = 0; j < g->world; j++)
            memcpy(out + (r * g->world + j) * row_bytes, slots[j] + r * row_bytes, (size_t)row_bytes);
    return 0;
}

/* One round over x [rows, n] (row-contiguous; rows * n elements fit a slot), then
 * norm(x, res, w, out, eps) on the sum (res may be NULL; res and out [rows, n],
 * row-contiguous). Returns the round's codes (1: call again with published = 1; nothing
 * summed or normed yet), or 3 when the norm failed (its scratch row). */
int shm_allreduce_norm_round(const shm_group *g, char *x, int64_t rows, int64_t n, int dtype, int64_t seq,
                             int published, int64_t max_spins, norm_fn norm, const void *res, const void *w,
                             void *out, float eps, int num_threads) {
    const int64_t esize = dtype == DTYPE_BF16 ? 2 : 4;
    const int status = shm_allreduce_round(g, x, rows * n * esize, rows * n, dtype, seq, published, max_spins);
    if (status) return status;
    return norm(dtype, x, n, res, n, w, out, n, rows, n, eps, num_threads) ? 3 : 0;
}
