/* Linear layers on quantized weights with int8 activations and integer dot products, as llama.cpp
 * computes them; one arithmetic for every batch size and instruction set. Formats: GGUF's Q4_0,
 * Q4_1 and Q8_0, and I8 (`--quantization int8`: int8 codes with one float32 scale per row).
 *
 * Activations: each row of x is cut into blocks of 32 values, each quantized to int8 codes a with
 * one float scale da = max|x| / 127 (a = round-to-even(x * (1 / da))), and the codes' sum asum.
 * Weights: a block of 32 columns of one row is dw * (q - 8) (Q4_0), dw * q + mw (Q4_1) or
 * dw * q (Q8_0); a row of I8 is s * q, one scale s for the whole row (k any size: the last block
 * zero-padded in weights and activations). Per output and block the exact integer
 * isum = sum(q * a) (minus 8 * asum for Q4_0) is combined in float32, blocks in order:
 *   acc = fma(dw * da, (float)isum, acc)          then, Q4_1 only:  acc = fma(mw, da * asum, acc)
 * and y = acc + bias; for I8 acc = fma(da, (float)isum, acc) and the row's scale once at the end,
 * y = fma(acc, s, bias). Integer sums are exact and the float steps are the same IEEE operations
 * in every lane of every path, so a row's result does not depend on the batch it is in (the GEMV
 * is the GEMM with one row) nor on AVX2 vs AVX-512 (VNNI or not) vs AMX tiles.
 *
 * Packed weight layout (made once at load by pagoda_qd_pack from GGUF's rows): panels of 16 rows
 * (the last one padded with zero rows), each panel its blocks in order, each block
 *   dw: 16 fp16 (one per row), Q4_1 then mw: 16 fp16,
 *   codes: Q4: 4 groups of [16 rows][4 bytes]: group g byte t holds column 4g+t in its low nibble
 *          and column 16+4g+t in its high one; Q8_0 and I8: 8 groups of [16 rows][4 int8], columns 4g+t.
 * so one 64-byte load feeds a dot product of 4 columns for 16 rows, lane = row: no horizontal
 * sums. The GGUF bytes are the file's, rearranged: same size. An I8 panel starts with its 16 rows'
 * float32 scales, then its blocks, which have no header (made by model_executor/quant_linear.py). */
#include "vec.h"
#include "kernels.h"

enum { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2, I8 = 3 };
#define QK 32
#define PR 16 /* rows per panel */

static inline int byte_codes(int fmt) { return fmt == Q8_0 || fmt == I8; } /* one signed byte per code */
static inline int code_groups(int fmt) { return byte_codes(fmt) ? 8 : 4; }
static inline long gguf_block_bytes(int fmt) { return fmt == Q4_0 ? 18 : fmt == Q4_1 ? 20 : 34; }
static inline long header_bytes(int fmt) { return fmt == Q4_1 ? 64 : fmt == I8 ? 0 : 32; }
static inline long packed_block_bytes(int fmt) { return header_bytes(fmt) + code_groups(fmt) * 64; }
static inline long panel_head(int fmt) { return fmt == I8 ? PR * sizeof(float) : 0; } /* I8's row scales */
static inline long panel_bytes(int fmt, long k) { return panel_head(fmt) + (k + QK - 1) / QK * packed_block_bytes(fmt); }

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* code of column c (0..31) of a GGUF block */
static inline int gguf_code(int fmt, const uint8_t *block, int c) {
    if (fmt == Q8_0) return ((const int8_t *)block)[2 + c];
    const uint8_t byte = block[(fmt == Q4_0 ? 2 : 4) + (c & 15)];
    return c < 16 ? byte & 15 : byte >> 4;
}

