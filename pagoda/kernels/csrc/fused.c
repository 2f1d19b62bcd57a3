/* The small ops around a decoder layer's projections, each one pass over its rows: RMSNorm, the
 * residual add fused into the next RMSNorm, rotary embedding in place on the query and key heads,
 * and SiLU(gate) * up. In torch each is several dispatches of a few floats' work; here each is one
 * call. Any lengths: whole vectors, then one masked part vector.
 * Each runs at 6-13 floats per ns on one core (measured with AVX-512), so a decode batch of a small
 * model is a few microseconds of work: rows are split across threads only from PARALLEL_MIN floats
 * (~30 us), and below it no OpenMP runtime call is made at all (even a region with a false if()
 * clause costs microseconds, and waking a team on a busy machine far more). */
#include "vec.h"

#define PARALLEL_MIN (1L << 18)

/* sum of x[i]^2 */
static inline float sum_squares(const float *x, long n) {
    vec acc = vset(0.f);
    long i = 0;
    for (; i + VLEN <= n; i += VLEN) acc = vfmadd(vload(x + i), vload(x + i), acc);
    if (i < n) {
        const vec v = load_part(x + i, first_lanes(n - i));
        acc = vfmadd(v, v, acc);
    }
    return vsum(acc);
}

/* r[i] += x[i]; returns the sum of the new r[i]^2 */
static inline float add_sum_squares(float *r, const float *x, long n) {
    vec acc = vset(0.f);
    long i = 0;
    for (; i + VLEN <= n; i += VLEN) {
        const vec v = vadd(vload(r + i), vload(x + i));
        vstore(r + i, v);
        acc = vfmadd(v, v, acc);
    }
    if (i < n) {
        const vmask m = first_lanes(n - i);
        const vec v = vadd(load_part(r + i, m), load_part(x + i, m));
        store_part(r + i, v, m);
        acc = vfmadd(v, v, acc);
    }
    return vsum(acc);
}

/* out[i] = w[i] * (x[i] * inv), in the order of HF's RMSNorm */
static inline void scale(float *out, const float *x, const float *w, float inv, long n) {
    const vec s = vset(inv);
    long i = 0;
    for (; i + VLEN <= n; i += VLEN) vstore(out + i, vmul(vload(w + i), vmul(vload(x + i), s)));
    if (i < n) {
        const vmask m = first_lanes(n - i);
        store_part(out + i, vmul(load_part(w + i, m), vmul(load_part(x + i, m), s)), m);
    }
}

static inline float inv_rms(float sum_sq, long n, float eps) { return 1.f / sqrtf(sum_sq / (float)n + eps); }

static inline void rms_norm_row(float *out, const float *x, const float *w, long n, float eps) {
    scale(out, x, w, inv_rms(sum_squares(x, n), n, eps), n);
}

/* out[r] = rmsnorm(x[r]) * weight for each of `rows` contiguous rows of n floats */
void pagoda_rms_norm(float *out, const float *x, const float *weight, long rows, long n, float eps, int num_threads) {
    if (rows * n < PARALLEL_MIN) {
        for (long r = 0; r < rows; r++) rms_norm_row(out + r * n, x + r * n, weight, n, eps);
        return;
    }
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (long r = 0; r < rows; r++) rms_norm_row(out + r * n, x + r * n, weight, n, eps);
}

static inline void add_rms_norm_row(float *x, float *res, const float *w, long n, float eps) {
    scale(x, res, w, inv_rms(add_sum_squares(res, x, n), n, eps), n);
}

/* residual[r] += x[r]; x[r] = rmsnorm(residual[r]) * weight: both [rows, n] contiguous, in place */
void pagoda_add_rms_norm(float *x, float *residual, const float *weight, long rows, long n, float eps, int num_threads) {
    if (rows * n < PARALLEL_MIN) {
        for (long r = 0; r < rows; r++) add_rms_norm_row(x + r * n, residual + r * n, weight, n, eps);
        return;
    }
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (long r = 0; r < rows; r++) add_rms_norm_row(x + r * n, residual + r * n, weight, n, eps);
}

