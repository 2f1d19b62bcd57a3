/* Paged decode attention reads each request's keys and values where they lie in the paged cache
 * (layout [num_blocks, block_size, num_kv_heads, head_dim] per cache, row-major), so a decode step
 * reads its KV once instead of gathering it into a copy first.
 *
 * Work is split by request and, for long contexts, by token span (flash-decoding), so that one long
 * request keeps every thread busy as many short ones do. Each span leaves its unnormalized output
 * with its max score and sum of exponentials per head; the spans of a request merge exactly:
 * out = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s. A span covers all heads: a token's keys of
 * all kv heads are one contiguous row, and splitting by kv head instead (each work item reading a
 * third of every row, for 3 kv heads) made a thread 30% slower.
 *
 * The cache holds float32 or, with `kv_bf16` (`--kv-cache-dtype bfloat16` for a float32 model),
 * bfloat16 values: new keys and values are rounded to the nearest bf16 (ties to even, as torch) as
 * they are stored, and widened back to float32 exactly as they are read: a decode (one row) widens
 * each value in registers as it loads it; a prefill work item (up to QB rows, each reading every key)
 * widens a span's rows once into a thread's buffer. Every score and sum is computed exactly as on a
 * float32 cache that held the rounded values, while the cache's bytes are halved. */
#include "vec.h"
#include "kernels.h"

/* min(n, VLEN) values of a cache row (float32, or bf16 widened exactly) from p + i, the lanes past n
 * zero; n % 8 == 0 */
static inline __attribute__((always_inline)) vec kv_load_n(const void *p, long i, long n, int bf16) {
    if (!bf16) return load_n((const float *)p + i, n);
    const uint16_t *h = (const uint16_t *)p + i;
#ifdef __AVX512F__
    if (n < VLEN) return _mm512_insertf32x8(_mm512_setzero_ps(), bf16x8(h), 0); /* n == 8 */
#endif
    return vload_bf16(h);
}

/* a . b over n values (b a cache row), n % 8 == 0, before its horizontal sum (dot_n is vsum of
 * it): lane j is one chain of fused multiply-adds over values j, j + VLEN, j + 2 VLEN, .. in order,
 * from zero. One chain a lane, not several summed: a score costs one FMA per VLEN values and the
 * horizontal sum, no vector adds; the scoring loops keep VLEN scores' chains in flight (dotv), so
 * the chain's latency does not bound them. */
static inline __attribute__((always_inline)) vec dot_lanes_kv(const float *a, const void *b, long n, int bf16) {
    vec acc = vset(0.f);
    for (long i = 0; i < n; i += VLEN) acc = vfmadd(load_n(a + i, n - i), kv_load_n(b, i, n - i, bf16), acc);
    return acc;
}

static inline vec dot_lanes(const float *a, const float *b, long n) { return dot_lanes_kv(a, b, n, 0); }

static inline float dot_n(const float *a, const float *b, long n) { return vsum(dot_lanes(a, b, n)); }

/* y += a x over n values (x a cache row), n % 8 == 0 */
static inline __attribute__((always_inline)) void axpy_kv(float *y, float a, const void *x, long n, int bf16) {
    const vec av = vset(a);
    for (long i = 0; i < n; i += VLEN)
        store_n(y + i, vfmadd(av, kv_load_n(x, i, n - i, bf16), load_n(y + i, n - i)), n - i);
}

static inline void axpy_n(float *y, float a, const float *x, long n) { axpy_kv(y, a, x, n, 0); }

/* Reads every cache line of n rows of `bytes` bytes each into the cache and does nothing else: a
 * loop of independent reads keeps many more lines in flight than the scoring and value loops, whose
 * FMA chains fill the core's out-of-order window while their loads wait on memory (software
 * prefetching a fixed distance ahead in those loops measured no faster than none). Run over a
 * decode span's keys before scoring them and its values before weighing them, so that those loops
 * read the cache: a 30-layer decode step's attention took 0.66-0.80x the time of none (32 x 300,
 * 8 x 1,100 and 1 x 4,000 tokens, bf16 and float32 caches, 2 threads, AMX machine;
 * results/decode_touch/). The rows are read as TOUCH_WAYS interleaved streams (rows t, t + n/8, ..
 * line by line), not in order: a span's rows lie in blocks of a few KB scattered over the pool, and
 * one stream at a time restarts the hardware prefetcher at every block (four streams read shuffled
 * 12 KB blocks at 26 GB/s where one read at 14.5, 2 threads, Zen 4; eight measured as four there
 * and on the AMX machine).
 * A read is a load of one byte (on AMD Zen 3 and 4 prefetch instructions took 1.2-1.5x the time),
 * but a prefetch instruction where the kernels are built for AMX, Intel's server cores, where it
 * was measured: 0.86-0.92x the time of loads (results/intel_amx/decode_prefetch/); there a load,
 * retiring in order, held the loop up, and a prefetch need not wait for its line. */
enum { TOUCH_WAYS = 8 };

static inline void touch_rows(const void *const *rows, long n, long bytes) {
    const long per_stream = (n + TOUCH_WAYS - 1) / TOUCH_WAYS; /* rows; stream w starts at row w * per_stream */
    for (long t = 0; t < per_stream; t++)
        for (long i = 0; i < bytes; i += 64)
            for (long r = t; r < n; r += per_stream)
#ifdef __AMX_TILE__
                _mm_prefetch((const char *)rows[r] + i, _MM_HINT_T0);
#else
                (void)((const volatile char *)rows[r])[i];
#endif
}

static inline void prefetch_row(const float *p, long n) {
    for (long i = 0; i < n; i += 16) _mm_prefetch((const char *)(p + i), _MM_HINT_T0);
}

enum {
    AHEAD = 16, /* tokens prefetched ahead while widening a bf16 span: the hardware prefetcher misses block jumps */
    /* tokens per span: long enough that a span's fixed costs (its merge, its loops' start) stay
     * small, short enough that a 4,000-token request has 16 spans to share out.
     * Fixed, not sized by the batch or the thread count: a request's result (its summation order)
     * then depends on its own length only, whatever else runs and however many threads there are. */
    SPAN = 256,
};

