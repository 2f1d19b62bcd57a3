/* One vector type for the widest ISA the build has (16 lanes with AVX-512, else 8 with AVX2), the
 * few operations the kernels need on it, and the vectorized exponential they share. */
#pragma once
#include "common.h"

#ifdef __AVX512F__
#define VLEN 16
#define VEC_OP(op) _mm512_##op##_ps
typedef __m512 vec;
typedef __mmask16 vmask;
static inline vmask first_lanes(long n) { return (vmask)((1u << n) - 1); }
static inline vec load_part(const float *p, vmask m) { return _mm512_maskz_loadu_ps(m, p); }
static inline void store_part(float *p, vec v, vmask m) { _mm512_mask_storeu_ps(p, m, v); }
static inline vec vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec vset(float a) { return _mm512_set1_ps(a); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline vec vdiv(vec a, vec b) { return _mm512_div_ps(a, b); }
static inline vec vfmadd(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec vfnmadd(vec a, vec b, vec c) { return _mm512_fnmadd_ps(a, b, c); }
static inline vec vclamp(vec x, float lo, float hi) { return _mm512_min_ps(_mm512_max_ps(x, vset(lo)), vset(hi)); }
static inline vec vround(vec x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vec vscale2(vec p, vec n) { return _mm512_scalef_ps(p, n); } /* p * 2^n, n integral */
static inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
static inline vec vabs(vec v) { return _mm512_abs_ps(v); }
static inline int vany_nan(vec v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0; }
static inline int vmask_eq(vec v, float a) { return (int)_mm512_cmp_ps_mask(v, vset(a), _CMP_EQ_OQ); } /* lane i: bit i */
static inline vec vzero_below(vec v, vec x, float lo) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, vset(lo), _CMP_GE_OQ), v); } /* v where x >= lo, else 0 */
#else
#define VLEN 8
#define VEC_OP(op) _mm256_##op##_ps
typedef __m256 vec;
typedef __m256i vmask;
static inline vmask first_lanes(long n) { return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); }
static inline vec load_part(const float *p, vmask m) { return _mm256_maskload_ps(p, m); }
static inline void store_part(float *p, vec v, vmask m) { _mm256_maskstore_ps(p, m, v); }
static inline vec vload(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstore(float *p, vec v) { _mm256_storeu_ps(p, v); }
static inline vec vset(float a) { return _mm256_set1_ps(a); }
static inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
static inline vec vdiv(vec a, vec b) { return _mm256_div_ps(a, b); }
static inline vec vfmadd(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec vfnmadd(vec a, vec b, vec c) { return _mm256_fnmadd_ps(a, b, c); }
static inline vec vclamp(vec x, float lo, float hi) { return _mm256_min_ps(_mm256_max_ps(x, vset(lo)), vset(hi)); }
static inline vec vround(vec x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vec vscale2(vec p, vec n) { /* p * 2^n for integral n in [-126, 127]: n + 127 is 2^n's exponent field */
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
static inline float vsum(vec v) { return hsum(v); }
static inline vec vabs(vec v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), v); } /* the sign bit cleared */
static inline int vany_nan(vec v) { return _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0; }
static inline int vmask_eq(vec v, float a) { return _mm256_movemask_ps(_mm256_cmp_ps(v, vset(a), _CMP_EQ_OQ)); }
static inline vec vzero_below(vec v, vec x, float lo) { return _mm256_and_ps(v, _mm256_cmp_ps(x, vset(lo), _CMP_GE_OQ)); }
#endif

/* 8 (bf16x8) or 16 (bf16x16) bf16 values (uint16_t, an fp32's top half) widened to fp32 exactly,
 * by a 16-bit shift; vload_bf16 loads a vec's worth */
static inline __m256 bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#ifdef __AVX512F__
static inline __m512 bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline vec vload_bf16(const uint16_t *p) { return bf16x16(p); }
#else
static inline vec vload_bf16(const uint16_t *p) { return bf16x8(p); }
#endif

/* v rounded to the nearest bf16 (ties to even), kept as fp32; a NaN stays a quiet NaN */
static inline vec round_bf16(vec v) {
#ifdef __AVX512F__
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    r = _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), u, _mm512_set1_epi32(0x400000));
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u)));
#else
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    const __m256 quiet = _mm256_castsi256_ps(_mm256_or_si256(u, _mm256_set1_epi32(0x400000)));
    const __m256 chosen = _mm256_blendv_ps(_mm256_castsi256_ps(r), quiet, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_and_ps(chosen, _mm256_castsi256_ps(_mm256_set1_epi32((int)0xffff0000u)));
#endif
}

