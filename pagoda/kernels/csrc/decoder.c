/* A whole step of a decoder's layers in one call: for each layer the kernels the Python modules
 * call one by one (model_executor/models/decoder.py through cpu_layers, cpu_invariant, cpu_linear,
 * quant_linear and the cpu attention backend), with the same arguments in the same order, so the
 * result is bitwise theirs. What it saves is the Python around them: at batch 1 a layer's ten or so
 * module calls, views and argument conversions cost more than its norms, rotary and attention.
 *
 * Scope: steps (decodes, prefill chunks or both) of a float32 decoder whose linears are all
 * batch-invariant fp32 GEMMs (gemm.c) or quantized (qdot.c), or of a bfloat16 one whose linears are
 * all on AMX tiles (bf16.c), its q/k norms (Qwen3) if any on fused.c; model_executor/cpu_stack.py
 * decides when it applies and runs the modules otherwise. */
#include "vec.h"
#include "kernels.h"

#define AT(type, address) ((type)(intptr_t)(address)) /* an address the tables hold as int64 */

/* A linear's fields in the layer table, all int64: kind (LINEAR_PANELS, LINEAR_BF16 or a qdot.c
 * format), weight and bias (addresses; bias float32, 0 for none), out and in features, and `extra`:
 * qdot.c's tiles_from for a quantized linear, the plain weight [n, k] (the GEMV's, for one row) of
 * a bf16 one, whose `weight` is its AMX tiles. */
enum { LINEAR_PANELS = -1, LINEAR_BF16 = -2 };
typedef struct {
    int64_t kind, weight, bias, n, k, extra;
} Linear;

/* One layer's row of the table (cpu_stack.py writes it in this order) */
typedef struct {
    int64_t input_norm, post_attention_norm; /* float32 [hidden] */
    int64_t q_norm, k_norm;                  /* float32 [head_dim], or 0: no q/k norms */
    Linear qkv, o, gate_up, down;
    int64_t rotated; /* 0: its queries and keys take no rotary embedding (SmolLM3's NoPE layers) */
} Layer;

/* y = x @ w.T (+ bias) as the linear's module computes it on the step's step_rows rows: rows of
 * float32, or of bf16 for LINEAR_BF16. rows <= step_rows: the last layer's rows read. A bf16 linear
 * takes the GEMV where the step is one row (as the module does), the tiles otherwise, however few
 * of its rows are computed: the two sum in different orders. */
static void linear(const Linear *l, const void *x, void *y, long rows, long step_rows, int num_threads) {
    const float *bias = AT(const float *, l->bias);
    if (l->kind == LINEAR_PANELS)
        pagoda_gemm_invariant(y, l->n, x, l->k, AT(const float *, l->weight), bias, rows, l->n, l->k, num_threads);
    else if (l->kind == LINEAR_BF16 && step_rows == 1)
        pagoda_gemv_bf16(AT(const uint16_t *, l->extra), x, 1, y, 1, bias, l->n, l->k, num_threads);
    else if (l->kind == LINEAR_BF16)
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
        pagoda_gemm_bf16(y, x, AT(const uint16_t *, l->weight), bias, rows, l->n, l->k, num_threads);
#else
        abort(); /* cpu_stack.py builds bf16 tables only where the kernels have AMX */
#endif
    else
        pagoda_qd_matmul((int)l->kind, AT(const uint8_t *, l->weight), x, y, bias, rows, l->n, l->k, l->extra,
                         num_threads);
}

/* Shapes of the model and of its paged cache; kv_bf16: the cache holds bfloat16; bf16: so do the
 * model's activations (and its norm weights and rotary tables), float32 otherwise */
typedef struct {
    int64_t hidden, intermediate, num_heads, num_kv_heads, head_dim, block_size, kv_bf16, bf16;
} Dims;

/* One step's rows and attention metadata as the cpu backend's float32 metadata holds them
 * (addresses as int64): positions and slots [rows]; the decodes first, their block tables int32
 * [num_decodes, decode_max_blocks] and seq_lens int32 [num_decodes]; then the prefill chunks, their
 * block tables [num_prefills, prefill_max_blocks], query_start int32 [num_prefills + 1] (their rows
 * of the step) and seq_lens [num_prefills]; last, prefill_read: 0 where the caller reads every row's
 * output, else int32 [num_prefills], how many of each chunk's last rows it reads (the decodes' it
 * always reads). */