typedef struct {
    void *k_cache, *v_cache; /* written only for the new tokens, by attend_unit */
    const int32_t *block_tables;
    long max_blocks, block_size, token_stride, block_stride; /* strides in values */
    long num_heads, group, head_dim;
    float scale;
    int bf16; /* the caches hold bfloat16 */
} PagedKv;

/* value `off` of a cache row (float32 or bf16) */
static inline const void *kv_at(const void *row, long off, int bf16) { return (const char *)row + off * value_size(bf16); }

/* out[i] = dot_n(q, k[i] + off, d) for the VLEN cache rows k[0..VLEN), bitwise. Inlined where d is
 * a constant (the common head sizes), whose loops then unroll. */
static inline __attribute__((always_inline)) vec dotv_kv(const float *q, const void *const *k, long off, long d,
                                                         int bf16) {
    vec x[VLEN];
    for (int m = 0; m < VLEN; m++) x[m] = dot_lanes_kv(q, kv_at(k[vsum_token(m)], off, bf16), d, bf16);
    return vsum_each(x);
}

/* out[j] = dotv(q + j d, k, off, d) for the nh <= 3 query heads j of one kv head, bitwise, each key
 * row loaded once for all of them (the tokens in vsum_each's order, two at a time, each pair summed
 * at once). Inlined with constant nh and d. */
static inline __attribute__((always_inline)) void dotv_heads_kv(const float *q, long nh, const void *const *k, long off,
                                                                long d, vec *out, int bf16) {
    vec y[3][VLEN / 2];
    for (int i = 0; i < VLEN / 2; i++) {
        const void *a = kv_at(k[vsum_token(2 * i)], off, bf16), *b = kv_at(k[vsum_token(2 * i + 1)], off, bf16);
        for (long j = 0; j < nh; j++)
            y[j][i] = vsum_each_halves(dot_lanes_kv(q + j * d, a, d, bf16), dot_lanes_kv(q + j * d, b, d, bf16));
    }
    for (long j = 0; j < nh; j++) out[j] = vsum_each_rest(y[j]);
}

/* one token's scaled score for every query head, into scores[h * stride]: dot_n times scale */
static inline __attribute__((always_inline)) void scores1(const PagedKv *kv, const void *k, const float *q,
                                                          float *scores, long stride, int bf16) {
    const long d = kv->head_dim;
    for (long h = 0; h < kv->num_heads; h++)
        scores[h * stride] = kv->scale * vsum(dot_lanes_kv(q + h * d, kv_at(k, (h / kv->group) * d, bf16), d, bf16));
}

/* VLEN tokens' scaled scores for every query head, into scores[h * stride + t], t < VLEN: each the
 * decode kernel's dot_n, times scale. With share_keys, the heads of a kv head share each key load
 * where d is 64 (dotv_heads); either way the same bits. */
static inline __attribute__((always_inline)) void scoresv(const PagedKv *kv, const void *const *k, const float *q,
                                                          float *scores, long stride, int bf16, int share_keys) {
    const long d = kv->head_dim, heads = kv->num_heads, group = kv->group;
    for (long h = 0, off = 0; h < heads; off += d) { /* off: kv head h / group's */
        if (share_keys && d == 64 && (group == 2 || group == 3)) {
            vec x[3];
            if (group == 3) dotv_heads_kv(q + h * d, 3, k, off, 64, x, bf16);
            else dotv_heads_kv(q + h * d, 2, k, off, 64, x, bf16);
            for (long j = 0; j < group; j++, h++) vstore(scores + h * stride, vmul(vset(kv->scale), x[j]));
            continue;
        }
        for (long j = 0; j < group; j++, h++) {
            const float *qh = q + h * d;
            const vec x = d == 64    ? dotv_kv(qh, k, off, 64, bf16)
                          : d == 128 ? dotv_kv(qh, k, off, 128, bf16)
                                     : dotv_kv(qh, k, off, d, bf16);
            vstore(scores + h * stride, vmul(vset(kv->scale), x));
        }
    }
}

enum {
    QB = 16,    /* the most rows of an item: the more share a tile, the less its first reads cost a row */
    KTILE = 16, /* a multiple of VLEN (dotv's tokens): 12 KB of keys for 3 kv heads of 64 */
    VTILE = 64, /* one kv head's values, 16 KB for 64, in use at a time (the heads loop outermost);
                 * each row's accumulators are loaded and stored once a tile and head */
};

/* max of p[0..n), n > 0. Vectorized, so it may differ from a running max in the sign of a zero
 * result only, which changes no bit downstream (e^(s - m) and the merge's e^(m_i - M) are the same
 * for m = +0 and -0). */
static inline float max_n(const float *p, long n) {
    vec acc = vset(-INFINITY);
    long i = 0;
    for (; i + VLEN <= n; i += VLEN) acc = vmax(acc, vload(p + i));
    float lanes[VLEN], m = -INFINITY;
    vstore(lanes, acc);
    for (long j = 0; j < VLEN; j++) m = lanes[j] > m ? lanes[j] : m;
    for (; i < n; i++) m = p[i] > m ? p[i] : m;
    return m;
}