static inline vec round_to(vec v, int bf16) { return bf16 ? round_bf16(v) : v; }

static inline size_t value_size(int bf16) { return bf16 ? sizeof(uint16_t) : sizeof(float); }

/* value i of p (float or bf16) as fp32 */
static inline float load_one(const void *p, long i, int bf16) {
    if (!bf16) return ((const float *)p)[i];
    const uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* f rounded to the nearest bf16 (ties to even), as torch rounds; a NaN stays a (quiet) NaN */
static inline uint16_t bf16_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

/* VLEN values from p + i (float or bf16), widened to fp32 */
static inline vec load_row(const void *p, long i, int bf16) {
    return bf16 ? vload_bf16((const uint16_t *)p + i) : vload((const float *)p + i);
}

/* VLEN values to p + i, rounded to bf16 where `bf16` */
static inline void store_row(void *p, long i, vec v, int bf16) {
    if (!bf16) {
        vstore((float *)p + i, v);
        return;
    }
    uint16_t *q = (uint16_t *)p + i;
#ifdef __AVX512F__
    const __m512i top = _mm512_srli_epi32(_mm512_castps_si512(round_bf16(v)), 16);
    _mm256_storeu_si256((__m256i *)q, _mm512_cvtepi32_epi16(top));
#else
    const __m256i top = _mm256_srli_epi32(_mm256_castps_si256(round_bf16(v)), 16); /* each < 2^16 */
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(top, top), 0x08);
    _mm_storeu_si128((__m128i *)q, _mm256_castsi256_si128(packed));
#endif
}

/* n floats to bf16, each to the nearest (ties to even) */
static inline void floats_to_bf16(uint16_t *dst, const float *src, long n) {
    long i = 0;
    for (; i + VLEN <= n; i += VLEN) store_row(dst, i, vload(src + i), 1);
    for (; i < n; i++) dst[i] = bf16_of(src[i]);
}

/* n bf16 values widened to floats (exactly) */
static inline void bf16_to_floats(float *dst, const uint16_t *src, long n) {
    long i = 0;
    for (; i + VLEN <= n; i += VLEN) vstore(dst + i, vload_bf16(src + i));
    for (; i < n; i++) dst[i] = load_one(src, i, 1);
}

/* e^x, x clamped to [-87, 88] (e^x a normal float there): 2^n e^r with n = round(x log2 e),
 * r = x - n ln 2 in two parts (the first exact in float), |r| <= ln2 / 2, and e^r by its
 * degree-6 Taylor polynomial (relative error < 2e-7). */
static inline vec vexp(vec x) {
    x = vclamp(x, -87.f, 88.f);
    const vec n = vround(vmul(x, vset(1.44269504088896341f)));
    vec r = vfnmadd(n, vset(0.693359375f), x);
    r = vfnmadd(n, vset(-2.12194440e-4f), r);
    vec p = vset(1.f / 720);
    p = vfmadd(p, r, vset(1.f / 120));
    p = vfmadd(p, r, vset(1.f / 24));
    p = vfmadd(p, r, vset(1.f / 6));
    p = vfmadd(p, r, vset(0.5f));
    p = vfmadd(p, r, vset(1.f));
    p = vfmadd(p, r, vset(1.f));
    return vscale2(p, n);
}

static inline vec vsub(vec a, vec b) { return VEC_OP(sub)(a, b); }
static inline vec vmax(vec a, vec b) { return VEC_OP(max)(a, b); }

