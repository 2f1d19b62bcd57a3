/* The small ops around a decoder layer's projections, each one pass over its rows: RMSNorm, the
 * residual add fused into the next RMSNorm, rotary embedding in place on the query and key heads,
 * and SiLU(gate) * up. In torch each is several dispatches of a few floats' work; here each is one
 * call. Any lengths: whole vectors, then one part vector.
 * Each takes float32 rows or, where `bf16` is set, bfloat16 ones (uint16_t, an fp32's top half),
 * computed as torch computes that dtype: values widened to fp32 and each op's result rounded to
 * bf16 (to nearest even), so a bf16 row takes the roundings of torch's layers. For float32,
 * round_to() is the identity and each kernel the float code it was.
 * A few decode rows of a small model are microseconds of work: rows are split across threads only
 * from PARALLEL_MIN values, and below it no OpenMP runtime call is made at all (even a region with
 * a false if() clause costs microseconds, and waking a team on a busy machine far more). At 2^18
 * values (until 2026-12) the rows of a decode batch of 32-280 and of most prefill chunks ran on one
 * thread while the others waited: a layer's two norms and SiLU * up at 64 and 128 rows of the
 * default model took 0.55-0.6x the time split from 2^14 (float32 and bf16, 2 threads, AMX machine),
 * 0.86x at 32, the same at 8 (still one thread). */
#include "vec.h"
#include "kernels.h"

#define PARALLEL_MIN (1L << 14)

/* min(n, VLEN) values from p + i, the lanes past n zero (a row's last part goes through a buffer) */
static inline vec load_n_row(const void *p, long i, long n, int bf16) {
    if (n >= VLEN) return load_row(p, i, bf16);
    float room[VLEN] = {0}; /* room for VLEN values of either size */
    memcpy(room, (const char *)p + i * value_size(bf16), n * value_size(bf16));
    return load_row(room, 0, bf16);
}

/* the first min(n, VLEN) lanes of v to p + i */
static inline void store_n_row(void *p, long i, vec v, long n, int bf16) {
    if (n >= VLEN) {
        store_row(p, i, v, bf16);
        return;
    }
    float room[VLEN];
    store_row(room, 0, v, bf16);
    memcpy((char *)p + i * value_size(bf16), room, n * value_size(bf16));
}

/* sum of x[i]^2 */
static inline float sum_squares(const void *x, long n, int bf16) {
    vec acc = vset(0.f);
    for (long i = 0; i < n; i += VLEN) {
        const vec v = load_n_row(x, i, n - i, bf16);
        acc = vfmadd(v, v, acc);
    }
    return vsum(acc);
}

/* r[i] += x[i]; returns the sum of the new r[i]^2 */
static inline float add_sum_squares(void *r, const void *x, long n, int bf16) {
    vec acc = vset(0.f);
    for (long i = 0; i < n; i += VLEN) {
        const vec v = round_to(vadd(load_n_row(r, i, n - i, bf16), load_n_row(x, i, n - i, bf16)), bf16);
        store_n_row(r, i, v, n - i, bf16);
        acc = vfmadd(v, v, acc);
    }
    return vsum(acc);
}

/* out[i] = w[i] * (x[i] * inv), in the order of HF's RMSNorm (which rounds x * inv to bf16 first) */
static inline void scale(void *out, const void *x, const void *w, float inv, long n, int bf16) {
    const vec s = vset(inv);
    for (long i = 0; i < n; i += VLEN) {
        const vec normed = round_to(vmul(load_n_row(x, i, n - i, bf16), s), bf16);
        store_n_row(out, i, vmul(load_n_row(w, i, n - i, bf16), normed), n - i, bf16);
    }
}

static inline float inv_rms(float sum_sq, long n, float eps) { return 1.f / sqrtf(sum_sq / (float)n + eps); }

/* row r of a [rows, n] matrix of float or bf16 values */
static inline void *row(void *p, long r, long n, int bf16) { return (char *)p + r * n * value_size(bf16); }

static inline void rms_norm_row(void *out, const void *x, const void *w, long n, float eps, int bf16) {
    scale(out, x, w, inv_rms(sum_squares(x, n, bf16), n, eps), n, bf16);
}

/* Each row of [rows, n] by row_op(r); on several threads only from PARALLEL_MIN values */
#define FOR_ROWS(rows, n, num_threads, row_op)                                                                         \
    do {                                                                                                               \
        if ((rows) * (n) < PARALLEL_MIN) {                                                                             \
            for (long r = 0; r < (rows); r++) row_op;                                                                  \
        } else {                                                                                                       \
            _Pragma("omp parallel for schedule(static) num_threads(num_threads)") for (long r = 0; r < (rows); r++)    \
                row_op;                                                                                                \
        }                                                                                                              \
    } while (0)

/* out[r] = rmsnorm(x[r]) * weight for each of `rows` contiguous rows of n values */
void pagoda_rms_norm(void *out, const void *x, const void *weight, long rows, long n, float eps, int bf16,
                     int num_threads) {
    FOR_ROWS(rows, n, num_threads, rms_norm_row(row(out, r, n, bf16), row((void *)x, r, n, bf16), weight, n, eps, bf16));
}