/* o[r][0..w) += sum_t p_r[t] v_t[0..w) over t in [t_from, t_to), w <= 4 VLEN floats at `off` in
 * each value row, for `rows` rows (row r's p at p + r * p_stride, its o at o + r * o_stride): each
 * lane of each row one fma per token in token order, as axpy_n does it. The rows share each value
 * load. Inlined with constant rows and nv = ceil(w / VLEN), so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void weighted_values(float *o, long o_stride, const float *p,
                                                                  long p_stride, const void *const *vrow, long off,
                                                                  long w, long rows, long nv, long t_from, long t_to,
                                                                  int bf16) {
    vec acc[4][4];
    for (long r = 0; r < rows; r++)
        for (long c = 0; c < nv; c++) acc[r][c] = load_n(o + r * o_stride + c * VLEN, w - c * VLEN);
    for (long t = t_from; t < t_to; t++) {
        const void *v = kv_at(vrow[t], off, bf16);
        vec vv[4];
        for (long c = 0; c < nv; c++) vv[c] = kv_load_n(v, c * VLEN, w - c * VLEN, bf16);
        for (long r = 0; r < rows; r++) {
            const vec pt = vset(p[r * p_stride + t]);
            for (long c = 0; c < nv; c++) acc[r][c] = vfmadd(pt, vv[c], acc[r][c]);
        }
    }
    for (long r = 0; r < rows; r++)
        for (long c = 0; c < nv; c++) store_n(o + r * o_stride + c * VLEN, acc[r][c], w - c * VLEN);
}

/* weighted_values over a row's whole head (d values), 4 VLEN at a time, rows <= 4 */
static inline __attribute__((always_inline)) void weighted_head_kv(float *o, long o_stride, const float *p,
                                                                   long p_stride, const void *const *vrow, long off,
                                                                   long d, long rows, long t_from, long t_to,
                                                                   int bf16) {
    for (long i = 0; i < d; i += 4 * VLEN) {
        const long w = d - i < 4 * VLEN ? d - i : 4 * VLEN;
        float *oi = o + i;
        if (w == 4 * VLEN && rows == 4)
            weighted_values(oi, o_stride, p, p_stride, vrow, off + i, w, 4, 4, t_from, t_to, bf16);
        else if (w == 4 * VLEN && rows == 3)
            weighted_values(oi, o_stride, p, p_stride, vrow, off + i, w, 3, 4, t_from, t_to, bf16);
        else if (w == 4 * VLEN && rows == 2)
            weighted_values(oi, o_stride, p, p_stride, vrow, off + i, w, 2, 4, t_from, t_to, bf16);
        else if (w == 4 * VLEN)
            for (long r = 0; r < rows; r++)
                weighted_values(oi + r * o_stride, o_stride, p + r * p_stride, p_stride, vrow, off + i, w, 1, 4, t_from,
                                t_to, bf16);
        else
            for (long r = 0; r < rows; r++)
                weighted_values(oi + r * o_stride, o_stride, p + r * p_stride, p_stride, vrow, off + i, w, 1,
                                (w + VLEN - 1) / VLEN, t_from, t_to, bf16);
    }
}

static void weighted_head(float *o, long o_stride, const float *p, long p_stride, const float *const *vrow, long off,
                          long d, long rows, long t_from, long t_to) {
    weighted_head_kv(o, o_stride, p, p_stride, (const void *const *)vrow, off, d, rows, t_from, t_to, 0);
}

static inline void *token_at(void *cache, const PagedKv *kv, const int32_t *table, long t) {
    const long at = table[t / kv->block_size] * kv->block_stride + (t % kv->block_size) * kv->token_stride;
    return (char *)cache + at * value_size(kv->bf16);
}

/* one new token's keys or values (a float32 row) into its cache row */
static inline void store_token(const PagedKv *kv, void *row, const float *src) {
    if (kv->bf16) floats_to_bf16(row, src, kv->token_stride);
    else memcpy(row, src, kv->token_stride * sizeof(float));
}

/* rows[t]: token t0 + t's row of `cache` as float32, t < n: in place, or widened from bf16 into
 * wide + t * token_stride (exactly: bf16 is an fp32's top half) */
static void span_rows(const PagedKv *kv, void *cache, const int32_t *table, long t0, long n, float *wide,
                      const float **rows) {
    for (long t = 0; t < n; t++) {
        const void *row = token_at(cache, kv, table, t0 + t);
        if (!kv->bf16) {
            rows[t] = row;
            continue;
        }
        if (t + AHEAD < n) prefetch_row(token_at(cache, kv, table, t0 + t + AHEAD), kv->token_stride / 2);
        float *out = wide + t * kv->token_stride;
        bf16_to_floats(out, row, kv->token_stride);
        rows[t] = out;
    }
}

/* Every query head h of q (head_dim apart, its kv head h / group) over tokens [t0, t1) of the
 * request with `table`: o[h] = sum_t e^(s_ht - m[h]) v_t, unnormalized, l[h] = sum_t e^(s_ht - m[h])
 * and m[h] = max_t s_ht. scores: scratch of num_heads * (t1 - t0) floats. The prefill kernel's
 * loops on one row: scores VLEN tokens at a time from the span's start (scoresv: each dot_n, bitwise)
 * then one by one; each head's weighted values a VTILE of tokens at a time, each lane's chain of
 * fused multiply-adds over the tokens in order, in registers. A bf16 cache's values are widened in
 * registers as they are loaded: the same operations on the same float32 values. */
static inline __attribute__((always_inline)) void attend_span_kv(const PagedKv *kv, const int32_t *table,
                                                                 const float *q, long t0, long t1, float *scores,
                                                                 float *o, float *m, float *l, int bf16) {
    const long n = t1 - t0, d = kv->head_dim, heads = kv->num_heads, group = kv->group;
    const long row_bytes = kv->token_stride * value_size(bf16);
    const void *krow[SPAN], *vrow[SPAN];
    for (long t = 0; t < n; t++) {
        krow[t] = token_at(kv->k_cache, kv, table, t0 + t);
        vrow[t] = token_at(kv->v_cache, kv, table, t0 + t);
    }
    touch_rows(krow, n, row_bytes);
    long t = 0;
    for (; t + VLEN <= n; t += VLEN) scoresv(kv, krow + t, q, scores + t, n, bf16, 1);
    for (; t < n; t++) scores1(kv, krow[t], q, scores + t, n, bf16);
    for (long h = 0; h < heads; h++) {
        m[h] = max_n(scores + h * n, n);
        l[h] = exp_shifted(scores + h * n, n, m[h]);
    }
    memset(o, 0, heads * d * sizeof(float));
    touch_rows(vrow, n, row_bytes);
    for (long a = 0; a < n; a += VTILE) {
        const long b = a + VTILE < n ? a + VTILE : n;
        for (long h0 = 0; h0 < heads; h0 += group) /* a kv head's query heads, 4 at most at once, share each value load */
            for (long h = h0; h < h0 + group; h += 4) {
                const long rows = h0 + group - h < 4 ? h0 + group - h : 4;
                weighted_head_kv(o + h * d, d, scores + h * n, n, vrow, (h0 / group) * d, d, rows, a, b, bf16);
            }
    }
}