typedef struct {
    int64_t rows, positions, slots;
    int64_t num_decodes, decode_tables, decode_max_blocks, decode_seq_lens;
    int64_t num_prefills, prefill_tables, prefill_max_blocks, query_start, prefill_seq_lens;
    int64_t prefill_read;
} Step;

/* The cpu attention backend's float32 forward (attention/cpu_backend.py) on the rows' queries, keys
 * and values (rows q_stride, k_stride and v_stride floats apart): the prefill rows' keys and values
 * stored, then the decodes (which store their own) attended, then the prefill rows: those of
 * prefill_q (rows prefill_q_stride apart, each chunk's at rows query_start[i] ..
 * query_start[i + 1] - 1 of it and of out), q itself unless only some are attended (attend_read). */
static void attend_rows(const Step *s, const Dims *d, void *k_cache, void *v_cache, const float *q, long q_stride,
                        const float *k, long k_stride, const float *v, long v_stride, const float *prefill_q,
                        long prefill_q_stride, const int32_t *query_start, float *out, float scale,
                        int num_threads) {
    const long nd = s->num_decodes;
    const int64_t *slots = AT(const int64_t *, s->slots);
    if (nd < s->rows)
        pagoda_store_kv(k_cache, v_cache, k + nd * k_stride, k_stride, v + nd * v_stride, v_stride, slots + nd,
                        s->rows - nd, d->num_kv_heads * d->head_dim, (int)d->kv_bf16, num_threads);
    if (nd)
        pagoda_paged_decode_attention(out, q, q_stride, k, k_stride, v, v_stride, slots, k_cache, v_cache,
                                      AT(const int32_t *, s->decode_tables), AT(const int32_t *, s->decode_seq_lens),
                                      nd, d->num_heads, d->num_kv_heads, d->head_dim, d->block_size,
                                      s->decode_max_blocks, scale, (int)d->kv_bf16, num_threads);
    if (s->num_prefills && query_start[s->num_prefills] > query_start[0])
        pagoda_prefill_attention(out, prefill_q, prefill_q_stride, k_cache, v_cache,
                                 AT(const int32_t *, s->prefill_tables), query_start,
                                 AT(const int32_t *, s->prefill_seq_lens), s->num_prefills, d->num_heads,
                                 d->num_kv_heads, d->head_dim, d->block_size, s->prefill_max_blocks, scale,
                                 (int)d->kv_bf16, num_threads);
}

static void attend(const Step *s, const Dims *d, void *k_cache, void *v_cache, const float *q, long q_stride,
                   const float *k, long k_stride, const float *v, long v_stride, float *out, float scale,
                   int num_threads) {
    attend_rows(s, d, k_cache, v_cache, q, q_stride, k, k_stride, v, v_stride, q, q_stride,
                AT(const int32_t *, s->query_start), out, scale, num_threads);
}

/* The rows whose outputs the caller reads (step->prefill_read): the decodes, then each chunk's last
 * prefill_read[i] rows, in order. read[j]: the j-th one's row; query_read: the chunks' query_start
 * over them (from num_decodes, as the step's). Returns how many. */
static long rows_read(const Step *s, long *read, int32_t *query_read) {
    const int32_t *query_start = AT(const int32_t *, s->query_start), *tail = AT(const int32_t *, s->prefill_read);
    long n = 0;
    for (; n < s->num_decodes; n++) read[n] = n;
    query_read[0] = (int32_t)n;
    for (long i = 0; i < s->num_prefills; i++) {
        for (long r = query_start[i + 1] - tail[i]; r < query_start[i + 1]; r++) read[n++] = r;
        query_read[i + 1] = (int32_t)n;
    }
    return n;
}

/* attend() for only the rows read (n of them, `read`): every row's keys and values stored and the
 * decodes attended as attend() does, then the chunks' rows read, their queries gathered into q_read
 * first; out: their outputs, the j-th read row's at row j. Each is the same bits as attend() gives
 * it: the prefill kernel computes a row alike whichever other rows it computes. */
