/* Batch-invariant fp32 GEMM: y = x @ w.T (+ bias) where every output is summed in one fixed order,
 * acc = fma(x[m, K-1], w[n, K-1], ... fma(x[m, 0], w[n, 0], 0)), then + bias[n]. That order depends
 * on K only: not on how many rows the call has, how they are tiled, or how many threads share them,
 * so a row's result is bitwise the same alone (a decode at batch 1) as among 1,000 prefill rows.
 *
 * The weight is packed once into panels of PANEL output columns, k-major within a panel
 * (panel p: [K][PANEL], columns past N zero), so that the inner loop broadcasts one x value and
 * multiplies it into whole vectors of columns: no horizontal sums, and a single row streams the
 * panels front to back as a GEMV does. */
#include "vec.h"
#include "kernels.h"

#define PANEL 16
#define PV (PANEL / VLEN)
#define MR 6 /* a tile: MR rows x NP panels */
#ifdef __AVX512F__
#define NP 4 /* 24 accumulators of 32 registers */
#else
#define NP 1 /* 12 accumulators of 16 registers */
#endif
#define MB (16 * MR) /* the most rows per work item: a thread reuses its panels over them from its cache */

/* out[p][kk][j] = w[p * PANEL + j][kk] for column p * PANEL + j < n, else 0; w row-major [n, k] */
void pagoda_pack_panels(float *out, const float *w, long n, long k, int num_threads) {
    const long panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (long p = 0; p < panels; p++)
        for (long kk = 0; kk < k; kk++)
            for (long j = 0; j < PANEL; j++) {
                const long col = p * PANEL + j;
                out[(p * k + kk) * PANEL + j] = col < n ? w[col * k + kk] : 0.f;
            }
}

/* y[r, c] for rows r < mr of x and the columns of np panels from `panels`; `cols` of them are
 * written (the last panel of the matrix may be partial). Inlined with constant mr and np. */
static inline __attribute__((always_inline)) void tile(float *y, long ldy, const float *x, long ldx, const float *panels,
                                                       const float *bias, long k, long cols, long mr, long np) {
    vec acc[MR][NP * PV];
    for (long r = 0; r < mr; r++)
        for (long c = 0; c < np * PV; c++) acc[r][c] = vset(0.f);
    for (long kk = 0; kk < k; kk++) {
        vec w[NP * PV];
        for (long p = 0; p < np; p++)
            for (long v = 0; v < PV; v++) w[p * PV + v] = vload(panels + (p * k + kk) * PANEL + v * VLEN);
        for (long r = 0; r < mr; r++) {
            const vec xv = vset(x[r * ldx + kk]);
            for (long c = 0; c < np * PV; c++) acc[r][c] = vfmadd(xv, w[c], acc[r][c]);
        }
    }
    for (long c = 0; c < np * PV && c * VLEN < cols; c++) {
        const long n = cols - c * VLEN;
        const vec b = bias ? load_n(bias + c * VLEN, n) : vset(0.f);
        for (long r = 0; r < mr; r++) store_n(y + r * ldy + c * VLEN, vadd(acc[r][c], b), n);
    }
}

#define TILE_NP(mr, np)                                                                                                \
    case np:                                                                                                           \
        tile(y, ldy, x, ldx, panels, bias, k, cols, mr, np);                                                           \
        return
#if NP == 4
#define TILE_WIDE(mr) TILE_NP(mr, 2); TILE_NP(mr, 3); TILE_NP(mr, 4);
#else
#define TILE_WIDE(mr)
#endif
#define TILE_MR(mr)                                                                                                    \
    case mr:                                                                                                           \
        switch (np) {                                                                                                  \
            TILE_NP(mr, 1);                                                                                            \
            TILE_WIDE(mr)                                                                                              \
        }                                                                                                              \
        return

/* tile() specialized for each mr <= MR and np <= NP */
static void tile_any(float *y, long ldy, const float *x, long ldx, const float *panels, const float *bias, long k,
                     long cols, long mr, long np) {
    switch (mr) {
        TILE_MR(1);
        TILE_MR(2);
        TILE_MR(3);
        TILE_MR(4);
        TILE_MR(5);
        TILE_MR(6);
    }
}

/* y [m, n] (rows ldy floats apart) = x [m, k] (rows ldx apart) @ w.T (+ bias [n]), w packed by
 * pagoda_pack_panels. Work items are blocks of rows by `group` panels: as few row blocks as MB
 * allows, of equal size (whole tiles), since each streams the panels it meets from memory again
 * (a 53-row hit step as one block of 53 rather than 48 + 5 took 0.82-0.88x the time over the
 * default model's linears); fewer panels per item where that leaves too few items to share out
 * (a decode step still has an item per thread). */
void pagoda_gemm_invariant(float *y, long ldy, const float *x, long ldx, const float *packed, const float *bias, long m,
                           long n, long k, int num_threads) {
    const long panels = (n + PANEL - 1) / PANEL, row_blocks = (m + MB - 1) / MB;
    const long block_rows = ((m + row_blocks - 1) / row_blocks + MR - 1) / MR * MR;
    long group = NP;
    while (group > 1 && row_blocks * ((panels + group - 1) / group) < 4 * num_threads) group /= 2;
    const long groups = (panels + group - 1) / group, items = groups * row_blocks;
    const long chunk = m <= MR ? (items + num_threads - 1) / num_threads : 1;
#pragma omp parallel for schedule(dynamic, chunk) num_threads(num_threads)
    for (long item = 0; item < items; item++) {
        const long g = item / row_blocks, rb = item % row_blocks; /* consecutive items share panels */
        const long p0 = g * group, np = p0 + group <= panels ? group : panels - p0;
        const long col0 = p0 * PANEL, cols = (col0 + np * PANEL <= n ? np * PANEL : n - col0);
        const long r1 = (rb + 1) * block_rows < m ? (rb + 1) * block_rows : m;
        for (long r = rb * block_rows; r < r1; r += MR) {
            const long mr = r + MR <= r1 ? MR : r1 - r;
            tile_any(y + r * ldy + col0, ldy, x + r * ldx, ldx, packed + p0 * k * PANEL, bias ? bias + col0 : NULL, k,
                     cols, mr, np);
        }
    }
}