static void attend_span(const PagedKv *kv, const int32_t *table, const float *q, long t0, long t1, float *scores,
                        float *o, float *m, float *l) {
    if (kv->bf16) attend_span_kv(kv, table, q, t0, t1, scores, o, m, l, 1);
    else attend_span_kv(kv, table, q, t0, t1, scores, o, m, l, 0);
}

/* The spans of every request: request b owns spans first[b] .. first[b + 1] - 1, the i-th starting at
 * token start[i], SPAN tokens each (the last of a request fewer). Returns the longest span. */
static long plan_spans(const int32_t *seq_lens, long batch, long *first, int32_t **start) {
    long longest = 0;
    for (long b = 0; b < batch; b++) longest = seq_lens[b] > longest ? seq_lens[b] : longest;
    const long span = longest < SPAN ? longest : SPAN; /* the same spans; a smaller scratch */
    first[0] = 0;
    for (long b = 0; b < batch; b++) first[b + 1] = first[b] + (seq_lens[b] + span - 1) / span;
    *start = malloc(first[batch] * sizeof(int32_t));
    for (long b = 0; b < batch; b++)
        for (long i = first[b]; i < first[b + 1]; i++) (*start)[i] = (int32_t)((i - first[b]) * span);
    return span;
}

/* out (heads rows of head_dim) = the exact softmax-weighted merge of `spans` partial results, the
 * i-th at o + i * heads * d, m + i * 2 * heads and l + i * 2 * heads. */
static void merge_spans(float *out, const float *o, const float *m, const float *l, long spans, long heads, long d) {
    for (long h = 0; h < heads; h++) {
        float max = -INFINITY, sum = 0.f;
        for (long i = 0; i < spans; i++) max = fmaxf(max, m[i * 2 * heads + h]);
        for (long i = 0; i < spans; i++) sum += expf(m[i * 2 * heads + h] - max) * l[i * 2 * heads + h];
        memset(out + h * d, 0, d * sizeof(float));
        for (long i = 0; i < spans; i++)
            axpy_n(out + h * d, expf(m[i * 2 * heads + h] - max) / sum, o + i * heads * d + h * d, d);
    }
}

/* Writes the new keys and values of n tokens (rows key_stride / value_stride floats apart, each row's
 * heads contiguous) to their slots of the paged cache (bf16: rounded); slot -1 (a padding lane) is
 * skipped. */
void pagoda_store_kv(void *k_cache, void *v_cache, const float *key, long key_stride, const float *value,
                     long value_stride, const int64_t *slots, long n, long token_stride, int kv_bf16, int num_threads) {
    const PagedKv kv = {.token_stride = token_stride, .bf16 = kv_bf16};
    const size_t row_bytes = token_stride * value_size(kv_bf16);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (long i = 0; i < n; i++) {
        if (slots[i] < 0) continue;
        store_token(&kv, (char *)k_cache + slots[i] * row_bytes, key + i * key_stride);
        store_token(&kv, (char *)v_cache + slots[i] * row_bytes, value + i * value_stride);
    }
}

/* The step's new token of each decode, as the attention reads it. */
typedef struct {
    const float *key, *value;
    long key_stride, value_stride;
    const int64_t *slots;
} NewTokens;

/* Partial results of the spans of split requests: span i's o at o + i * num_heads * head_dim, m and l
 * at ml + i * 2 * num_heads (+ num_heads); done counts each request's finished spans. */
typedef struct {
    float *o, *ml;
    int *done;
} Partials;

/* Span i (the span_index-th of `spans`) of request b. The request's last span first stores the new
 * token's key and value: no other span reads them. A request with one span is normalized into out
 * directly; of a split one, the span that finishes last merges them all (the atomic count orders
 * the other spans' partial results before the merge reads them). */
static void attend_unit(const PagedKv *kv, float *out, const float *q, long q_stride, const NewTokens *new_tokens,
                        long b, long i, long span_index, long spans, long t0, long t1, long seq_len,
                        const Partials *part, float *scratch, long span) {
    const long heads = kv->num_heads, d = kv->head_dim;
    const int64_t slot = new_tokens->slots[b];
    if (t1 == seq_len && slot >= 0) {
        const size_t row_bytes = kv->token_stride * value_size(kv->bf16);
        store_token(kv, (char *)kv->k_cache + slot * row_bytes, new_tokens->key + b * new_tokens->key_stride);
        store_token(kv, (char *)kv->v_cache + slot * row_bytes, new_tokens->value + b * new_tokens->value_stride);
    }
    const float *qb = q + b * q_stride;
    const int32_t *table = kv->block_tables + b * kv->max_blocks;
    float *ob = out + b * heads * d;
    if (spans == 1) {
        float *o = scratch + heads * span, *m = o + heads * d, *l = m + heads;
        attend_span(kv, table, qb, t0, t1, scratch, o, m, l);
        for (long h = 0; h < heads; h++) {
            memset(ob + h * d, 0, d * sizeof(float));
            axpy_n(ob + h * d, 1.f / l[h], o + h * d, d);
        }
        return;
    }
    float *ml = part->ml + i * 2 * heads;
    attend_span(kv, table, qb, t0, t1, scratch, part->o + i * heads * d, ml, ml + heads);
    if (__atomic_add_fetch(part->done + b, 1, __ATOMIC_ACQ_REL) == spans) {
        const long i0 = i - span_index;
        const float *ml0 = part->ml + i0 * 2 * heads;
        merge_spans(ob, part->o + i0 * heads * d, ml0, ml0 + heads, spans, heads, d);
    }
}

/* Stores the batch's new keys and values (row b of key / value goes to slot slots[b]; -1 is skipped)
 * and attends: out[b, h, :] = softmax_t(scale * q[b, h, :] . k_t) v_t over tokens t < seq_lens[b] of
 * request b, whose token t lies in block block_tables[b, t / block_size] at offset t % block_size,
 * in kv head h / (num_heads / num_kv_heads) (grouped-query attention).
 * q: rows q_stride floats apart, each [num_heads, head_dim] contiguous (key and value likewise);
 * out: [batch, num_heads, head_dim] contiguous; head_dim % 8 == 0; block_tables: int32
 * [batch, max_blocks]; seq_lens: int32 [batch], each >= 1 and counting the new token.
 * One parallel loop over every span and no barrier inside it: on a loaded machine each barrier
 * waits for a descheduled thread. */