static void attend_read(const Step *s, const Dims *d, void *k_cache, void *v_cache, const float *q, long q_stride,
                        const float *k, long k_stride, const float *v, long v_stride, const long *read, long n,
                        const int32_t *query_read, float *q_read, float *out, float scale, int num_threads) {
    const long q_size = d->num_heads * d->head_dim;
    for (long j = s->num_decodes; j < n; j++)
        memcpy(q_read + j * q_size, q + read[j] * q_stride, q_size * sizeof(float));
    attend_rows(s, d, k_cache, v_cache, q, q_stride, k, k_stride, v, v_stride, q_read, q_size, query_read, out, scale,
                num_threads);
}

/* heads [rows][heads * head_dim] copied out of src (rows src_stride values apart) and normalized
 * per head in place: Qwen3's q or k norm as the CpuRMSNorm module computes it on a contiguous copy */
static void norm_heads(void *heads, const void *src, long src_stride, long rows, long width, const void *weight,
                       long head_dim, float eps, int bf16, int num_threads) {
    const size_t es = value_size(bf16);
    for (long r = 0; r < rows; r++)
        memcpy((char *)heads + r * width * es, (const char *)src + r * src_stride * es, es * width);
    pagoda_rms_norm(heads, heads, weight, rows * (width / head_dim), head_dim, eps, bf16, num_threads);
}

/* rows of bf16 (src_stride values apart) widened into float32 rows (dst_stride apart), width each */
static void widen_rows(float *dst, long dst_stride, const uint16_t *src, long src_stride, long rows, long width) {
    for (long r = 0; r < rows; r++) bf16_to_floats(dst + r * dst_stride, src + r * src_stride, width);
}

/* Layers of `table` [num_layers] over a step's rows, float32 or bf16 (d->bf16). residual [rows,
 * hidden]: the embeddings in, the stream before the last MLP output out; x [rows, hidden]: that last
 * MLP output (the final norm adds it in). Where the caller reads only some rows
 * (step->prefill_read), x and residual hold those rows' only, in order, in their first rows, and
 * the rest are undefined. kv_caches [num_layers][2]: each layer's key and value cache addresses;
 * cos and signed_sin the rotary tables [max_positions, head_dim]. A bf16 model's attention is the
 * cpu backend's: its queries, keys and values widened to float32 exactly, attended as float32 on
 * its bf16 cache, the output rounded to bf16 once. */