/* packed [ceil(n / 16), panel bytes] from GGUF rows w [n, k / 32 blocks] (GGUF formats only) */
void pagoda_qd_pack(int fmt, const uint8_t *w, uint8_t *packed, long n, long k, int num_threads) {
    const long nb = k / QK, gb = gguf_block_bytes(fmt), pb = packed_block_bytes(fmt), h = header_bytes(fmt);
    const long panels = (n + PR - 1) / PR;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (long p = 0; p < panels; p++) {
        uint8_t *out = packed + p * nb * pb;
        memset(out, 0, nb * pb);
        for (long r = 0; r < PR && p * PR + r < n; r++) {
            const uint8_t *row = w + (p * PR + r) * nb * gb;
            for (long b = 0; b < nb; b++) {
                const uint8_t *src = row + b * gb;
                uint8_t *dst = out + b * pb;
                memcpy(dst + 2 * r, src, 2);
                if (fmt == Q4_1) memcpy(dst + 32 + 2 * r, src + 2, 2);
                for (int g = 0; g < (fmt == Q8_0 ? 8 : 4); g++)
                    for (int t = 0; t < 4; t++) {
                        uint8_t *byte = dst + h + g * 64 + r * 4 + t;
                        if (fmt == Q8_0) *byte = (uint8_t)gguf_code(fmt, src, 4 * g + t);
                        else *byte = (uint8_t)(gguf_code(fmt, src, 4 * g + t) | gguf_code(fmt, src, 16 + 4 * g + t) << 4);
                    }
            }
        }
    }
}

/* out[i, :] = dequantize(w)[ids[i], :] (an embedding lookup), exactly the float values GGUF defines
 * (GGUF formats only: an I8 model's embedding table stays float) */
void pagoda_qd_dequant_rows(int fmt, const uint8_t *packed, const int64_t *ids, long count, long k, float *out,
                            int num_threads) {
    const long nb = k / QK, pb = packed_block_bytes(fmt), h = header_bytes(fmt);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (count > 1)
    for (long i = 0; i < count; i++) {
        const long r = ids[i] % PR;
        const uint8_t *panel = packed + ids[i] / PR * nb * pb;
        for (long b = 0; b < nb; b++) {
            const uint8_t *blk = panel + b * pb;
            const float d = half_at(blk + 2 * r);
            const float c = fmt == Q4_0 ? -8.f * d : fmt == Q4_1 ? half_at(blk + 32 + 2 * r) : 0.f;
            float *o = out + i * k + b * QK;
            for (int g = 0; g < (fmt == Q8_0 ? 8 : 4); g++)
                for (int t = 0; t < 4; t++) {
                    const uint8_t byte = blk[h + g * 64 + r * 4 + t];
                    if (fmt == Q8_0) o[4 * g + t] = d * (float)(int8_t)byte;
                    else {
                        o[4 * g + t] = fmaf(d, (float)(byte & 15), c); /* d * q exact: 11 x 4 bits */
                        o[16 + 4 * g + t] = fmaf(d, (float)(byte >> 4), c);
                    }
                }
        }
    }
}

#ifdef __AVX512F__
static inline __m512i vround_int(vec v) { return _mm512_cvtps_epi32(v); } /* ties to even (MXCSR default) */
#else
static inline __m256i vround_int(vec v) { return _mm256_cvtps_epi32(v); }
static inline void store_ints(int32_t *p, __m256i v) { _mm256_storeu_si256((__m256i *)p, v); }
#endif

/* One row of activations quantized: per block b (32 values, the last zero-padded) its 32 codes at
 * q + b * stride * QK, its scale d, the codes' sum and their product d * (float)sum (Q4_1's term) at
 * b * stride. Every step is exact or one IEEE operation (max, one division, one reciprocal, one
 * product, rounding to nearest even), so any vector width gives the same codes. amax is the largest
 * |x| that is not NaN: the lanes' maxima (a lane's NaN made 0) reduced in any order. */
static void quantize_row(const float *x, long k, int8_t *q, float *d, int32_t *sum, float *dsum, long stride) {
    for (long b = 0; b * QK < k; b++) {
        const long n = k - b * QK < QK ? k - b * QK : QK;
        float v[QK] = {0};
        memcpy(v, x + b * QK, sizeof(float) * n);
        vec vmaxabs = vset(0.f);
        for (int j = 0; j < QK; j += VLEN) vmaxabs = vmax(vmaxabs, vabs(vload(v + j)));
        vmaxabs = vmax(vmaxabs, vset(0.f)); /* NaN lanes to 0: max(a, b) is b where a is NaN */
#ifdef __AVX512F__
        const float amax = _mm512_reduce_max_ps(vmaxabs);
#else
        const __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmaxabs), _mm256_extractf128_ps(vmaxabs, 1));
        const __m128 m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps(m2, m2, 1)));
#endif
        const float scale = amax / 127.f, inv = scale != 0.f ? 1.f / scale : 0.f;
        int32_t s = 0;