void pagoda_paged_decode_attention(float *out, const float *q, long q_stride, const float *key, long key_stride,
                                   const float *value, long value_stride, const int64_t *slots, void *k_cache,
                                   void *v_cache, const int32_t *block_tables, const int32_t *seq_lens, long batch,
                                   long num_heads, long num_kv_heads, long head_dim, long block_size,
                                   long max_blocks, float scale, int kv_bf16, int num_threads) {
    const long token_stride = num_kv_heads * head_dim;
    const PagedKv kv = {k_cache,     v_cache, block_tables, max_blocks, block_size, token_stride,
                        block_size * token_stride, num_heads, num_heads / num_kv_heads, head_dim, scale, kv_bf16};
    const NewTokens new_tokens = {key, value, key_stride, value_stride, slots};
    long *first = malloc((batch + 1) * sizeof(long));
    int32_t *start;
    const long span = plan_spans(seq_lens, batch, first, &start), units = first[batch];
    Partials part = {NULL, NULL, NULL};
    if (units > batch) {
        part.o = malloc(units * num_heads * (head_dim + 2) * sizeof(float));
        part.ml = part.o + units * num_heads * head_dim;
        part.done = calloc(batch, sizeof(int));
    }
    /* Spans in span-major order (every request's first span, then every second one, ..), so that
     * requests sharing a prefix (the same blocks at the same span) read them one after another,
     * the later ones from cache: 8 requests of 1,100 tokens sharing 1,024 took 0.94x the time of
     * request-major order (results/intel_amx/decode_prefetch/). Each span's arithmetic is its own:
     * the order changes no result. */
    long *order = malloc(units * sizeof(long)), *owner = malloc(units * sizeof(long)), u = 0;
    for (long b = 0; b < batch; b++)
        for (long i = first[b]; i < first[b + 1]; i++) owner[i] = b;
    for (long s = 0; u < units; s++)
        for (long b = 0; b < batch; b++)
            if (first[b] + s < first[b + 1]) order[u++] = first[b] + s;
#pragma omp parallel num_threads(num_threads)
    {
        float *scratch = malloc((num_heads * span + num_heads * head_dim + 2 * num_heads) * sizeof(float));
#pragma omp for schedule(dynamic, 1) nowait
        for (long j = 0; j < units; j++) {
            const long i = order[j], b = owner[i];
            const long t0 = start[i], t1 = t0 + span < seq_lens[b] ? t0 + span : seq_lens[b];
            attend_unit(&kv, out, q, q_stride, &new_tokens, b, i, i - first[b], first[b + 1] - first[b], t0, t1,
                        seq_lens[b], &part, scratch, span);
        }
        free(scratch);
    }
    free(part.o);
    free(part.done);
    free(order);
    free(owner);
    free(start);
    free(first);
}

/* Prefill attention with the decode kernel's arithmetic: query row j of a chunk, at position
 * p = seq_len - q_len + j, attends over tokens [0, p] exactly as a decode with seq_len p + 1 does
 * (the same SPAN-token spans from token 0, the same score, exponential and sum order, the same
 * merge), so a token's output is bitwise the same whether it was computed in a prefill chunk of
 * any size, after any cached prefix, or as a decode step. Keys and values are read in place from
 * the paged cache (the chunk's own already stored); the keys past a row's position are skipped, not
 * masked. A work item is up to QB consecutive rows of one request, each with its own partial
 * results per span. Within a span the item walks the keys, then the values, a tile at a time
 * (KTILE, VTILE tokens), every row and head of the item using a tile before the next: each key and
 * value row is read from L2 or L3 once per item, then from L1, instead of once per row (a span's
 * keys, 192 KB for 3 kv heads of 64, do not fit L1's 48 KB). Only the loop order changes: each
 * score is the same dot product, and each output lane's chain of fused multiply-adds still runs
 * over the span's tokens in order, its accumulator kept in memory from one tile to the next; on
 * AVX-512 the query heads of a kv head (up to 3, head_dim 64) share each key load (SHARE_KEYS). The
 * rest of the kernel's time is that arithmetic itself: 16 scores cost 64 FMAs, 15 adds and 30
 * shuffles on AVX-512 (dotv); software prefetching of the next tile measured no faster. */
typedef struct {
    long rows, spans;     /* rows of the item; spans of its last (longest) row */
    float *scores;        /* [QB][heads][SPAN] */
    float *o, *ml;        /* per row and span: o [heads][d], m [heads] then l [heads] (merge_spans' layout) */
    float *kwide, *vwide; /* bf16: a span's key and value rows widened, [SPAN][token_stride] each */
    const float *kt;      /* the request's keys transposed (AVX-512, head_dim 64 or 128), or NULL */
} RowBlock;

/* Whether the prefill's scoring shares key loads between a kv head's query heads: its keys are in
 * L1 (a KTILE tile), so what counts is keeping a head's query in registers, which dotv_heads' three
 * heads' sums do not leave room for in AVX2's 16 registers: sharing measured 1.07-1.16x the time
 * there (AMD Zen 3, 2 threads, benchmarks/prefill_attention.py). A decode reads its keys from L2 and
 * shares them (without, bf16 caches' decodes took up to 1.13x the time there). */
enum { SHARE_KEYS = VLEN == 16 };

/* Scores of the span's tokens [0, n[r]) for rows r = first.. of the item, scaled, into row r's
 * scores[h][t]: a KTILE-token tile of keys at a time, all rows and heads. A row's tokens go VLEN
 * at a time (dotv, aligned to the span's start) while VLEN remain, the rest one by one, as the
 * decode kernel's dot_n gives them. */
static void prefill_scores(const PagedKv *kv, const float *const *krow, const float *q, long q_stride, const long *n,
                           long first, long rows, float *scores) {
    const long heads = kv->num_heads, last = n[rows - 1];
    for (long a = 0; a < last; a += KTILE) {
        for (long r = first; r < rows; r++) {
            if (n[r] <= a) continue;
            const float *qr = q + r * q_stride;
            float *sc = scores + r * heads * SPAN;
            const long b = n[r] < a + KTILE ? n[r] : a + KTILE;
            long t = a;
            for (; t + VLEN <= b; t += VLEN)
                scoresv(kv, (const void *const *)krow + t, qr, sc + t, SPAN, 0, SHARE_KEYS);
            for (; t < b; t++) scores1(kv, krow[t], qr, sc + t, SPAN, 0);
        }
    }
}

