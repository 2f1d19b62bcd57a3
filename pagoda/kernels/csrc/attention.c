/* Paged decode attention reads each request's keys and values where they lie in the paged cache
 * (layout [num_blocks, block_size, num_kv_heads, head_dim] per cache, row-major), so a decode step
 * reads its KV once instead of gathering it into a copy first. */
#include "common.h"

static inline void axpy(float *y, float a, const float *x, long n) {
    __m256 av = _mm256_set1_ps(a);
    for (long i = 0; i < n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
}

static inline void prefetch_token(const float *p, long n) {
    for (long i = 0; i < n; i += 16) _mm_prefetch((const char *)(p + i), _MM_HINT_T0);
}

/* out[b, h, :] = softmax_t(scale * q[b, h, :] . k_t) v_t over tokens t < seq_lens[b] of request b,
 * whose token t lies in block block_tables[b, t / block_size] at offset t % block_size, in kv head
 * h / (num_heads / num_kv_heads) (grouped-query attention).
 * q, out: [batch, num_heads, head_dim] contiguous, head_dim % 8 == 0; block_tables: int32
 * [batch, max_blocks]; seq_lens: int32 [batch], each >= 1. One request per work item: a token's
 * keys of all heads are contiguous, so each request streams its blocks front to back. */
void pagoda_paged_decode_attention(float *out, const float *q, const float *k_cache, const float *v_cache,
                                   const int32_t *block_tables, const int32_t *seq_lens, long batch,
                                   long num_heads, long num_kv_heads, long head_dim, long block_size,
                                   long max_blocks, float scale, int num_threads) {
    const long group = num_heads / num_kv_heads;
    const long token_stride = num_kv_heads * head_dim;
    const long block_stride = block_size * token_stride;
    const long ahead = 16; /* tokens prefetched ahead: the hardware prefetcher misses block jumps */
#pragma omp parallel num_threads(num_threads)
    {
        float *probs = NULL;
        long capacity = 0;
#pragma omp for schedule(dynamic, 1)
        for (long b = 0; b < batch; b++) {
            const long len = seq_lens[b];
            if (len * num_heads > capacity) {
                free(probs);
                capacity = len * num_heads;
                probs = malloc(capacity * sizeof(float));
            }
            const int32_t *table = block_tables + b * max_blocks;
            const float *qb = q + b * num_heads * head_dim;
            float *ob = out + b * num_heads * head_dim;
#define TOKEN(cache, t) (cache + table[(t) / block_size] * block_stride + ((t) % block_size) * token_stride)
            for (long t = 0; t < len; t++) {
                if (t + ahead < len) prefetch_token(TOKEN(k_cache, t + ahead), token_stride);
                const float *k = TOKEN(k_cache, t);
                for (long h = 0; h < num_heads; h++) probs[h * len + t] = scale * dot(qb + h * head_dim, k + (h / group) * head_dim, head_dim);
            }
            for (long h = 0; h < num_heads; h++) {
                float *p = probs + h * len, max = p[0];
                for (long t = 1; t < len; t++) max = p[t] > max ? p[t] : max;
                const float inv = 1.f / exp_shifted(p, len, max);
                for (long t = 0; t < len; t++) p[t] *= inv;
            }
            memset(ob, 0, num_heads * head_dim * sizeof(float));
            for (long t = 0; t < len; t++) {
                if (t + ahead < len) prefetch_token(TOKEN(v_cache, t + ahead), token_stride);
                const float *v = TOKEN(v_cache, t);
                for (long h = 0; h < num_heads; h++) axpy(ob + h * head_dim, probs[h * len + t], v + (h / group) * head_dim, head_dim);
            }
        }
        free(probs);
    }
}