#ifdef __AVX512F__
        const __m512i c0 = vround_int(vmul(vload(v), vset(inv))), c1 = vround_int(vmul(vload(v + 16), vset(inv)));
        _mm_storeu_si128((__m128i *)(q + b * stride * QK), _mm512_cvtepi32_epi8(c0));
        _mm_storeu_si128((__m128i *)(q + b * stride * QK + 16), _mm512_cvtepi32_epi8(c1));
        s = _mm512_reduce_add_epi32(_mm512_add_epi32(c0, c1));
#else
        int32_t codes[QK];
        for (int j = 0; j < QK; j += VLEN) store_ints(codes + j, vround_int(vmul(vload(v + j), vset(inv))));
        for (int j = 0; j < QK; j++) {
            q[b * stride * QK + j] = (int8_t)codes[j];
            s += codes[j];
        }
#endif
        d[b * stride] = scale;
        sum[b * stride] = s;
        dsum[b * stride] = scale * (float)s;
    }
}

/* The integer part: s += the 4-byte dot products of u (unsigned codes) with a (int8 codes
 * broadcast), per 32-bit lane. Q8_0's signed weights go in as w ^ 0x80 = w + 128 on VNNI (the
 * caller takes 128 * asum off), or by the sign trick without it (maddubs's int16 pairs would
 * overflow on 255 * 127 * 2). */
#ifdef __AVX512F__
typedef __m512i ivec;
#define ILANES 16
static inline ivec iload(const uint8_t *p) { return _mm512_loadu_si512(p); }
static inline ivec ibcast(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}
static inline ivec izero(void) { return _mm512_setzero_si512(); }
static inline ivec iand(ivec a, int m) { return _mm512_and_si512(a, _mm512_set1_epi8((char)m)); }
static inline ivec ishr4(ivec a) { return _mm512_srli_epi16(a, 4); }
static inline ivec isub_scaled(ivec s, int by, int32_t v) { return _mm512_sub_epi32(s, _mm512_set1_epi32(by * v)); }
static inline vec ifloat(ivec v) { return _mm512_cvtepi32_ps(v); }
static inline vec halfs(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
#ifdef __AVX512VNNI__
static inline ivec dot_u8(ivec s, ivec u, ivec a) { return _mm512_dpbusd_epi32(s, u, a); }
static inline ivec dot_s8(ivec s, ivec w, ivec a) {
    return _mm512_dpbusd_epi32(s, _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80)), a);
}
#define Q8_OFFSET 128
#else
static inline ivec dot_u8(ivec s, ivec u, ivec a) {
    return _mm512_add_epi32(s, _mm512_madd_epi16(_mm512_maddubs_epi16(u, a), _mm512_set1_epi16(1)));
}
static inline ivec dot_s8(ivec s, ivec w, ivec a) {
    const ivec signed_a = _mm512_mask_sub_epi8(a, _mm512_movepi8_mask(w), _mm512_setzero_si512(), a);
    return dot_u8(s, _mm512_abs_epi8(w), signed_a);
}
#define Q8_OFFSET 0
#endif
#else
typedef __m256i ivec;
#define ILANES 8
static inline ivec iload(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline ivec ibcast(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}
static inline ivec izero(void) { return _mm256_setzero_si256(); }
static inline ivec iand(ivec a, int m) { return _mm256_and_si256(a, _mm256_set1_epi8((char)m)); }
static inline ivec ishr4(ivec a) { return _mm256_srli_epi16(a, 4); }
static inline ivec isub_scaled(ivec s, int by, int32_t v) { return _mm256_sub_epi32(s, _mm256_set1_epi32(by * v)); }
static inline vec ifloat(ivec v) { return _mm256_cvtepi32_ps(v); }
static inline vec halfs(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline ivec dot_u8(ivec s, ivec u, ivec a) {
    return _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1)));
}
static inline ivec dot_s8(ivec s, ivec w, ivec a) { return dot_u8(s, _mm256_abs_epi8(w), _mm256_sign_epi8(a, w)); }
#define Q8_OFFSET 0
#endif
#define HALVES (PR / ILANES) /* vectors per panel row group: 1 (AVX-512) or 2 (AVX2) */

/* Activations of one call, quantized: per row and block its 32 codes at q + act_at(row, block) * QK,
 * its scale, its codes' sum and their product at d, sum, dsum [act_at(row, block)]: for each 16
 * rows, each block's 16 side by side, so a tile of rows finds a block's at constant offsets and a
 * block's codes for 16 rows are one contiguous 512-byte tile (rows 32 bytes apart, not a row's
 * length: an AMX tile load touching 16 cache lines half used stalled the tile path). */
