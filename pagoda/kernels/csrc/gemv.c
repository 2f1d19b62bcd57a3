/* Single-row GEMV: a decode step at batch 1 streams every weight once; reading each thread's rows
 * front to back with software prefetch gets closer to memory bandwidth than the BLAS. */
#include "common.h"

/* y[n] = w[n, :] . x (+ bias[n]) for n < n_out: w row-major [n_out, k], k % 8 == 0. Four rows at a
 * time, each thread a contiguous share of the rows, the rows two blocks ahead prefetched as it goes
 * (one cache line of each per 16 columns). */
#define GEMV_STEP(i)                                                                              \
    do {                                                                                          \
        const __m256 xv = _mm256_loadu_ps(x + (i));                                               \
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + (i)), xv, a0);                                  \
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + k + (i)), xv, a1);                              \
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + 2 * k + (i)), xv, a2);                          \
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + 3 * k + (i)), xv, a3);                          \
    } while (0)

void pagoda_gemv(const float *w, const float *x, float *y, const float *bias, long n_out, long k, int num_threads) {
    const long blocks = n_out / 4;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (long blk = 0; blk < blocks; blk++) {
        const float *w0 = w + 4 * blk * k;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
        long i = 0;
        for (; i + 16 <= k; i += 16) {
            for (int r = 8; r < 12; r++) _mm_prefetch((const char *)(w0 + r * k + i), _MM_HINT_T0);
            GEMV_STEP(i);
            GEMV_STEP(i + 8);
        }
        if (i < k) GEMV_STEP(i);
        const long n = 4 * blk;
        y[n] = hsum(a0) + (bias ? bias[n] : 0.f);
        y[n + 1] = hsum(a1) + (bias ? bias[n + 1] : 0.f);
        y[n + 2] = hsum(a2) + (bias ? bias[n + 2] : 0.f);
        y[n + 3] = hsum(a3) + (bias ? bias[n + 3] : 0.f);
    }
    for (long n = 4 * blocks; n < n_out; n++) y[n] = dot(w + n * k, x, k) + (bias ? bias[n] : 0.f);
}

