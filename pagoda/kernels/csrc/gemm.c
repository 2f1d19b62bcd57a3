/* Batch-invariant fp32 GEMM: y = x @ w.T (+ bias) where every output is summed in one fixed order,
 * acc = fma(x[m, K-1], w[n, K-1], ... fma(x[m, 0], w[n, 0], 0)), then + bias[n]. That order depends
 * on K only: not on how many rows the call has, how they are tiled, or how many threads share them,
 * so a row's result is bitwise the same alone (a decode at batch 1) as among 1,000 prefill rows.
 *
 * The weight is packed once into panels of PANEL output columns, k-major within a panel
 * (panel p: [K][PANEL], columns past N zero), so that the inner loop broadcasts one x value and
 * multiplies it into whole vectors of columns: no horizontal sums, and a single row streams the
 * panels front to back as a GEMV does. */
#include <omp.h>

#include "vec.h"
#include "kernels.h"

#define PANEL 16
#define PV (PANEL / VLEN)
/* a tile: MR rows x NP panels. With AVX-512, 8 x 3 (24 accumulators of 32 registers) rather than
 * 6 x 4, which loads less a k step: a decode step's 8 to 32 rows then fill whole tiles or nearly
 * (0.93-0.95x the time at 8-32 rows over the default model's linears, the same from 53 rows on). */
#ifdef __AVX512F__
#define MR 8
#define NP 3
#else
#define MR 6
#define NP 1 /* 12 accumulators of 16 registers */
#endif
#define MB (16 * MR) /* the most rows per work item: a thread reuses its panels over them from its cache */
/* k steps ahead that a tile fetches each panel's line into L1 (a k step reads one line a panel;
 * the last steps' fetches run past the panel, harmless: prefetches never fault). A tile's panels
 * (np x k x 64 bytes) outgrow L1, so every tile reads them again from L2 (the first from memory),
 * streams the hardware prefetchers do not keep far enough ahead. With the 8 x 3 tiles, 0.87-0.96x
 * the time at 1-96 rows over the default model's linears, 0.99x at 288-1,024
 * (benchmarks/results/gemm_l1/gemm_invariant_ab_recheck.txt); eight or 16 ahead alike; fetching
 * x's rows likewise was slower. */
#define L1_AHEAD 16
/* Where a work item has at most FEW_TILES tiles (up to 64 rows), the next item's panels are
 * prefetched as STREAMS streams side by side (its quarters, a line of each in turn) rather than
 * front to back: the weights stream from memory faster while the tiles compute. */
#define FEW_TILES 8
#define STREAMS 4

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

/* Bytes [from, to) to prefetch into L2 while a tile is computed, per_k cache lines each k step
 * from `from` while below `to` (so the last step may run up to per_k - 1 lines past it: prefetches
 * never fault): a share of the panels the thread computes next, so that they stream from memory
 * while this work item's tiles run from the cache */
typedef struct {
    const char *from, *to;
    long per_k;
    long slot, last, per_way; /* streams: this tile's slots [slot, last), each stream per_way lines */
} Prefetch;

/* y[r, c] for rows r < mr of x and the columns of np panels from `panels`; `cols` of them are
 * written (the last panel of the matrix may be partial). Inlined with constant mr and np. */