typedef struct {
    const int8_t *q;
    const float *d, *dsum;
    const int32_t *sum;
    long nb;
} qacts;

static inline long act_at(const qacts *x, long row, long b) { return (row / 16 * x->nb + b) * 16 + row % 16; }

/* row's codes of block b */
static inline const int8_t *act_codes(const qacts *x, long row, long b) { return x->q + act_at(x, row, b) * QK; }

/* acc[i] for activation rows i0 + i, i < TM, lane = panel row: the panel's blocks in order (for I8
 * before the row scales) */
#define TM 4
static inline __attribute__((always_inline)) void panel_tile(int fmt, int tm, const uint8_t *panel, const qacts *x,
                                                             long i0, vec acc[TM][HALVES]) {
    const long pb = packed_block_bytes(fmt), h = header_bytes(fmt);
    for (int i = 0; i < tm; i++)
        for (int v = 0; v < HALVES; v++) acc[i][v] = vset(0.f);
    for (long b = 0; b < x->nb; b++) {
        const uint8_t *blk = panel + panel_head(fmt) + b * pb;
        ivec s[TM][HALVES];
        for (int i = 0; i < tm; i++)
            for (int v = 0; v < HALVES; v++) s[i][v] = izero();
        for (int g = 0; g < code_groups(fmt); g++)
            for (int v = 0; v < HALVES; v++) {
                const ivec codes = iload(blk + h + g * 64 + v * 32);
                if (byte_codes(fmt)) {
                    for (int i = 0; i < tm; i++)
                        s[i][v] = dot_s8(s[i][v], codes, ibcast(act_codes(x, i0 + i, b) + 4 * g));
                } else {
                    const ivec lo = iand(codes, 0x0F), hi = iand(ishr4(codes), 0x0F);
                    for (int i = 0; i < tm; i++) {
                        const int8_t *a = act_codes(x, i0 + i, b) + 4 * g;
                        s[i][v] = dot_u8(dot_u8(s[i][v], lo, ibcast(a)), hi, ibcast(a + 16));
                    }
                }
            }
        for (int v = 0; v < HALVES; v++) {
            const vec dw = fmt == I8 ? vset(1.f) : halfs(blk + v * 2 * ILANES);
            const vec mw = fmt == Q4_1 ? halfs(blk + 32 + v * 2 * ILANES) : dw;
            for (int i = 0; i < tm; i++) {
                const long at = act_at(x, i0 + i, b);
                const float da = x->d[at];
                const int32_t asum = x->sum[at];
                ivec isum = s[i][v];
                if (fmt == Q4_0) isum = isub_scaled(isum, 8, asum);
                if (byte_codes(fmt) && Q8_OFFSET) isum = isub_scaled(isum, Q8_OFFSET, asum);
                const vec scale = fmt == I8 ? vset(da) : vmul(dw, vset(da));
                acc[i][v] = vfmadd(scale, ifloat(isum), acc[i][v]);
                if (fmt == Q4_1) acc[i][v] = vfmadd(mw, vset(x->dsum[at]), acc[i][v]);
            }
        }
    }
}

/* The bias and, for I8, the panel's row scales, then rows i0 .. i0 + count - 1 of the panel's outputs
 * written: the last step of both paths, the same IEEE operations */
static inline void panel_out(int fmt, const uint8_t *panel, const float acc[][PR], long i0, long count, float *y,
                             long n, long r0, const float *bias) {
    const long rows = n - r0 < PR ? n - r0 : PR;
    float bias_panel[PR] = {0};
    if (bias)
        for (long j = 0; j < rows; j++) bias_panel[j] = bias[r0 + j];
    for (long i = 0; i < count; i++) {
        float *row = y + (i0 + i) * n + r0;
        for (int v = 0; v < HALVES && v * ILANES < rows; v++) {
            const vec b = vload(bias_panel + v * ILANES);
            const float *row_scales = (const float *)panel; /* I8 */
            const vec a = vload(acc[i] + v * ILANES);
            store_n(row + v * ILANES, fmt == I8 ? vfmadd(a, vload(row_scales + v * ILANES), b) : vadd(a, b),
                    rows - v * ILANES);
        }
    }
}

