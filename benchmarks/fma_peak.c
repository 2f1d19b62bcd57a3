/* The float32 FMA peak of one core: 24 independent chains of AVX-512 (or, without it, 12 of AVX2)
 * fused multiply-adds, as many as a GEMM's register tile keeps in flight. What the float32 GEMMs
 * are measured against (docs/engine.md); run one copy per core at once for the machine's peak.
 *
 *   gcc -O2 -march=native benchmarks/fma_peak.c -o /tmp/fma_peak && /tmp/fma_peak
 */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#ifdef __AVX512F__
#define CHAINS 24
typedef __m512 vec;
#define LANES 16
#define vset _mm512_set1_ps
#define vfmadd _mm512_fmadd_ps
#define vsum _mm512_reduce_add_ps
#else
#define CHAINS 12
typedef __m256 vec;
#define LANES 8
#define vset _mm256_set1_ps
#define vfmadd _mm256_fmadd_ps
static float vsum(__m256 v) {
    float out[8], s = 0.f;
    _mm256_storeu_ps(out, v);
    for (int i = 0; i < 8; i++) s += out[i];
    return s;
}
#endif

int main(void) {
    vec acc[CHAINS];
    const vec x = vset(1.0000001f), y = vset(0.9999999f);
    for (int i = 0; i < CHAINS; i++) acc[i] = vset((float)i);
    const long iters = 200000000;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long it = 0; it < iters; it++) {
#pragma GCC unroll 24
        for (int i = 0; i < CHAINS; i++) acc[i] = vfmadd(acc[i], x, y);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    const double seconds = (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec);
    float sum = 0.f; /* used, so the loop is kept */
    for (int i = 0; i < CHAINS; i++) sum += vsum(acc[i]);
    printf("%.1f GFLOP/s on one core (%d-lane FMAs; checksum %g)\n", iters * CHAINS * LANES * 2.0 / seconds / 1e9,
           LANES, sum);
    return 0;
}
