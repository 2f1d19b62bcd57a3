/* Linear layers on int8 weights with one float scale per output row (`--quantization int8`),
 * read in place: a weight [n, k] is n rows of k int8 codes, w = scale[row] * q (k any size).
 * Activations and sums are float32: each weight is dequantized in registers (GEMV) or into a small
 * per-thread panel (GEMM), never into a copy of the whole matrix, so the result is
 * x @ dequantize(w).T up to float rounding. (GGUF's block formats: qdot.c.) */
#include "vec.h"

#if VLEN == 16
static inline vec i8_to_vec(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
#else
static inline vec i8_to_vec(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#endif

/* codes . x for an int8 row of any length (the scale applied by the caller) */
static inline float row_dot_i8(const int8_t *row, const float *x, long k) {
    vec acc[2] = {vset(0.f), vset(0.f)};
    long i = 0;
    for (; i + 2 * VLEN <= k; i += 2 * VLEN) {
        acc[0] = vfmadd(i8_to_vec(row + i), vload(x + i), acc[0]);
        acc[1] = vfmadd(i8_to_vec(row + i + VLEN), vload(x + i + VLEN), acc[1]);
    }
    float sum = vsum(vadd(acc[0], acc[1]));
    for (; i < k; i++) sum += (float)row[i] * x[i];
    return sum;
}

/* y[n] = scale[n] * (w[n, :] . x) (+ bias[n]): one row of activations, the weights streamed once,
 * each thread a contiguous share of the rows. */
void pagoda_i8_gemv(const int8_t *w, const float *scales, const float *x, float *y, const float *bias, long n, long k,
                    int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (long r = 0; r < n; r++) y[r] = scales[r] * row_dot_i8(w + r * k, x, k) + (bias ? bias[r] : 0.f);
}

/* One row of dequantize(w) as k floats */
static void dequant_row(const int8_t *q, float scale, long k, float *out) {
    long i = 0;
    for (; i + VLEN <= k; i += VLEN) vstore(out + i, vmul(i8_to_vec(q + i), vset(scale)));
    for (; i < k; i++) out[i] = scale * q[i];
}

/* out[i, :] = dequantize(w)[ids[i], :] (an embedding lookup) */
void pagoda_i8_dequant_rows(const int8_t *w, const float *scales, const int64_t *ids, long count, long k, float *out,
                            int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (long i = 0; i < count; i++) dequant_row(w + ids[i] * k, scales[ids[i]], k, out + i * k);
}

/* The GEMM: each thread takes panels of PANEL weight rows, dequantizes a panel once into its own
 * float buffer (PANEL * k floats, cache-resident), and multiplies every activation row by it in
 * tiles of TM activation rows x TN weight rows (TM * TN vector accumulators over k). */
#define PANEL 16
#define TM 4
#if VLEN == 16
#define TN 4
#else
#define TN 2 /* AVX2's 16 registers */
#endif

/* y[i, j] for i < tm (tm = TM, or 1 for the tail) and j < TN, of x rows i and panel rows j */
static inline __attribute__((always_inline)) void tile(int tm, const float *x, long ldx, const float *wp, long k,
                                                        float *out) {
    vec acc[TM][TN];
    for (int i = 0; i < tm; i++)
        for (int j = 0; j < TN; j++) acc[i][j] = vset(0.f);
    long c = 0;
    for (; c + VLEN <= k; c += VLEN) {
        vec wv[TN];
        for (int j = 0; j < TN; j++) wv[j] = vload(wp + j * k + c);
        for (int i = 0; i < tm; i++) {
            const vec xv = vload(x + i * ldx + c);
            for (int j = 0; j < TN; j++) acc[i][j] = vfmadd(xv, wv[j], acc[i][j]);
        }
    }
    if (c < k) {
        vec wv[TN];
        for (int j = 0; j < TN; j++) wv[j] = load_n(wp + j * k + c, k - c);
        for (int i = 0; i < tm; i++) {
            const vec xv = load_n(x + i * ldx + c, k - c);
            for (int j = 0; j < TN; j++) acc[i][j] = vfmadd(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < tm; i++)
        for (int j = 0; j < TN; j++) out[i * TN + j] = vsum(acc[i][j]);
}

/* y [m, n] = x [m, k] @ dequantize(w).T (+ bias), all float32 and contiguous. */
void pagoda_i8_gemm(const int8_t *w, const float *scales, const float *x, float *y, const float *bias, long m, long n,
                    long k, int num_threads) {
    const long panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel num_threads(num_threads)
    {
        float *wp = aligned_alloc(64, sizeof(float) * PANEL * ((k + 15) / 16 * 16));
#pragma omp for schedule(static)
        for (long p = 0; p < panels; p++) {
            const long r0 = p * PANEL, rows = n - r0 < PANEL ? n - r0 : PANEL;
            for (long j = 0; j < PANEL; j++) {
                if (j < rows) dequant_row(w + (r0 + j) * k, scales[r0 + j], k, wp + j * k);
                else memset(wp + j * k, 0, sizeof(float) * k);
            }
            for (long i = 0; i < m;) { /* TM activation rows at a time against the panel, the rest one by one */
                const int tm = m - i >= TM ? TM : 1;
                for (long j0 = 0; j0 < rows; j0 += TN) {
                    float out[TM * TN];
                    if (tm == TM) tile(TM, x + i * k, k, wp + j0 * k, k, out);
                    else tile(1, x + i * k, k, wp + j0 * k, k, out);
                    for (int a = 0; a < tm; a++)
                        for (int b = 0; b < TN && j0 + b < rows; b++)
                            y[(i + a) * n + r0 + j0 + b] = out[a * TN + b] + (bias ? bias[r0 + j0 + b] : 0.f);
                }
                i += tm;
            }
        }
        free(wp);
    }
}