#if defined(__AMX_INT8__) && defined(__AVX512F__)
#include <sys/syscall.h>
#include <unistd.h>

/* Linux gives a process AMX's tile registers only once it asks (arch_prctl ARCH_REQ_XCOMP_PERM for
 * XFEATURE_XTILEDATA); until then a tile instruction faults. 1 where granted. */
int pagoda_amx_enable(void) { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }

/* The tile path, every format: the same integers and float steps as panel_tile, the integer block
 * dots by AMX. Per block, the tile product C [16 activation rows][16 panel rows] (int32) of
 * A [16 rows][32 codes] (the activations) and B [8][16 panel rows][4 codes] (the block's code
 * groups: Q8_0's and I8's as they lie; Q4's nibbles unpacked once per panel into a thread's buffer
 * of bytes, low nibbles then high, which is the same column order). The products go through two
 * tile registers in turn, so AMX computes block b + 1 while the vector unit combines block b into
 * the 16 rows' float32 accumulators, which stay in registers: the combine, not the integer dots,
 * bounds the path. Tiles 0, 1: C; 2, 3: A; 4, 5: B. */
static void tiles_configure(void) {
    tile_config c = {0};
    c.palette = 1;
    for (int t = 0; t < 2; t++) c.rows[t] = 16, c.colsb[t] = 64; /* C: 16 x 16 int32 */
    for (int t = 2; t < 4; t++) c.rows[t] = 16, c.colsb[t] = QK; /* A: 16 rows x one block of codes */
    for (int t = 4; t < 6; t++) c.rows[t] = 8, c.colsb[t] = 64;  /* B: 8 groups of 4 codes x 16 panel rows */
    _tile_loadconfig(&c);
}

#define B_BYTES (8 * 64) /* one block's B tile */

/* a Q4 panel's code groups as bytes: block b's B tile at out + b * B_BYTES */
static void unpack_nibbles(const uint8_t *blocks, long pb, long h, long nb, uint8_t *out) {
    for (long b = 0; b < nb; b++)
        for (int g = 0; g < 4; g++) {
            const __m512i codes = _mm512_loadu_si512(blocks + b * pb + h + g * 64);
            _mm512_store_si512(out + b * B_BYTES + g * 64, iand(codes, 0x0F));
            _mm512_store_si512(out + b * B_BYTES + (g + 4) * 64, iand(ishr4(codes), 0x0F));
        }
}

/* tile c = A (tile ta: rows' codes at a) . B (tile tb: at codes); tile numbers are literals */
#define TILE_DOT(fmt, c, ta, tb, a, codes)                                                                              \
    do {                                                                                                               \
        _tile_loadd(ta, a, QK);                                                                                        \
        _tile_loadd(tb, codes, 64);                                                                                    \
        _tile_zero(c);                                                                                                 \
        if (byte_codes(fmt)) _tile_dpbssd(c, ta, tb);                                                                  \
        else _tile_dpbsud(c, ta, tb); /* Q4's codes unsigned */                                                        \
    } while (0)

/* acc[i] (lane = panel row) += block b's products c for activation row i0 + i, as panel_tile does */
static inline __attribute__((always_inline)) void combine_block(int fmt, const int32_t c[16][16], const uint8_t *blk,
                                                                const qacts *x, long i0, long b, int tm, vec acc[16]) {
    const vec dw = fmt == I8 ? vset(1.f) : halfs(blk);
    const vec mw = fmt == Q4_1 ? halfs(blk + 32) : dw;
    const long at = act_at(x, i0, b); /* i0: a multiple of 16 */
    const float *da = x->d + at, *dsum = x->dsum + at;
    const int32_t *asum = x->sum + at;
    for (int i = 0; i < tm; i++) {
        ivec isum = _mm512_load_si512(c[i]);
        if (fmt == Q4_0) isum = isub_scaled(isum, 8, asum[i]);
        const vec scale = fmt == I8 ? vset(da[i]) : vmul(dw, vset(da[i]));
        acc[i] = vfmadd(scale, ifloat(isum), acc[i]);
        if (fmt == Q4_1) acc[i] = vfmadd(mw, vset(dsum[i]), acc[i]);
    }
}

