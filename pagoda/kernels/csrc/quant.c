/* Linear layers on quantized weights, read in place: GGUF's Q4_0, Q4_1 and Q8_0 blocks, and int8
 * with one float scale per output row (I8). Activations and sums are float32: each weight is
 * dequantized in registers (GEMV) or into a small per-thread panel (GEMM), never into a copy of
 * the whole matrix, so the result is x @ dequantize(w).T up to float rounding.
 *
 * Layout (GGUF's): a weight [n, k] is n rows of k / 32 blocks, each block 32 consecutive columns:
 *   Q4_0  fp16 d, 16 bytes of 4-bit codes q   w = d * (q - 8)
 *   Q4_1  fp16 d, fp16 m, 16 bytes of codes    w = d * q + m
 *   Q8_0  fp16 d, 32 int8 codes                w = d * q
 * Byte j of a 4-bit block holds column j in its low nibble and column j + 16 in its high one.
 *   I8    a row is k int8 codes, scale[row] float: w = scale[row] * q (k any size).
 * Block formats need k % 32 == 0 (GGUF guarantees it). */
#include "vec.h"

enum { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2, I8 = 3 };
#define QK 32
#define NV (QK / VLEN) /* vectors per block */

static inline long block_bytes(int fmt) { return fmt == Q4_0 ? 18 : fmt == Q4_1 ? 20 : 34; }
static inline long row_bytes(int fmt, long k) { return fmt == I8 ? k : k / QK * block_bytes(fmt); }

static inline float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

