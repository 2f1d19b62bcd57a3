/* bfloat16 kernels: the single-row GEMV of gemv.c for bf16 weights (a bf16 model's decode
 * attention is attention.c's, on its bf16 cache). Every product is accumulated in fp32; only
 * results are rounded to bf16. With AVX512-BF16, bf16 x bf16 dot products use _mm512_dpbf16_ps
 * (products exact, summed in fp32); without it, bf16 widens to fp32 by a 16-bit shift (bf16 is an
 * fp32's top half) and fp32 FMAs do the rest. bf16 values are passed as uint16_t. */
#include "vec.h"

/* round to nearest even, as torch rounds; a NaN stays a (quiet) NaN */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

static inline void store(void *y, int y_bf16, long n, float v) {
    if (y_bf16)
        ((uint16_t *)y)[n] = to_bf16(v);
    else
        ((float *)y)[n] = v;
}

static float *widen(const uint16_t *x, long n) {
    float *out = malloc(n * sizeof(float));
    for (long i = 0; i < n; i++) out[i] = load_one(x, i, 1);
    return out;
}

/* x . w for fp32 x, bf16 w; n % 8 == 0 */
static inline float dot_f32_bf16(const float *x, const uint16_t *w, long n) {
    long i = 0;
    float sum = 0.f;
#ifdef __AVX512F__
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), bf16x16(w + i), acc);
    sum = _mm512_reduce_add_ps(acc);
#endif
    __m256 acc8 = _mm256_setzero_ps();
    for (; i < n; i += 8) acc8 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), bf16x8(w + i), acc8);
    return sum + hsum(acc8);
}

#ifdef __AVX512BF16__
/* the first n (< 32 past p) bf16 values from p, zeros after */
static inline __m512bh bf16x32(const uint16_t *p, long n) {
    const __mmask32 mask = n >= 32 ? 0xffffffffu : (1u << n) - 1;
    return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

/* a . b for bf16 a and b, any n, before its horizontal sum */
static inline __m512 dot_bf16_lanes(const uint16_t *a, const uint16_t *b, long n) {
    __m512 acc = _mm512_setzero_ps();
    for (long i = 0; i < n; i += 32) acc = _mm512_dpbf16_ps(acc, bf16x32(a + i, n - i), bf16x32(b + i, n - i));
    return acc;
}

static inline float dot_bf16(const uint16_t *a, const uint16_t *b, long n) {
    return _mm512_reduce_add_ps(dot_bf16_lanes(a, b, n));
}

/* out[r] = w0[r * k, ...] . x for r < 4, x bf16 */
static inline void rows4_bf16(const uint16_t *w0, const uint16_t *x, long k, float out[4]) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    for (long i = 0; i < k; i += 32) { /* one cache line of each row per step */
        for (int r = 8; r < 12; r++) _mm_prefetch((const char *)(w0 + r * k + i), _MM_HINT_T0);
        const __m512bh xv = bf16x32(x + i, k - i);
        a0 = _mm512_dpbf16_ps(a0, bf16x32(w0 + i, k - i), xv);
        a1 = _mm512_dpbf16_ps(a1, bf16x32(w0 + k + i, k - i), xv);
        a2 = _mm512_dpbf16_ps(a2, bf16x32(w0 + 2 * k + i, k - i), xv);
        a3 = _mm512_dpbf16_ps(a3, bf16x32(w0 + 3 * k + i, k - i), xv);
    }
    out[0] = _mm512_reduce_add_ps(a0), out[1] = _mm512_reduce_add_ps(a1);
    out[2] = _mm512_reduce_add_ps(a2), out[3] = _mm512_reduce_add_ps(a3);
}
#endif