/* out[i]: the panel's 16 sums for activation row i0 + i < i0 + tm (tm: 8 or 16, a constant; the
 * tile products always have 16 rows: x->q's rows past m are zero codes);
 * block b's B tile at codes + b * cstride. A software pipeline: while AMX computes block b + 1's
 * product, block b's is stored and block b - 1's (stored a block earlier: a load right after a
 * tile store would wait for it to commit) combined. */
static inline __attribute__((always_inline)) void tile_rows(int fmt, const uint8_t *blocks, const uint8_t *codes,
                                                            long cstride, const qacts *x, long i0, int tm,
                                                            float out[16][PR]) {
    const long pb = packed_block_bytes(fmt), nb = x->nb;
    const int8_t *a = act_codes(x, i0, 0); /* block b's tile at a + b * 16 * QK */
    __attribute__((aligned(64))) int32_t c[2][16][16];
    vec acc[16];
    for (int i = 0; i < 16; i++) acc[i] = vset(0.f);
    TILE_DOT(fmt, 0, 2, 4, a, codes);
    for (long b = 0; b < nb; b += 2) { /* even blocks in tile 0, odd in tile 1 */
        if (b + 1 < nb) TILE_DOT(fmt, 1, 3, 5, a + (b + 1) * 16 * QK, codes + (b + 1) * cstride);
        _tile_stored(0, c[0], 64);
        if (b > 0) combine_block(fmt, c[1], blocks + (b - 1) * pb, x, i0, b - 1, tm, acc);
        if (b + 1 == nb) break;
        if (b + 2 < nb) TILE_DOT(fmt, 0, 2, 4, a + (b + 2) * 16 * QK, codes + (b + 2) * cstride);
        _tile_stored(1, c[1], 64);
        combine_block(fmt, c[0], blocks + b * pb, x, i0, b, tm, acc);
    }
    combine_block(fmt, c[(nb - 1) & 1], blocks + (nb - 1) * pb, x, i0, nb - 1, tm, acc);
    for (int i = 0; i < tm; i++) vstore(out[i], acc[i]);
}

/* panel p, every activation row; `unpacked`: a thread's buffer for a Q4 panel's codes */
static inline __attribute__((always_inline)) void panel_tiles(int fmt, const uint8_t *panel, uint8_t *unpacked,
                                                              const qacts *x, long m, float *y, long n, long r0,
                                                              const float *bias) {
    const uint8_t *blocks = panel + panel_head(fmt), *codes = blocks + header_bytes(fmt);
    long cstride = packed_block_bytes(fmt);
    if (!byte_codes(fmt)) {
        unpack_nibbles(blocks, cstride, header_bytes(fmt), x->nb, unpacked);
        codes = unpacked, cstride = B_BYTES;
    }
    for (long i0 = 0; i0 < m; i0 += 16) {
        __attribute__((aligned(64))) float out[16][PR];
        if (m - i0 <= 8) tile_rows(fmt, blocks, codes, cstride, x, i0, 8, out); /* half the combine */
        else tile_rows(fmt, blocks, codes, cstride, x, i0, 16, out);
        panel_out(fmt, panel, out, i0, m - i0 < 16 ? m - i0 : 16, y, n, r0, bias);
    }
}

/* matmul_vectors' order on tiles; each thread configures its own tile registers */
static void matmul_tiles(int fmt, const uint8_t *packed, long pbytes, long panels, const qacts *acts, long m,
                         float *y, long n, const float *bias, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    {
        tiles_configure();
        uint8_t *unpacked = byte_codes(fmt) ? NULL : aligned_alloc(64, acts->nb * B_BYTES);
#pragma omp for schedule(dynamic, 2)
        for (long p = 0; p < panels; p++) {
            const uint8_t *panel = packed + p * pbytes;
            if (fmt == Q4_0) panel_tiles(Q4_0, panel, unpacked, acts, m, y, n, p * PR, bias);
            else if (fmt == Q4_1) panel_tiles(Q4_1, panel, unpacked, acts, m, y, n, p * PR, bias);
            else if (fmt == Q8_0) panel_tiles(Q8_0, panel, unpacked, acts, m, y, n, p * PR, bias);
            else panel_tiles(I8, panel, unpacked, acts, m, y, n, p * PR, bias);
        }
        free(unpacked);
        _tile_release();
    }
}
#else
int pagoda_amx_enable(void) { return 0; }
#endif