static inline void add_rms_norm_row(void *x, void *res, const void *w, long n, float eps, int bf16) {
    scale(x, res, w, inv_rms(add_sum_squares(res, x, n, bf16), n, eps), n, bf16);
}

/* residual[r] += x[r]; x[r] = rmsnorm(residual[r]) * weight: both [rows, n] contiguous, in place */
void pagoda_add_rms_norm(void *x, void *residual, const void *weight, long rows, long n, float eps, int bf16,
                         int num_threads) {
    FOR_ROWS(rows, n, num_threads, add_rms_norm_row(row(x, r, n, bf16), row(residual, r, n, bf16), weight, n, eps, bf16));
}

/* One head rotated in place: (x1, x2) -> (x1 c1 + x2 s1, x2 c2 + x1 s2) over its halves, with
 * s = signed_sin (first half negated), which is x cos + rotate_half(x) sin. In float32 the first
 * product is fused into the add; in bf16 each product is rounded, then their sum, as torch does. */
static inline vec rotate_part(vec a, vec c, vec b, vec s, int bf16) {
    if (bf16) return vadd(round_bf16(vmul(a, c)), round_bf16(vmul(b, s)));
    return vfmadd(a, c, vmul(b, s));
}

static inline void rotate_head(void *x, const void *c, const void *s, long half, int bf16) {
    void *y = (char *)x + half * value_size(bf16);
    for (long i = 0; i < half; i += VLEN) {
        const long n = half - i;
        const vec a = load_n_row(x, i, n, bf16), b = load_n_row(y, i, n, bf16);
        store_n_row(x, i, rotate_part(a, load_n_row(c, i, n, bf16), b, load_n_row(s, i, n, bf16), bf16), n, bf16);
        store_n_row(y, i, rotate_part(b, load_n_row(c, half + i, n, bf16), a, load_n_row(s, half + i, n, bf16), bf16), n,
                    bf16);
    }
}

/* Rotary embedding in place on x: `tokens` rows `token_stride` values apart, each `heads`
 * contiguous heads of head_dim (even); token t at position positions[t] takes row positions[t]
 * of the [max_positions, head_dim] tables cos and signed_sin (in x's dtype). */
typedef struct {
    void *x;
    const void *cos, *signed_sin;
    const int64_t *positions;
    long heads, head_dim, token_stride;
    int bf16;
} rotary_args;

static inline void rotate_token(const rotary_args *a, long t) {
    const size_t size = value_size(a->bf16);
    const long offset = a->positions[t] * a->head_dim * size;
    for (long h = 0; h < a->heads; h++)
        rotate_head((char *)a->x + (t * a->token_stride + h * a->head_dim) * size, (const char *)a->cos + offset,
                    (const char *)a->signed_sin + offset, a->head_dim / 2, a->bf16);
}

void pagoda_rotary(void *x, const void *cos, const void *signed_sin, const int64_t *positions, long tokens, long heads,
                   long head_dim, long token_stride, int bf16, int num_threads) {
    const rotary_args a = {x, cos, signed_sin, positions, heads, head_dim, token_stride, bf16};
    FOR_ROWS(tokens, heads * head_dim, num_threads, rotate_token(&a, r));
}

static inline void mul_row(void *x, float m, long n, int bf16) {
    const vec s = vset(m);
    for (long i = 0; i < n; i += VLEN) store_n_row(x, i, vmul(load_n_row(x, i, n - i, bf16), s), n - i, bf16);
}

/* x[r] *= m for each of `rows` contiguous rows of n values, each product rounded once (to bf16 for a
 * bf16 row): torch's x * m (Granite's residual multiplier) */
void pagoda_mul(void *x, float m, long rows, long n, int bf16, int num_threads) {
    FOR_ROWS(rows, n, num_threads, mul_row(row(x, r, n, bf16), m, n, bf16));
}

/* o[i] = silu(g[i]) * u[i], silu(g) = g / (1 + e^-g) as torch computes it (rounded before the product in bf16) */
static inline void silu_mul_row(void *o, const void *g, const void *u, long n, int bf16) {
    const vec one = vset(1.f), minus_one = vset(-1.f);
    for (long i = 0; i < n; i += VLEN) {
        const vec gv = load_n_row(g, i, n - i, bf16);
        const vec silu = round_to(vdiv(gv, vadd(one, vexp(vmul(gv, minus_one)))), bf16);
        store_n_row(o, i, vmul(silu, load_n_row(u, i, n - i, bf16)), n - i, bf16);
    }
}

/* out[r] = silu(gate_up[r, :n]) * gate_up[r, n:]: gate_up [rows, 2n], out [rows, n], contiguous */
void pagoda_silu_mul(void *out, const void *gate_up, long rows, long n, int bf16, int num_threads) {
    FOR_ROWS(rows, n, num_threads,
             silu_mul_row(row(out, r, n, bf16), row((void *)gate_up, 2 * r, n, bf16), row((void *)gate_up, 2 * r + 1, n, bf16),
                          n, bf16));
}