static inline __attribute__((always_inline)) void tile(float *y, long ldy, const float *x, long ldx, const float *panels,
                                                       const float *bias, long k, long cols, long mr, long np,
                                                       const Prefetch *pf, int streams) {
    vec acc[MR][NP * PV];
    for (long r = 0; r < mr; r++)
        for (long c = 0; c < np * PV; c++) acc[r][c] = vset(0.f);
    const char *line = pf->from;
    long slot = pf->slot;
    for (long kk = 0; kk < k; kk++) {
        if (streams) /* slot s: line s / STREAMS of stream s % STREAMS */
            for (long i = 0; i < pf->per_k && slot < pf->last; i++, slot++) {
                const char *at = pf->from + ((slot % STREAMS) * pf->per_way + slot / STREAMS) * 64;
                if (at < pf->to) _mm_prefetch(at, _MM_HINT_T1);
            }
        else if (line < pf->to)
            for (long i = 0; i < pf->per_k; i++, line += 64) _mm_prefetch(line, _MM_HINT_T1);
        vec w[NP * PV];
        for (long p = 0; p < np; p++) {
            _mm_prefetch((const char *)(panels + (p * k + kk + L1_AHEAD) * PANEL), _MM_HINT_T0);
            for (long v = 0; v < PV; v++) w[p * PV + v] = vload(panels + (p * k + kk) * PANEL + v * VLEN);
        }
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
        if (pf->per_way) tile(y, ldy, x, ldx, panels, bias, k, cols, mr, np, pf, 1);                                   \
        else tile(y, ldy, x, ldx, panels, bias, k, cols, mr, np, pf, 0);                                               \
        return
#if NP == 3
#define TILE_WIDE(mr) TILE_NP(mr, 2); TILE_NP(mr, 3);
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
                     long cols, long mr, long np, const Prefetch *pf) {
    switch (mr) {
        TILE_MR(1);
        TILE_MR(2);
        TILE_MR(3);
        TILE_MR(4);
        TILE_MR(5);
        TILE_MR(6);
#if MR == 8
        TILE_MR(7);
        TILE_MR(8);
#endif
    }
}

/* tile t's share (of `tiles`) of the cache lines of `bytes` bytes at p, per_k of them a k step:
 * a contiguous run of them, or where the item has at most FEW_TILES tiles, a run of the slots of
 * STREAMS streams read in turn (tile() is specialized for each: streams, when per_way is set) */
static Prefetch tile_share(const char *p, long bytes, long t, long tiles, long k) {
    const long lines = bytes / 64;
    if (tiles <= FEW_TILES) { /* the slots of all STREAMS streams in turn, shared out */
        const long per_way = (lines + STREAMS - 1) / STREAMS, slots = per_way * STREAMS;
        const long share = (slots + tiles - 1) / tiles, first = t * share < slots ? t * share : slots;
        const long last = first + share < slots ? first + share : slots;
        return (Prefetch){p, p + bytes, (share + k - 1) / k, first, last, per_way};
    }
    const long share = (lines + tiles - 1) / tiles;
    const long first = t * share < lines ? t * share : lines, last = first + share < lines ? first + share : lines;
    return (Prefetch){p + first * 64, p + last * 64, (share + k - 1) / k, 0, 0, 0};
}

/* Work items shared out as one contiguous range per thread, which its owner takes front to back,
 * so that it knows its next item, and which other threads, once theirs is empty, take from the back:
 * a thread the machine preempted holds up nobody at the call's barrier (engine.md). A range is
 * [front, back) packed in one word, changed by compare-and-swap; a line each, not to share lines. */
typedef struct {
    _Alignas(64) uint64_t span; /* front | back << 32 */
} Range;

/* the front item of r for its owner (step 1) or the back one for another thread (step 1 << 32),
 * -1 where r is empty */
static long claim(Range *r, uint64_t step) {
    uint64_t span = __atomic_load_n(&r->span, __ATOMIC_RELAXED);
    while ((uint32_t)span < span >> 32)
        if (__atomic_compare_exchange_n(&r->span, &span, span + (step == 1 ? 1 : -step), 1, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED))
            return step == 1 ? (long)(uint32_t)span : (long)(span >> 32) - 1;
    return -1;
}

/* y [m, n] (rows ldy floats apart) = x [m, k] (rows ldx apart) @ w.T (+ bias [n]), w packed by
 * pagoda_pack_panels. Work items are blocks of rows by `group` panels: as few row blocks as MB
 * allows, of equal size (whole tiles), since each streams the panels it meets from memory again
 * (a 53-row hit step as one block of 53 rather than 48 + 5 took 0.82-0.88x the time over the
 * default model's linears); fewer panels per item where that leaves too few items to share out
 * (a decode step still has an item per thread). Consecutive items share panels (the row blocks of
 * one panel group), and a thread takes its own items in order: from two rows, while it computes
 * one it prefetches into L2 the panels of its next one where those differ, each tile an equal
 * share of them, so that the weights' reads overlap the arithmetic instead of preceding it. One
 * row's panels stream front to back, as the hardware prefetches them. */
void pagoda_gemm_invariant(float *y, long ldy, const float *x, long ldx, const float *packed, const float *bias, long m,
                           long n, long k, int num_threads) {
    const long panels = (n + PANEL - 1) / PANEL, row_blocks = (m + MB - 1) / MB;
    const long block_rows = ((m + row_blocks - 1) / row_blocks + MR - 1) / MR * MR;
    long group = NP;
    while (group > 1 && row_blocks * ((panels + group - 1) / group) < 4 * num_threads) group /= 2;
    const long groups = (panels + group - 1) / group, items = groups * row_blocks;
    const long tiles = (block_rows + MR - 1) / MR;
    Range ranges[num_threads];
    for (long t = 0; t < num_threads; t++)
        ranges[t].span = (uint64_t)(items * t / num_threads) | (uint64_t)(items * (t + 1) / num_threads) << 32;
#pragma omp parallel num_threads(num_threads)
    {
        const int self = omp_get_thread_num(), team = omp_get_num_threads();
        /* its own range first, then the others' from the back, a range at a time (team may be short of
         * num_threads: then the ranges nobody owns are all taken from the back) */
        for (long victim = 0; victim < num_threads; victim++) {
            Range *range = &ranges[(self + victim) % num_threads];
            const int own = victim == 0 && self < team;
            for (long item; (item = claim(range, own ? 1 : 1ull << 32)) >= 0;) {
                const long g = item / row_blocks, rb = item % row_blocks;
                const long p0 = g * group, np = p0 + group <= panels ? group : panels - p0;
                const long col0 = p0 * PANEL, cols = (col0 + np * PANEL <= n ? np * PANEL : n - col0);
                const long r1 = (rb + 1) * block_rows < m ? (rb + 1) * block_rows : m;
                /* the next item's panels, where it is this thread's (as far as the range says now)
                 * and meets other panels than this one */
                const uint64_t span = __atomic_load_n(&range->span, __ATOMIC_RELAXED);
                const int prefetch =
                    own && m > 1 && rb == row_blocks - 1 && (long)(uint32_t)span < (long)(span >> 32);
                const long next_np = p0 + 2 * group <= panels ? group : panels - p0 - group;
                const char *next = (const char *)(packed + (p0 + group) * k * PANEL);
                for (long r = rb * block_rows, t = 0; r < r1; r += MR, t++) {
                    const long mr = r + MR <= r1 ? MR : r1 - r;
                    const Prefetch share = prefetch
                                               ? tile_share(next, next_np * k * PANEL * (long)sizeof(float), t, tiles, k)
                                               : (Prefetch){NULL, NULL, 0, 0, 0, 0};
                    tile_any(y + r * ldy + col0, ldy, x + r * ldx, ldx, packed + p0 * k * PANEL,
                             bias ? bias + col0 : NULL, k, cols, mr, np, &share);
                }
            }
        }
    }
}

/* pagoda_gemm_invariant once per group of rows, each group by its own weight: rows [row0[g], row0[g] + rows[g])
 * of x and y by the weight packed at packed[g], no bias (a mixture's experts, each over the rows that chose it):
 * one call from Python a step instead of one per group, and the same kernel, so the same bits. */
void pagoda_gemm_invariant_groups(float *y, long ldy, const float *x, long ldx, const int64_t *packed,
                                  const int64_t *row0, const int64_t *rows, long groups, long n, long k,
                                  int num_threads) {
    for (long g = 0; g < groups; g++)
        if (rows[g] > 0)
            pagoda_gemm_invariant(y + row0[g] * ldy, ldy, x + row0[g] * ldx, ldx, (const float *)(intptr_t)packed[g],
                                  NULL, rows[g], n, k, num_threads);
}