#if VLEN == 16
static inline vec u8_to_vec(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)); }
static inline vec i8_to_vec(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
#else
static inline vec u8_to_vec(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)); }
static inline vec i8_to_vec(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#endif

/* The 32 codes of a block as floats, columns in order (4-bit codes 0..15, int8 codes as signed). */
static inline void block_codes(int fmt, const uint8_t *block, vec v[NV]) {
    if (fmt == Q8_0) {
        for (int j = 0; j < NV; j++) v[j] = i8_to_vec((const int8_t *)block + 2 + j * VLEN);
        return;
    }
    const __m128i bytes = _mm_loadu_si128((const __m128i *)(block + (fmt == Q4_0 ? 2 : 4)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(bytes, mask), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
#if VLEN == 16
    v[0] = u8_to_vec(lo);
    v[1] = u8_to_vec(hi);
#else
    v[0] = u8_to_vec(lo);
    v[1] = u8_to_vec(_mm_srli_si128(lo, 8));
    v[2] = u8_to_vec(hi);
    v[3] = u8_to_vec(_mm_srli_si128(hi, 8));
#endif
}

/* A block's weights are d * code + c: (d, c) per format. */
static inline void block_affine(int fmt, const uint8_t *block, float *d, float *c) {
    *d = f16_at(block);
    *c = fmt == Q4_0 ? -8.f * *d : fmt == Q4_1 ? f16_at(block + 2) : 0.f;
}

/* d * (codes . x_block) + c * sum(x_block) of block b as a vector plus a scalar */
static inline __attribute__((always_inline)) vec block_dot(int fmt, const uint8_t *block, const float *xb, float xsum,
                                                           float *offset) {
    vec codes[NV];
    block_codes(fmt, block, codes);
    vec s = vmul(codes[0], vload(xb));
    for (int j = 1; j < NV; j++) s = vfmadd(codes[j], vload(xb + j * VLEN), s);
    float d, c;
    block_affine(fmt, block, &d, &c);
    *offset += c * xsum;
    return vmul(s, vset(d));
}

/* w[row] . x for a block-format row: sum over blocks of d * (codes . x_block) + c * sum(x_block),
 * with xsum[b] = sum(x_block b) precomputed. Two blocks a step, in two chains, hide FMA latency. */
static inline __attribute__((always_inline)) float row_dot_blocks(int fmt, const uint8_t *row, const float *x,
                                                                  const float *xsum, long nb) {
    const long bb = block_bytes(fmt);
    vec acc0 = vset(0.f), acc1 = vset(0.f);
    float off0 = 0.f, off1 = 0.f;
    long b = 0;
    for (; b + 2 <= nb; b += 2) {
        acc0 = vadd(acc0, block_dot(fmt, row + b * bb, x + b * QK, xsum[b], &off0));
        acc1 = vadd(acc1, block_dot(fmt, row + (b + 1) * bb, x + (b + 1) * QK, xsum[b + 1], &off1));
    }
    if (b < nb) acc0 = vadd(acc0, block_dot(fmt, row + b * bb, x + b * QK, xsum[b], &off0));
    return vsum(vadd(acc0, acc1)) + off0 + off1;
}

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

/* y[n] = dequantize(w)[n, :] . x (+ bias[n]): one row of activations, the weights streamed once,
 * each thread a contiguous share of the rows. */
void pagoda_q_gemv(int fmt, const uint8_t *w, const float *scales, const float *x, float *y, const float *bias,
                   long n, long k, int num_threads) {
    const long nb = fmt == I8 ? 0 : k / QK, rb = row_bytes(fmt, k);
    float *xsum = malloc(sizeof(float) * (nb + 1));
    for (long b = 0; b < nb; b++) {
        float s = 0.f;
        for (int j = 0; j < QK; j++) s += x[b * QK + j];
        xsum[b] = s;
    }
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (long r = 0; r < n; r++) {
        const uint8_t *row = w + r * rb;
        float v;
        if (fmt == I8) v = scales[r] * row_dot_i8((const int8_t *)row, x, k);
        else if (fmt == Q4_0) v = row_dot_blocks(Q4_0, row, x, xsum, nb);
        else if (fmt == Q4_1) v = row_dot_blocks(Q4_1, row, x, xsum, nb);
        else v = row_dot_blocks(Q8_0, row, x, xsum, nb);
        y[r] = v + (bias ? bias[r] : 0.f);
    }
    free(xsum);
}

/* One row of dequantize(w) as k floats */
static void dequant_row(int fmt, const uint8_t *row, float scale, long k, float *out) {
    if (fmt == I8) {
        const int8_t *q = (const int8_t *)row;
        long i = 0;
        for (; i + VLEN <= k; i += VLEN) vstore(out + i, vmul(i8_to_vec(q + i), vset(scale)));
        for (; i < k; i++) out[i] = scale * q[i];
        return;
    }
    const long bb = block_bytes(fmt);
    for (long b = 0; b < k / QK; b++) {
        vec codes[NV];
        float d, c;
        block_codes(fmt, row + b * bb, codes);
        block_affine(fmt, row + b * bb, &d, &c);
        for (int j = 0; j < NV; j++) vstore(out + b * QK + j * VLEN, vfmadd(codes[j], vset(d), vset(c)));
    }
}

/* out[i, :] = dequantize(w)[ids[i], :] (an embedding lookup) */
void pagoda_q_dequant_rows(int fmt, const uint8_t *w, const float *scales, const int64_t *ids, long count, long k,
                           float *out, int num_threads) {
    const long rb = row_bytes(fmt, k);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (long i = 0; i < count; i++) dequant_row(fmt, w + ids[i] * rb, scales ? scales[ids[i]] : 1.f, k, out + i * k);
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
void pagoda_q_gemm(int fmt, const uint8_t *w, const float *scales, const float *x, float *y, const float *bias,
                   long m, long n, long k, int num_threads) {
    const long rb = row_bytes(fmt, k), panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel num_threads(num_threads)
    {
        float *wp = aligned_alloc(64, sizeof(float) * PANEL * ((k + 15) / 16 * 16));
#pragma omp for schedule(static)
        for (long p = 0; p < panels; p++) {
            const long r0 = p * PANEL, rows = n - r0 < PANEL ? n - r0 : PANEL;
            for (long j = 0; j < PANEL; j++) {
                if (j < rows) dequant_row(fmt, w + (r0 + j) * rb, scales ? scales[r0 + j] : 1.f, k, wp + j * k);
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