void pagoda_decoder_layers(const int64_t *table, long num_layers, const int64_t *kv_caches, const Dims *d,
                           const Step *step, void *residual, void *x, const void *cos, const void *signed_sin,
                           float eps, float scale, float residual_multiplier, int num_threads) {
    const long rows = step->rows, q_size = d->num_heads * d->head_dim, kv_size = d->num_kv_heads * d->head_dim;
    const long qkv_n = q_size + 2 * kv_size;
    const int bf16 = (int)d->bf16;
    const size_t es = value_size(bf16);
#define AT_VALUE(buffer, i) ((char *)(buffer) + (i) * es) /* value i of an activation buffer */
    void *qkv = malloc(es * rows * qkv_n), *attn = malloc(es * rows * q_size);
    void *q_heads = malloc(es * rows * q_size), *k_heads = malloc(es * rows * kv_size);
    void *gate_up = malloc(es * rows * 2 * d->intermediate), *act = malloc(es * rows * d->intermediate);
    /* bf16: the step's queries, keys and values widened (rows of qkv_n) and the attention's output */
    float *wide = bf16 ? malloc(sizeof(float) * rows * qkv_n) : NULL;
    float *wide_attn = bf16 ? malloc(sizeof(float) * rows * q_size) : NULL;
    const int64_t *positions = AT(const int64_t *, step->positions);
    /* The rows read, where the caller reads only some (step->prefill_read): past its attention the
     * last layer computes those only, every row's keys and values stored as before. */
    long *read = NULL, num_read = rows;
    int32_t *query_read = NULL;
    float *q_read = NULL;
    if (step->prefill_read) {
        read = malloc(sizeof(long) * rows);
        query_read = malloc(sizeof(int32_t) * (step->num_prefills + 1));
        num_read = rows_read(step, read, query_read);
        q_read = malloc(sizeof(float) * num_read * q_size);
    }
    for (long i = 0; i < num_layers; i++) {
        const Layer *l = (const Layer *)(table + i * (sizeof(Layer) / sizeof(int64_t)));
        const void *input_norm = AT(const void *, l->input_norm);
        if (i == 0) pagoda_rms_norm(x, residual, input_norm, rows, d->hidden, eps, bf16, num_threads);
        else pagoda_add_rms_norm(x, residual, input_norm, rows, d->hidden, eps, bf16, num_threads);
        linear(&l->qkv, x, qkv, rows, rows, num_threads);
        void *q = qkv, *k = AT_VALUE(qkv, q_size), *v = AT_VALUE(qkv, q_size + kv_size);
        long q_stride = qkv_n, k_stride = qkv_n;
        if (l->q_norm) { /* Qwen3: queries and keys normalized per head into their own rows, then rotated */
            q = q_heads, k = k_heads, q_stride = q_size, k_stride = kv_size;
            norm_heads(q, qkv, qkv_n, rows, q_size, AT(const void *, l->q_norm), d->head_dim, eps, bf16, num_threads);
            norm_heads(k, AT_VALUE(qkv, q_size), qkv_n, rows, kv_size, AT(const void *, l->k_norm), d->head_dim, eps,
                       bf16, num_threads);
            if (l->rotated) {
                pagoda_rotary(q, cos, signed_sin, positions, rows, d->num_heads, d->head_dim, q_stride, bf16,
                              num_threads);
                pagoda_rotary(k, cos, signed_sin, positions, rows, d->num_kv_heads, d->head_dim, k_stride, bf16,
                              num_threads);
            }
        } else if (l->rotated) { /* queries and keys rotated in one go, in place in qkv */
            pagoda_rotary(qkv, cos, signed_sin, positions, rows, d->num_heads + d->num_kv_heads, d->head_dim, qkv_n,
                          bf16, num_threads);
        }
        if (bf16) { /* attended as float32: q, k and v widened, the output rounded below */
            widen_rows(wide, qkv_n, q, q_stride, rows, q_size);
            widen_rows(wide + q_size, qkv_n, k, k_stride, rows, kv_size);
            widen_rows(wide + q_size + kv_size, qkv_n, v, qkv_n, rows, kv_size);
            q = wide, k = wide + q_size, v = wide + q_size + kv_size, q_stride = k_stride = qkv_n;
        }
        void *k_cache = AT(void *, kv_caches[2 * i]), *v_cache = AT(void *, kv_caches[2 * i + 1]);
        float *out = bf16 ? wide_attn : attn;
        const int only_read = read && i == num_layers - 1;
        if (only_read)
            attend_read(step, d, k_cache, v_cache, q, q_stride, k, k_stride, v, qkv_n, read, num_read, query_read,
                        q_read, out, scale, num_threads);
        else
            attend(step, d, k_cache, v_cache, q, q_stride, k, k_stride, v, qkv_n, out, scale, num_threads);
        const long n = only_read ? num_read : rows; /* the rows from here on */
        if (only_read) /* the rows read move up to rows 0 .. n - 1 (read[j] >= j: none is overwritten first) */
            for (long j = 0; j < n; j++)
                if (read[j] != j) memcpy(AT_VALUE(residual, j * d->hidden), AT_VALUE(residual, read[j] * d->hidden),
                                         es * d->hidden);
        if (n == 0) break;
        if (bf16) floats_to_bf16(attn, wide_attn, n * q_size);
        linear(&l->o, attn, x, n, rows, num_threads);
        if (residual_multiplier != 1.f) pagoda_mul(x, residual_multiplier, n, d->hidden, bf16, num_threads);
        pagoda_add_rms_norm(x, residual, AT(const void *, l->post_attention_norm), n, d->hidden, eps, bf16,
                            num_threads);
        linear(&l->gate_up, x, gate_up, n, rows, num_threads);
        pagoda_silu_mul(act, gate_up, n, d->intermediate, bf16, num_threads);
        linear(&l->down, act, x, n, rows, num_threads);
        if (residual_multiplier != 1.f) pagoda_mul(x, residual_multiplier, n, d->hidden, bf16, num_threads);
    }
#undef AT_VALUE
    free(qkv);
    free(q_heads);
    free(k_heads);
    free(attn);
    free(gate_up);
    free(act);
    free(wide);
    free(wide_attn);
    free(read);
    free(query_read);
    free(q_read);
}