/* Prefill scoring on keys transposed a tile at a time (AVX-512, head_dim 64 or 128): each score is
 * still the decode's dot_n, bitwise (lane j's chain of fused multiply-adds over values j, j + 16, ..
 * from zero, then the 16 chains added in _mm512_reduce_add_ps's pairs: j + 8 to j, then j + 4, then
 * 2, then 1), but with a tile's tokens as the lanes, so that the pairs are vertical adds: 16 scores
 * cost 64 FMAs and 15 adds and no shuffles (dotv's 30 shuffles run on one of the two FMA ports), and
 * six query rows share each key load. The keys are transposed once a call, before the items start
 * (a request's tiles of TT tokens: tile i's [kv head][value e][token t] at kt + i * TT *
 * token_stride, tokens past its length zero), for the requests with at least TILED_ROWS rows in
 * it (while they fit TILED_BYTES): there the transposes cost little beside the rows' scores.
 * Against the scoring above (benchmarks/prefill_attention.py, 2-core Intel AMX machine, the same
 * bits): a 4,000-token prompt in 512-token chunks 0.90-0.94x the time, a 256-token prompt
 * 0.94-0.96x; a 46-row hit after 1,024 cached tokens, which keeps dotv, took 1.04-1.06x transposed
 * (its 46 rows share the transposes of 1,070 tokens). In a probe of the scoring alone (one thread,
 * keys in L1), 66% of the FMA peak against dotv's 51%. */
enum {
    TT = 32,          /* tokens of a transposed key tile: two vectors */
    TILED_ROWS = 128, /* a request's rows in the call from which its keys are transposed */
};
/* the most bytes of transposed keys a call holds: requests past it keep dotv (a 4,000-token prompt
 * of the default model takes 3 MB, one of 8,000 tokens with 8 kv heads of 128 values 33 MB) */
#define TILED_BYTES (64l << 20)

#ifdef __AVX512F__
/* dst[i * TT + t] = src[t][off + i] for i, t < 16 (bf16 widened); a NULL row gives zeros */
static inline void transpose16(const void *const *src, long off, float *dst, int bf16) {
    vec r[16], t[16], u[16];
    for (int i = 0; i < 16; i++) r[i] = src[i] ? load_row(src[i], off, bf16) : vset(0.f);
    for (int i = 0; i < 16; i += 2) { /* lane L: rows i, i + 1 interleaved, values 4L, 4L + 1 (lo) or + 2, + 3 (hi) */
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* u[i + c], lane L: value 4L + c of rows i .. i + 3 */
        u[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        u[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        u[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
        u[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    }
    for (int c = 0; c < 4; c++) { /* the 128-bit lanes of u[c], u[4 + c], u[8 + c], u[12 + c] transposed */
        const vec x0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x44);
        const vec x1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xEE);
        const vec y0 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x44);
        const vec y1 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xEE);
        vstore(dst + (c + 0) * TT, _mm512_shuffle_f32x4(x0, y0, 0x88));
        vstore(dst + (c + 4) * TT, _mm512_shuffle_f32x4(x0, y0, 0xDD));
        vstore(dst + (c + 8) * TT, _mm512_shuffle_f32x4(x1, y1, 0x88));
        vstore(dst + (c + 12) * TT, _mm512_shuffle_f32x4(x1, y1, 0xDD));
    }
}

/* tile i of a request's transposed keys (tokens i TT .. of `table`, len tokens in all) into kt */
static void transpose_tile(const PagedKv *kv, const int32_t *table, long i, long len, float *kt) {
    const void *src[TT];
    for (long t = 0; t < TT; t++) src[t] = i * TT + t < len ? token_at(kv->k_cache, kv, table, i * TT + t) : NULL;
    for (long c = 0; c < kv->token_stride; c += 16)
        for (long h = 0; h < TT; h += 16) transpose16(src + h, c, kt + c * TT + h, kv->bf16);
}

enum { SCORE_ROWS = 6 }; /* query rows scored at once: 12 accumulators, two vectors of tokens each */

/* The scaled scores of nq <= SCORE_ROWS query rows (qs[i], one kv head's, d values) for the
 * tile's TT tokens (kt: that kv head's [d][TT]) into out[i][0..TT). The chains p_j of lane j are
 * computed in the order j = 0, 8, 4, 12, 2, .. (k's 4 bits reversed) so that each pair the tree adds
 * is complete when its second half is: after chain k, the partial sums of the levels where k has a
 * one bit are added in, and the result kept at the first level where it has a zero (a binary
 * counter). Each key vector is loaded once for all the rows and each query value broadcast once
 * for both token vectors. */
static inline __attribute__((always_inline)) void score_rows(const float *const *qs, long nq, const float *kt, long d,
                                                             float scale, float *const *out) {
    vec partial[4][SCORE_ROWS][2];
#pragma GCC unroll 16
    for (int k = 0; k < 16; k++) {
        const int j = (k & 1) << 3 | (k & 2) << 1 | (k & 4) >> 1 | (k & 8) >> 3;
        vec p[SCORE_ROWS][2];
        for (long i = 0; i < nq; i++) p[i][0] = p[i][1] = vset(0.f);
        for (long e = j; e < d; e += 16) {
            vec k0 = vload(kt + e * TT), k1 = vload(kt + e * TT + 16);
            __asm__("" : "+v"(k0), "+v"(k1)); /* loaded once into registers, not once per row */
            for (long i = 0; i < nq; i++) {
                const vec b = vset(qs[i][e]);
                p[i][0] = vfmadd(b, k0, p[i][0]);
                p[i][1] = vfmadd(b, k1, p[i][1]);
            }
        }
        int level = 0;
        for (; (k >> level) & 1; level++)
            for (long i = 0; i < nq; i++)
                for (int c = 0; c < 2; c++) p[i][c] = vadd(partial[level][i][c], p[i][c]);
        for (long i = 0; i < nq; i++)
            for (int c = 0; c < 2; c++) {
                if (k < 15) partial[level][i][c] = p[i][c];
                else vstore(out[i] + c * 16, vmul(vset(scale), p[i][c]));
            }
    }
}