/* out[r] = w0[r * k, ...] . x for r < 4, x fp32; k % 8 == 0 */
static inline void rows4_f32(const uint16_t *w0, const float *x, long k, float out[4]) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    long i = 0;
#ifdef __AVX512F__
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps(), b2 = _mm512_setzero_ps(), b3 = _mm512_setzero_ps();
    for (; i + 32 <= k; i += 32) {
        for (int r = 8; r < 12; r++) _mm_prefetch((const char *)(w0 + r * k + i), _MM_HINT_T0);
        for (long j = i; j < i + 32; j += 16) {
            const __m512 xv = _mm512_loadu_ps(x + j);
            b0 = _mm512_fmadd_ps(bf16x16(w0 + j), xv, b0);
            b1 = _mm512_fmadd_ps(bf16x16(w0 + k + j), xv, b1);
            b2 = _mm512_fmadd_ps(bf16x16(w0 + 2 * k + j), xv, b2);
            b3 = _mm512_fmadd_ps(bf16x16(w0 + 3 * k + j), xv, b3);
        }
    }
#else
    for (; i + 32 <= k; i += 32) {
        for (int r = 8; r < 12; r++) _mm_prefetch((const char *)(w0 + r * k + i), _MM_HINT_T0);
        for (long j = i; j < i + 32; j += 8) {
            const __m256 xv = _mm256_loadu_ps(x + j);
            a0 = _mm256_fmadd_ps(bf16x8(w0 + j), xv, a0);
            a1 = _mm256_fmadd_ps(bf16x8(w0 + k + j), xv, a1);
            a2 = _mm256_fmadd_ps(bf16x8(w0 + 2 * k + j), xv, a2);
            a3 = _mm256_fmadd_ps(bf16x8(w0 + 3 * k + j), xv, a3);
        }
    }
#endif
    for (; i < k; i += 8) {
        const __m256 xv = _mm256_loadu_ps(x + i);
        a0 = _mm256_fmadd_ps(bf16x8(w0 + i), xv, a0);
        a1 = _mm256_fmadd_ps(bf16x8(w0 + k + i), xv, a1);
        a2 = _mm256_fmadd_ps(bf16x8(w0 + 2 * k + i), xv, a2);
        a3 = _mm256_fmadd_ps(bf16x8(w0 + 3 * k + i), xv, a3);
    }
    out[0] = hsum(a0), out[1] = hsum(a1), out[2] = hsum(a2), out[3] = hsum(a3);
#ifdef __AVX512F__
    out[0] += _mm512_reduce_add_ps(b0), out[1] += _mm512_reduce_add_ps(b1);
    out[2] += _mm512_reduce_add_ps(b2), out[3] += _mm512_reduce_add_ps(b3);
#endif
}

/* y[n] = w[n, :] . x (+ bias[n]) for n < n_out: w bf16 row-major [n_out, k], k % 8 == 0; x bf16
 * (x_bf16) or fp32; bias fp32 or NULL; y bf16 (y_bf16) or fp32. As in gemv.c: four rows at a time,
 * each thread a contiguous share of the rows, the rows two blocks ahead prefetched. A bf16 x meets
 * dpbf16 where there is one; otherwise x is used (or widened once) as fp32, so fp32 activations
 * keep their precision. */
void pagoda_gemv_bf16(const uint16_t *w, const void *x, int x_bf16, void *y, int y_bf16, const float *bias, long n_out,
                      long k, int num_threads) {
#ifdef __AVX512BF16__
    const int dp = x_bf16;
#else
    const int dp = 0;
#endif
    float *widened = x_bf16 && !dp ? widen(x, k) : NULL;
    const float *xf = x_bf16 ? widened : x;
    const long blocks = n_out / 4;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (long blk = 0; blk < blocks; blk++) {
        float out[4];
#ifdef __AVX512BF16__
        if (dp)
            rows4_bf16(w + 4 * blk * k, x, k, out);
        else
#endif
            rows4_f32(w + 4 * blk * k, xf, k, out);
        for (int r = 0; r < 4; r++) store(y, y_bf16, 4 * blk + r, out[r] + (bias ? bias[4 * blk + r] : 0.f));
    }
    for (long n = 4 * blocks; n < n_out; n++) {
#ifdef __AVX512BF16__
        const float v = dp ? dot_bf16(w + n * k, x, k) : dot_f32_bf16(xf, w + n * k, k);
#else
        const float v = dot_f32_bf16(xf, w + n * k, k);
#endif
        store(y, y_bf16, n, v + (bias ? bias[n] : 0.f));
    }
    free(widened);
}