/* n floats from p, n > 0: a whole vector, or the first n lanes (the rest zero) */
static inline vec load_n(const float *p, long n) { return n >= VLEN ? vload(p) : load_part(p, first_lanes(n)); }
static inline void store_n(float *p, vec v, long n) {
    if (n >= VLEN) vstore(p, v);
    else store_part(p, v, first_lanes(n));
}

/* p[i] = e^(p[i] - max) for i < n, each p[i] <= max (softmax); returns their sum */
static inline float exp_shifted(float *p, long n, float max) {
    const vec m = vset(max);
    vec acc = vset(0.f);
    long i = 0;
    for (; i + VLEN <= n; i += VLEN) {
        const vec e = vexp(vsub(vload(p + i), m));
        vstore(p + i, e);
        acc = vadd(acc, e);
    }
    float sum = vsum(acc);
    for (; i < n; i++) sum += (p[i] = expf(p[i] - max));
    return sum;
}

/* The horizontal sums of VLEN vectors at once (vsum_each), each added in exactly the pairs vsum adds
 * it in (floating-point addition being commutative, only the pairing matters), so that lane j is
 * bitwise vsum of one of them (vsum_token says which), for a vector's worth of dot products at the
 * cost of a few shuffles each instead of a whole horizontal sum each.
 * AVX-512 (_mm512_reduce_add_ps): lane j + 8 to lane j, then j + 4 to j, then 2 to 0 and 3 to 1,
 * then 1 to 0; lane 4 L + j of the result is the sum of x[4 j + L].
 * AVX2 (hsum): lane j + 4 to lane j, then 2 to 0 and 3 to 1, then 1 to 0; lane 4 L + j of the
 * result is the sum of x[2 j + L]. */
#ifdef __AVX512F__
static inline vec vsum_each_halves(vec a, vec b) { /* 256-bit halves: lanes 0-7 of a, then of b */
    return vadd(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
}

/* vsum_each after its first step: y[k] = vsum_each_halves(x[2k], x[2k + 1]) */
static inline vec vsum_each_rest(const vec *y) {
    vec z[4], w[2];
    for (int k = 0; k < 4; k++) /* 128-bit quarters: x[4k], .., x[4k + 3], 4 lanes each */
        z[k] = vadd(_mm512_shuffle_f32x4(y[2 * k], y[2 * k + 1], 0x88), _mm512_shuffle_f32x4(y[2 * k], y[2 * k + 1], 0xDD));
    for (int k = 0; k < 2; k++) /* lanes 0, 2 and 1, 3 within each quarter */
        w[k] = vadd(_mm512_shuffle_ps(z[2 * k], z[2 * k + 1], 0x44), _mm512_shuffle_ps(z[2 * k], z[2 * k + 1], 0xEE));
    return vadd(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD));
}

/* The vector whose sum vsum_each puts in lane j is x[m] for j = vsum_token(m) */
static inline int vsum_token(int m) { return 4 * (m % 4) + m / 4; }
#else
static inline vec vsum_each_halves(vec a, vec b) { /* 128-bit halves: lanes 0-3 of a, then of b */
    return vadd(_mm256_insertf128_ps(a, _mm256_castps256_ps128(b), 1), _mm256_permute2f128_ps(a, b, 0x31));
}

static inline vec vsum_each_rest(const vec *y) { /* y[k] = vsum_each_halves(x[2k], x[2k + 1]) */
    vec z[2];
    for (int k = 0; k < 2; k++) /* lanes 0, 2 and 1, 3 within each half */
        z[k] = vadd(_mm256_shuffle_ps(y[2 * k], y[2 * k + 1], 0x44), _mm256_shuffle_ps(y[2 * k], y[2 * k + 1], 0xEE));
    return vadd(_mm256_shuffle_ps(z[0], z[1], 0x88), _mm256_shuffle_ps(z[0], z[1], 0xDD));
}

static inline int vsum_token(int m) { return 4 * (m % 2) + m / 2; }
#endif

static inline vec vsum_each(const vec *x) {
    vec y[VLEN / 2];
    for (int k = 0; k < VLEN / 2; k++) y[k] = vsum_each_halves(x[2 * k], x[2 * k + 1]);
    return vsum_each_rest(y);
}