static inline __attribute__((always_inline)) void score_rows_d(const float *const *qs, long nq, const float *kt, long d,
                                                               float scale, float *const *out) {
    switch (nq) {
    case 6: score_rows(qs, 6, kt, d, scale, out); break;
    case 5: score_rows(qs, 5, kt, d, scale, out); break;
    case 4: score_rows(qs, 4, kt, d, scale, out); break;
    case 3: score_rows(qs, 3, kt, d, scale, out); break;
    case 2: score_rows(qs, 2, kt, d, scale, out); break;
    default: score_rows(qs, 1, kt, d, scale, out); break;
    }
}

/* prefill_scores on the span's transposed keys (kt: the span's first tile): every row's scores
 * TT tokens at a time (those past a row's n[r] computed and never read), SCORE_ROWS query rows of
 * a kv head at a time */
static void prefill_scores_tiled(const PagedKv *kv, const float *kt, const float *q, long q_stride, const long *n,
                                 long first, long rows, float *scores) {
    const long d = kv->head_dim, heads = kv->num_heads, group = kv->group, last = n[rows - 1];
    for (long a = 0; a < last; a += TT) {
        long r = first; /* rows r.. see the tile (n grows with r) */
        while (n[r] <= a) r++;
        const long count = (rows - r) * group;
        for (long g = 0; g * group < heads; g++) {
            const float *ktg = kt + (a / TT) * TT * kv->token_stride + g * d * TT;
            for (long i = 0; i < count; i += SCORE_ROWS) {
                const long nq = count - i < SCORE_ROWS ? count - i : SCORE_ROWS;
                const float *qs[SCORE_ROWS];
                float *out[SCORE_ROWS];
                for (long x = 0; x < nq; x++) {
                    const long row = r + (i + x) / group, h = g * group + (i + x) % group;
                    qs[x] = q + row * q_stride + h * d;
                    out[x] = scores + (row * heads + h) * SPAN + a;
                }
                if (d == 64) score_rows_d(qs, nq, ktg, 64, kv->scale, out);
                else score_rows_d(qs, nq, ktg, 128, kv->scale, out);
            }
        }
    }
}
#endif

/* o[r] += sum_t p_r[t] v_t over the span's tokens [0, n[r]) for rows r = first.. (o zeroed before):
 * a VTILE-token tile of values at a time; in it four rows at a time over the tokens they all see,
 * then each row's rest, so that every row's chains run over the tokens in order. */
static void prefill_values(const PagedKv *kv, const float *const *vrow, const long *n, long first, long rows, long s,
                           RowBlock *rb) {
    const long d = kv->head_dim, heads = kv->num_heads, group = kv->group, last = n[rows - 1];
    const long o_stride = rb->spans * heads * d, p_stride = heads * SPAN;
    for (long a = 0; a < last; a += VTILE) {
        const long b = a + VTILE < last ? a + VTILE : last;
        for (long h = 0; h < heads; h++) /* the heads of a kv head one after another, on its values */
            for (long r = first; r < rows; r += 4) {
                const long nr = rows - r < 4 ? rows - r : 4, shared = n[r] < b ? n[r] : b;
                float *o = rb->o + (r * rb->spans + s) * heads * d + h * d;
                const float *p = rb->scores + r * p_stride + h * SPAN;
                const long off = (h / group) * d;
                if (a < shared) weighted_head(o, o_stride, p, p_stride, vrow, off, d, nr, a, shared);
                for (long j = 1; j < nr; j++) {
                    const long from = a > n[r] ? a : n[r], to = n[r + j] < b ? n[r + j] : b;
                    if (from < to)
                        weighted_head(o + j * o_stride, o_stride, p + j * p_stride, p_stride, vrow, off, d, 1, from, to);
                }
            }
    }
}

/* One span [t0, t0 + SPAN) of the item's rows r whose context len[r] reaches past t0: scores,
 * their max and exponentials, and the unnormalized weighted values, as attend_span computes them
 * for a decode with seq_len len[r]. Rows are consecutive positions: row r sees one token more
 * than row r - 1. */
static void prefill_span(const PagedKv *kv, const int32_t *table, const float *q, long q_stride, const long *len,
                         long t0, long s, RowBlock *rb) {
    const long d = kv->head_dim, heads = kv->num_heads, rows = rb->rows;
    long first = 0; /* rows first.. reach the span */
    while (len[first] <= t0) first++;
    long n[QB]; /* row r's tokens in the span */
    for (long r = first; r < rows; r++) n[r] = (len[r] < t0 + SPAN ? len[r] : t0 + SPAN) - t0;
    const float *krow[SPAN], *vrow[SPAN]; /* the span's tokens, from 0, looked up (bf16: widened) once */
    span_rows(kv, kv->v_cache, table, t0, n[rows - 1], rb->vwide, vrow);
#ifdef __AVX512F__
    if (rb->kt)
        prefill_scores_tiled(kv, rb->kt + t0 * kv->token_stride, q, q_stride, n, first, rows, rb->scores);
    else
#endif
    {
        span_rows(kv, kv->k_cache, table, t0, n[rows - 1], rb->kwide, krow);
        prefill_scores(kv, krow, q, q_stride, n, first, rows, rb->scores);
    }
    for (long r = first; r < rows; r++) {
        float *ml = rb->ml + (r * rb->spans + s) * 2 * heads, *sc = rb->scores + r * heads * SPAN;
        for (long h = 0; h < heads; h++) {
            ml[h] = max_n(sc + h * SPAN, n[r]);
            ml[heads + h] = exp_shifted(sc + h * SPAN, n[r], ml[h]);
        }
        memset(rb->o + (r * rb->spans + s) * heads * d, 0, heads * d * sizeof(float));
    }
    prefill_values(kv, vrow, n, first, rows, s, rb);
}

