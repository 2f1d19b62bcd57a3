/* bfloat16 kernels: the single-row GEMV of gemv.c for bf16 weights (a bf16 model's decode
 * attention is attention.c's, on its bf16 cache). Every product is accumulated in fp32; only
 * results are rounded to bf16. With AVX512-BF16, bf16 x bf16 dot products use _mm512_dpbf16_ps
 * (products exact, summed in fp32); without it, bf16 widens to fp32 by a 16-bit shift (bf16 is an
 * fp32's top half) and fp32 FMAs do the rest. bf16 values are passed as uint16_t. */
#include "vec.h"
#include "kernels.h"

static inline void store(void *y, int y_bf16, long n, float v) {
    if (y_bf16)
        ((uint16_t *)y)[n] = bf16_of(v);
    else
        ((float *)y)[n] = v;
}

static float *widen(const uint16_t *x, long n) {
    float *out = malloc(n * sizeof(float));
    bf16_to_floats(out, x, n);
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

#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
/* The bf16 GEMM on AMX tiles, for 2 or more rows (one row is the GEMV above): y [m, n] bf16 =
 * x [m, k] bf16 @ w.T + bias (fp32 or NULL), k % 32 == 0, every product summed in fp32 by the tile
 * unit and rounded to bf16 once, to nearest even (as torch rounds).
 *
 * The weight is packed once into B tiles: columns in panels of 16, panels in pairs (a pair is the
 * microkernel's width; a last odd panel gets a zero partner), k in blocks of 32. Block kb of panel p
 * is one tile of 16 rows x 64 bytes at packed + (p * kbs + kb) * 512, row i holding the 16 columns'
 * values k = 32 kb + 2i and 2i + 1 side by side: AMX's pair layout for B. A tile of x is 16 rows x
 * 32 values read in place (its rows k apart); a last partial 16 rows are copied into zeroed rows
 * first, so no tile reads past x. */
#define BF16_PANEL 16
#define BF16_KB 32
#define ROW_CHUNK 256 /* rows against each pair in turn: x's share stays in L2 (0.97x at 1,024 rows) */

long pagoda_bf16_tiles_size(long n, long k) {
    const long pairs = (n + 2 * BF16_PANEL - 1) / (2 * BF16_PANEL);
    return pairs * 2 * BF16_PANEL * k; /* uint16 values */
}

void pagoda_bf16_pack_tiles(uint16_t *out, const uint16_t *w, long n, long k, int num_threads) {
    const long panels = pagoda_bf16_tiles_size(n, k) / (BF16_PANEL * k), kbs = k / BF16_KB;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (long p = 0; p < panels; p++)
        for (long kb = 0; kb < kbs; kb++) {
            uint16_t *tile = out + (p * kbs + kb) * 512;
            for (long i = 0; i < 16; i++)
                for (long j = 0; j < BF16_PANEL; j++) {
                    const long col = p * BF16_PANEL + j, kk = kb * BF16_KB + 2 * i;
                    tile[i * 32 + 2 * j] = col < n ? w[col * k + kk] : 0;
                    tile[i * 32 + 2 * j + 1] = col < n ? w[col * k + kk + 1] : 0;
                }
        }
}

/* C tiles 0, 1 (rows 0-15) and 2, 3 (rows 16-31) for the two panels; A tiles 4, 5; B tiles 6, 7 */
static void bf16_tiles_configure(void) {
    tile_config c = {0};
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = 16, c.colsb[t] = 64;
    _tile_loadconfig(&c);
}

/* c [32][32] fp32 = the x rows at a (ma tiles of 16 rows, lda values apart) . the panel pair at b;
 * `next` (or NULL): the pair to prefetch into L2 meanwhile, a kb's share at a time (the weights
 * stream from memory at small m: 0.81-0.84x the time at 2-32 rows, 0.9x at 64-280) */
static inline __attribute__((always_inline)) void pair_product(const uint16_t *a, long lda, const uint16_t *b,
                                                               long kbs, int ma, float c[32][32], const uint16_t *next) {
    const uint16_t *b1 = b + kbs * 512;
    _tile_zero(0);
    _tile_zero(1);
    if (ma == 2) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (long kb = 0; kb < kbs; kb++) {
        if (next)
            for (int l = 0; l < 2 * 512; l += 32) _mm_prefetch((const char *)(next + 2 * kb * 512 + l), _MM_HINT_T1);
        _tile_loadd(6, b + kb * 512, 64);
        _tile_loadd(7, b1 + kb * 512, 64);
        _tile_loadd(4, a + kb * BF16_KB, lda * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (ma == 2) {
            _tile_loadd(5, a + 16 * lda + kb * BF16_KB, lda * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, c[0], 128);
    _tile_stored(1, c[0] + 16, 128);
    if (ma == 2) {
        _tile_stored(2, c[16], 128);
        _tile_stored(3, c[16] + 16, 128);
    }
}

/* rows r < rows and columns j < cols of c, + bias, rounded into y (rows ldy apart) */
static inline void pair_out(const float c[32][32], long rows, long cols, const float *bias, uint16_t *y, long ldy) {
    for (long h = 0; h * 16 < cols; h++) {
        const long left = cols - h * 16;
        const __mmask16 mask = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + h * 16) : _mm512_setzero_ps();
        for (long r = 0; r < rows; r++) {
            const __m256bh v = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(c[r] + h * 16), b));
            _mm256_mask_storeu_epi16(y + r * ldy + h * 16, mask, (__m256i)v);
        }
    }
}

/* Every row block against a pair while the pair is in cache. With up to 32 rows (a decode step,
 * whose weights stream from memory) each thread takes a contiguous share of the pairs; with more,
 * pairs go one at a time to whichever thread is free (a core the server takes for a moment leaves
 * no thread waiting at the barrier: docs/engine.md). */
void pagoda_gemm_bf16(uint16_t *y, const uint16_t *x, const uint16_t *packed, const float *bias, long m, long n, long k,
                      int num_threads) {
    const long kbs = k / BF16_KB, pairs = pagoda_bf16_tiles_size(n, k) / (2 * BF16_PANEL * k);
    const long full = m / 16 * 16, tail = m - full;
    const long chunk = m <= 32 ? (pairs + num_threads - 1) / num_threads : 1;
    uint16_t *tail_rows = NULL; /* the last partial 16 rows, zero past m */
    if (tail) {
        tail_rows = aligned_alloc(64, 16 * k * sizeof(uint16_t));
        memset(tail_rows, 0, 16 * k * sizeof(uint16_t));
        memcpy(tail_rows, x + full * k, tail * k * sizeof(uint16_t));
    }
#pragma omp parallel num_threads(num_threads)
    {
        bf16_tiles_configure();
        __attribute__((aligned(64))) float c[32][32];
        for (long r0 = 0; r0 < m; r0 += ROW_CHUNK) {
            const long r1 = r0 + ROW_CHUNK < full ? r0 + ROW_CHUNK : full;
#pragma omp for schedule(dynamic, chunk)
            for (long pair = 0; pair < pairs; pair++) {
                const uint16_t *b = packed + pair * 2 * kbs * 512;
                const long col0 = pair * 2 * BF16_PANEL, cols = n - col0 < 2 * BF16_PANEL ? n - col0 : 2 * BF16_PANEL;
                const float *pb = bias ? bias + col0 : NULL;
                const uint16_t *next = pair + 1 < pairs ? b + 2 * kbs * 512 : NULL;
                long r = r0;
                for (; r + 32 <= r1; r += 32, next = NULL) {
                    pair_product(x + r * k, k, b, kbs, 2, c, next);
                    pair_out(c, 32, cols, pb, y + r * n + col0, n);
                }
                if (r < r1) {
                    pair_product(x + r * k, k, b, kbs, 1, c, next);
                    next = NULL;
                    pair_out(c, 16, cols, pb, y + r * n + col0, n);
                }
                if (tail && r0 + ROW_CHUNK >= m) {
                    pair_product(tail_rows, k, b, kbs, 1, c, next);
                    pair_out(c, tail, cols, pb, y + full * n + col0, n);
                }
            }
        }
        _tile_release();
    }
    free(tail_rows);
}
#endif
