/* The kernels one source calls in another (decoder.c runs a whole decode step through them); each
 * defining source includes this too, so the compiler holds the two to one signature. */
#pragma once
#include <stdint.h>

void pagoda_rms_norm(void *out, const void *x, const void *weight, long rows, long n, float eps, int bf16,
                     int num_threads);
void pagoda_add_rms_norm(void *x, void *residual, const void *weight, long rows, long n, float eps, int bf16,
                         int num_threads);
void pagoda_rotary(void *x, const void *cos, const void *signed_sin, const int64_t *positions, long tokens, long heads,
                   long head_dim, long token_stride, int bf16, int num_threads);
void pagoda_silu_mul(void *out, const void *gate_up, long rows, long n, int bf16, int num_threads);
void pagoda_mul(void *x, float m, long rows, long n, int bf16, int num_threads);
void pagoda_gemm_invariant_groups(float *y, long ldy, const float *x, long ldx, const int64_t *packed,
                                  const int64_t *row0, const int64_t *rows, long groups, long n, long k,
                                  int num_threads);
void pagoda_gemm_invariant(float *y, long ldy, const float *x, long ldx, const float *packed, const float *bias, long m,
                           long n, long k, int num_threads);
void pagoda_qd_matmul(int fmt, const uint8_t *packed, const float *x, float *y, const float *bias, long m, long n,
                      long k, long tiles_from, int num_threads);
void pagoda_paged_decode_attention(float *out, const float *q, long q_stride, const float *key, long key_stride,
                                   const float *value, long value_stride, const int64_t *slots, void *k_cache,
                                   void *v_cache, const int32_t *block_tables, const int32_t *seq_lens, long batch,
                                   long num_heads, long num_kv_heads, long head_dim, long block_size,
                                   long max_blocks, float scale, int kv_bf16, int num_threads);
void pagoda_store_kv(void *k_cache, void *v_cache, const float *key, long key_stride, const float *value,
                     long value_stride, const int64_t *slots, long n, long token_stride, int kv_bf16, int num_threads);
void pagoda_prefill_attention(float *out, const float *q, long q_stride, const void *k_cache, const void *v_cache,
                              const int32_t *block_tables, const int32_t *query_start, const int32_t *seq_lens,
                              long num_reqs, long num_heads, long num_kv_heads, long head_dim,
                              long block_size, long max_blocks, float scale, int kv_bf16, int num_threads);
void pagoda_gemv_bf16(const uint16_t *w, const void *x, int x_bf16, void *y, int y_bf16, const float *bias, long n_out,
                      long k, int num_threads);
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
void pagoda_gemm_bf16(uint16_t *y, const uint16_t *x, const uint16_t *packed, const float *bias, long m, long n, long k,
                      int num_threads);
#endif