/* One head rotated in place: (x1, x2) -> (x1 c1 + x2 s1, x2 c2 + x1 s2) over its halves, with
 * s = signed_sin (first half negated), which is x cos + rotate_half(x) sin. */
static inline void rotate_head(float *x, const float *c, const float *s, long half) {
    float *y = x + half;
    long i = 0;
    for (; i + VLEN <= half; i += VLEN) {
        const vec a = vload(x + i), b = vload(y + i);
        vstore(x + i, vfmadd(a, vload(c + i), vmul(b, vload(s + i))));
        vstore(y + i, vfmadd(b, vload(c + half + i), vmul(a, vload(s + half + i))));
    }
    if (i < half) {
        const vmask m = first_lanes(half - i);
        const vec a = load_part(x + i, m), b = load_part(y + i, m);
        store_part(x + i, vfmadd(a, load_part(c + i, m), vmul(b, load_part(s + i, m))), m);
        store_part(y + i, vfmadd(b, load_part(c + half + i, m), vmul(a, load_part(s + half + i, m))), m);
    }
}

/* Rotary embedding in place on x: `tokens` rows `token_stride` floats apart, each `heads`
 * contiguous heads of head_dim (even); token t at position positions[t] takes row positions[t]
 * of the [max_positions, head_dim] tables cos and signed_sin. */
typedef struct {
    float *x;
    const float *cos, *signed_sin;
    const int64_t *positions;
    long heads, head_dim, token_stride;
} rotary_args;

static inline void rotate_token(const rotary_args *a, long t) {
    const long offset = a->positions[t] * a->head_dim;
    for (long h = 0; h < a->heads; h++)
        rotate_head(a->x + t * a->token_stride + h * a->head_dim, a->cos + offset, a->signed_sin + offset, a->head_dim / 2);
}

void pagoda_rotary(float *x, const float *cos, const float *signed_sin, const int64_t *positions, long tokens,
                   long heads, long head_dim, long token_stride, int num_threads) {
    const rotary_args a = {x, cos, signed_sin, positions, heads, head_dim, token_stride};
    if (tokens * heads * head_dim < PARALLEL_MIN) {
        for (long t = 0; t < tokens; t++) rotate_token(&a, t);
        return;
    }
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (long t = 0; t < tokens; t++) rotate_token(&a, t);
}

/* o[i] = silu(g[i]) * u[i], silu(g) = g / (1 + e^-g) as torch computes it */
static inline void silu_mul_row(float *o, const float *g, const float *u, long n) {
    const vec one = vset(1.f), minus_one = vset(-1.f);
    long i = 0;
    for (; i + VLEN <= n; i += VLEN) {
        const vec gv = vload(g + i);
        vstore(o + i, vmul(vdiv(gv, vadd(one, vexp(vmul(gv, minus_one)))), vload(u + i)));
    }
    if (i < n) {
        const vmask m = first_lanes(n - i);
        const vec gv = load_part(g + i, m);
        store_part(o + i, vmul(vdiv(gv, vadd(one, vexp(vmul(gv, minus_one)))), load_part(u + i, m)), m);
    }
}

/* out[r] = silu(gate_up[r, :n]) * gate_up[r, n:]: gate_up [rows, 2n], out [rows, n], contiguous */
void pagoda_silu_mul(float *out, const float *gate_up, long rows, long n, int num_threads) {
    if (rows * n < PARALLEL_MIN) {
        for (long r = 0; r < rows; r++) silu_mul_row(out + r * n, gate_up + 2 * r * n, gate_up + (2 * r + 1) * n, n);
        return;
    }
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (long r = 0; r < rows; r++) silu_mul_row(out + r * n, gate_up + 2 * r * n, gate_up + (2 * r + 1) * n, n);
}