/* out rows of the item: each row's spans merged as the decode kernel merges them */
static void prefill_rows(const PagedKv *kv, const int32_t *table, float *out, const float *q, long q_stride,
                         long first_pos, RowBlock *rb) {
    const long heads = kv->num_heads, d = kv->head_dim;
    long len[QB];
    for (long r = 0; r < rb->rows; r++) len[r] = first_pos + r + 1;
    for (long s = 0; s < rb->spans; s++) prefill_span(kv, table, q, q_stride, len, s * SPAN, s, rb);
    for (long r = 0; r < rb->rows; r++) {
        const long spans = (len[r] + SPAN - 1) / SPAN;
        const float *o = rb->o + r * rb->spans * heads * d, *ml = rb->ml + r * rb->spans * 2 * heads;
        float *orow = out + r * heads * d;
        if (spans == 1) {
            for (long h = 0; h < heads; h++) {
                memset(orow + h * d, 0, d * sizeof(float));
                axpy_n(orow + h * d, 1.f / ml[heads + h], o + h * d, d);
            }
        } else {
            merge_spans(orow, o, ml, ml + heads, spans, heads, d);
        }
    }
}

/* The prefill chunks of num_reqs requests: request i's query rows are q rows query_start[i] ..
 * query_start[i + 1] - 1 (q_stride floats apart, each [num_heads, head_dim]), its last row at
 * position seq_lens[i] - 1, its tokens in the blocks of block_tables row i, its keys and values
 * already in the cache. out: [query_start[num_reqs], num_heads, head_dim], contiguous. */
void pagoda_prefill_attention(float *out, const float *q, long q_stride, const void *k_cache, const void *v_cache,
                              const int32_t *block_tables, const int32_t *query_start, const int32_t *seq_lens,
                              long num_reqs, long num_heads, long num_kv_heads, long head_dim,
                              long block_size, long max_blocks, float scale, int kv_bf16, int num_threads) {
    const long token_stride = num_kv_heads * head_dim;
    const PagedKv kv = {(void *)k_cache, (void *)v_cache, block_tables, max_blocks, block_size, token_stride,
                        block_size * token_stride, num_heads, num_heads / num_kv_heads, head_dim, scale, kv_bf16};
    /* rows per item: QB, fewer where that would leave threads idle (a 46-row hit on 2 threads: 4
     * items of 12 rows, not 3 of 16); the results do not depend on it */
    const long total_rows = query_start[num_reqs], per_thread = 2 * (long)num_threads;
    long item_rows = (total_rows + per_thread - 1) / per_thread;
    item_rows = item_rows > QB ? QB : item_rows < 4 ? 4 : item_rows;
    long items = 0, longest = 1;
    for (long i = 0; i < num_reqs; i++) {
        items += (query_start[i + 1] - query_start[i] + item_rows - 1) / item_rows;
        longest = seq_lens[i] > longest ? seq_lens[i] : longest;
    }
    long *item_req = malloc(2 * items * sizeof(long)), *item_row = item_req + items;
    for (long i = 0, it = 0; i < num_reqs; i++)
        for (long row = query_start[i]; row < query_start[i + 1]; row += item_rows)
            item_req[it] = i, item_row[it++] = row;
    const long max_spans = (longest + SPAN - 1) / SPAN;
    /* the transposed keys (prefill_scores_tiled): request i's tiles are kt's tiles tile_first[i] ..
     * tile_first[i + 1] - 1, none where its keys are not transposed */
    long *tile_first = malloc((num_reqs + 1) * sizeof(long));
    tile_first[0] = 0;
    const int tiled = VLEN == 16 && (head_dim == 64 || head_dim == 128);
    const long tile_floats = TT * token_stride;
    for (long i = 0; i < num_reqs; i++) {
        const long tiles = (seq_lens[i] + TT - 1) / TT;
        const int transposed = tiled && query_start[i + 1] - query_start[i] >= TILED_ROWS &&
                               (tile_first[i] + tiles) * tile_floats * (long)sizeof(float) <= TILED_BYTES;
        tile_first[i + 1] = tile_first[i] + (transposed ? tiles : 0);
    }
    float *kt = tile_first[num_reqs] ? malloc(tile_first[num_reqs] * tile_floats * sizeof(float)) : NULL;
#pragma omp parallel num_threads(num_threads)
    {
        RowBlock rb;
#ifdef __AVX512F__
        if (kt) { /* every tile before any item reads one: the loop's barrier */
            long i = 0;
#pragma omp for schedule(monotonic : dynamic, 4)
            for (long tile = 0; tile < tile_first[num_reqs]; tile++) {
                while (tile_first[i + 1] <= tile) i++; /* monotonic: each thread's tiles come in increasing order */
                transpose_tile(&kv, block_tables + i * max_blocks, tile - tile_first[i], seq_lens[i],
                               kt + tile * tile_floats);
            }
        }
#endif
        rb.scores = malloc((QB * num_heads * SPAN + QB * max_spans * num_heads * (head_dim + 2)) * sizeof(float));
        rb.o = rb.scores + QB * num_heads * SPAN;
        rb.kwide = kv_bf16 ? malloc(2 * SPAN * token_stride * sizeof(float)) : NULL;
        rb.vwide = kv_bf16 ? rb.kwide + SPAN * token_stride : NULL;
#pragma omp for schedule(dynamic, 1) nowait
        for (long it = items - 1; it >= 0; it--) { /* the longest rows first */
            const long i = item_req[it], row = item_row[it], end = query_start[i + 1];
            const long first_pos = seq_lens[i] - (end - query_start[i]) + (row - query_start[i]);
            rb.rows = end - row < item_rows ? end - row : item_rows;
            rb.spans = (first_pos + rb.rows + SPAN - 1) / SPAN;
            rb.ml = rb.o + QB * rb.spans * num_heads * head_dim;
            rb.kt = kt && tile_first[i + 1] > tile_first[i] ? kt + tile_first[i] * tile_floats : NULL; /* none: dotv */
            prefill_rows(&kv, block_tables + i * max_blocks, out + row * num_heads * head_dim, q + row * q_stride,
                         q_stride, first_pos, &rb);
        }
        free(rb.scores);
        free(rb.kwide);
    }
    free(kt);
    free(tile_first);
    free(item_req);
}
