/* A step's tokens from its logits for the common requests, plain greedy or plain random (no top-k,
 * top-p, min-p, penalties or bias; sampler.py decides which rows qualify), one pass or two over a
 * row instead of torch's chain of whole-tensor ops: at 32 rows of a 49,152-token vocabulary that
 * chain (divide, softmax, a float64 copy, cumsum, searchsorted) took ~12.5 ms a step and torch's
 * argmax ~2 ms, while the compute threads waited.
 *
 * Greedy (temperature 0): the first index of the row's largest logit, as torch's argmax.
 * Random (temperature T > 0): token i has weight w_i = e^(x_i / T - max_j x_j / T) (x_i / T an
 * IEEE division, as logits / T; -inf logits weigh exactly 0); the token is the first whose
 * cumulative weight exceeds u * total, the sums in float64 (sampler.draw's rule on unnormalized
 * weights: the same distribution as softmax's probabilities). The cumulative sum goes a VLEN-wide
 * block at a time, a block's weights summed in float32, so the scan finds its block from the block
 * sums and then its token within the block.
 * A row with a NaN, or without a finite positive total, gets -1: the caller takes it the torch
 * way (sampler.draw's rules for such rows). */
#include "vec.h"

/* max of the row, or NaN if it holds one */
static float row_max(const void *x, long n, int bf16) {
    vec acc = vset(-INFINITY);
    int nan = 0;
    long i = 0;
    for (; i + VLEN <= n; i += VLEN) {
        const vec v = load_row(x, i, bf16);
        nan |= vany_nan(v);
        acc = vmax(acc, v);
    }
    float lanes[VLEN], m = -INFINITY;
    vstore(lanes, acc);
    for (long j = 0; j < VLEN; j++) m = lanes[j] > m ? lanes[j] : m;
    for (; i < n; i++) {
        const float v = load_one(x, i, bf16);
        nan |= isnan(v);
        m = v > m ? v : m;
    }
    return nan ? NAN : m;
}

/* the first index of value m in the row (m its max, not NaN) */
static long first_index_of(const void *x, long n, float m, int bf16) {
    long i = 0;
    for (; i + VLEN <= n; i += VLEN) {
        const int hits = vmask_eq(load_row(x, i, bf16), m);
        if (hits) return i + __builtin_ctz(hits);
    }
    for (; i < n; i++)
        if (load_one(x, i, bf16) == m) return i;
    return -1;
}

/* the weights of block [i, i + VLEN) of the row (lanes past n: 0) */
static inline vec block_weights(const void *x, long i, long n, float t, float shift, int bf16) {
    vec logits;
    if (i + VLEN <= n) {
        logits = load_row(x, i, bf16);
    } else {
        float room[VLEN];
        for (long j = 0; j < VLEN; j++) room[j] = i + j < n ? load_one(x, i + j, bf16) : -INFINITY;
        logits = vload(room);
    }
    const vec scaled = vsub(vdiv(logits, vset(t)), vset(shift));
    /* vexp clamps below at -87 (e^-87 ~ 1.6e-38); a -inf logit, and any weight below that, is 0 */
    return vzero_below(vexp(scaled), scaled, -87.f);
}

static long draw_row(const void *x, long n, float t, double u, int bf16, double *block_sums) {
    const float m = row_max(x, n, bf16);
    if (!isfinite(m)) return -1;
    const float shift = m / t;
    if (!isfinite(shift)) return -1; /* m / T overflowed */
    const long blocks = (n + VLEN - 1) / VLEN;
    double total = 0.0;
    for (long b = 0; b < blocks; b++) total += block_sums[b] = (double)vsum(block_weights(x, b * VLEN, n, t, shift, bf16));
    if (!(isfinite(total) && total > 0.0)) return -1;
    const double point = u * total; /* < total: u < 1 */
    double before = 0.0;
    long b = 0;
    while (b < blocks - 1 && before + block_sums[b] <= point) before += block_sums[b++];
    float w[VLEN];
    vstore(w, block_weights(x, b * VLEN, n, t, shift, bf16));
    long last = -1; /* the block's last token of positive weight: its float32 sum may round past its float64 scan */
    for (long j = 0; j < VLEN; j++) {
        if (w[j] <= 0.f) continue;
        last = b * VLEN + j;
        before += w[j];
        if (before > point) return last;
    }
    return last;
}

/* tokens[r] for each of `rows` rows of logits [rows, n] (float32, or bf16 where `bf16`):
 * temperature[r] == 0: greedy; > 0: drawn with uniforms[r] in [0, 1). -1: a row to take the
 * torch way (above). */
void pagoda_sample_rows(const void *logits, long rows, long n, int bf16, const float *temperature,
                        const double *uniforms, int64_t *tokens, int num_threads) {
    const size_t row_bytes = n * value_size(bf16);
#pragma omp parallel num_threads(rows > 1 ? num_threads : 1)
    {
        double *block_sums = malloc((n + VLEN - 1) / VLEN * sizeof(double));
#pragma omp for schedule(dynamic, 1)
        for (long r = 0; r < rows; r++) {
            const void *x = (const char *)logits + r * row_bytes;
            if (temperature[r] > 0.f) {
                tokens[r] = draw_row(x, n, temperature[r], uniforms[r], bf16, block_sums);
            } else {
                const float m = row_max(x, n, bf16);
                tokens[r] = isnan(m) ? -1 : first_index_of(x, n, m, bf16);
            }
        }
        free(block_sums);
    }
}