static inline __attribute__((always_inline)) void panel_rows(int fmt, const uint8_t *panel, const qacts *x, long m,
                                                             float *y, long n, long r0, const float *bias) {
    for (long i0 = 0; i0 < m; i0 += TM) {
        const int tm = m - i0 < TM ? (int)(m - i0) : TM;
        vec acc[TM][HALVES];
        switch (tm) { /* constant tile heights, so the accumulators stay in registers */
        case TM: panel_tile(fmt, TM, panel, x, i0, acc); break;
        case 3: panel_tile(fmt, 3, panel, x, i0, acc); break;
        case 2: panel_tile(fmt, 2, panel, x, i0, acc); break;
        default: panel_tile(fmt, 1, panel, x, i0, acc); break;
        }
        float sums[TM][PR];
        for (int i = 0; i < tm; i++)
            for (int v = 0; v < HALVES; v++) vstore(sums[i] + v * ILANES, acc[i][v]);
        panel_out(fmt, panel, sums, i0, tm, y, n, r0, bias);
    }
}

/* each thread a contiguous share of the panels, every activation row against each panel while it
 * is in cache. With one tile of rows or fewer (decode steps of small batches) the weights stream
 * from memory: the next panel is prefetched while this one is computed, which the hardware
 * prefetcher alone did not keep up with (all the default model's decode linears at one row, their
 * weights out of cache: 5.9 ms without, 5.0 with; 2-core Intel AMX machine). With more rows a
 * panel is compute-bound, and prefetching slowed the LM head at 8 rows. */
static void matmul_vectors(int fmt, const uint8_t *packed, long pbytes, long panels, const qacts *acts, long m,
                           float *y, long n, const float *bias, int num_threads) {
    const long chunk = m <= TM ? (panels + num_threads - 1) / num_threads : 2;
#pragma omp parallel for schedule(dynamic, chunk) num_threads(num_threads)
    for (long p = 0; p < panels; p++) {
        const uint8_t *panel = packed + p * pbytes;
        if (m <= TM && p + 1 < panels)
            for (long i = 0; i < pbytes; i += 64) _mm_prefetch((const char *)(panel + pbytes + i), _MM_HINT_T0);
        if (fmt == Q4_0) panel_rows(Q4_0, panel, acts, m, y, n, p * PR, bias);
        else if (fmt == Q4_1) panel_rows(Q4_1, panel, acts, m, y, n, p * PR, bias);
        else if (fmt == Q8_0) panel_rows(Q8_0, panel, acts, m, y, n, p * PR, bias);
        else panel_rows(I8, panel, acts, m, y, n, p * PR, bias);
    }
}

#if !(defined(__AMX_INT8__) && defined(__AVX512F__))
#define matmul_tiles matmul_vectors /* never asked for: pagoda_amx_enable said 0 */
#endif

/* y [m, n] = x [m, k] @ w.T (+ bias) on packed w, float32 in and out: activations quantized once,
 * then the panels. m == 1 is the GEMV: the same code. From `tiles_from` rows (0: never; only where
 * pagoda_amx_enable granted the tiles) the integer dots run on AMX: bitwise the same
 * outputs. */
void pagoda_qd_matmul(int fmt, const uint8_t *packed, const float *x, float *y, const float *bias, long m, long n,
                      long k, long tiles_from, int num_threads) {
    const long nb = (k + QK - 1) / QK, kp = nb * QK, panels = (n + PR - 1) / PR, pbytes = panel_bytes(fmt, k);
    const int tiles = tiles_from > 0 && m >= tiles_from;
    const long mp = (m + 15) / 16 * 16; /* whole tiles of 16 rows: zeros past m */
    int8_t *q = calloc(mp * kp, 1);
    float *d = calloc(mp * nb, sizeof(float)), *dsum = calloc(mp * nb, sizeof(float));
    int32_t *sum = calloc(mp * nb, sizeof(int32_t));
    const qacts acts = {q, d, dsum, sum, nb};
#pragma omp parallel for schedule(static) num_threads(num_threads) if (m > 1)
    for (long i = 0; i < m; i++) {
        const long at = act_at(&acts, i, 0);
        quantize_row(x + i * k, k, q + at * QK, d + at, sum + at, dsum + at, 16);
    }
    (tiles ? matmul_tiles : matmul_vectors)(fmt, packed, pbytes, panels, &acts, m, y, n, bias, num_threads);
    free(q);
    free(d);
    free(dsum);
    free(sum);
}
