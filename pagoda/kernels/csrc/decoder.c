/* A whole step of a decoder's layers in one call: for each layer the kernels the Python modules
 * call one by one (model_executor/models/decoder.py through cpu_layers, cpu_invariant, quant_linear
 * and the cpu attention backend), with the same arguments in the same order, so the result is
 * bitwise theirs. What it saves is the Python around them: at batch 1 a layer's ten or so module
 * calls, views and argument conversions cost more than its norms, rotary and attention.
 *
 * Scope: float32 steps (decodes, prefill chunks or both) of a decoder whose linears are all
 * batch-invariant fp32 GEMMs (gemm.c) or quantized (qdot.c), its q/k norms (Qwen3) if any on fused.c;
 * model_executor/cpu_stack.py decides when it applies and runs the modules otherwise. */
#include "kernels.h"
#include <stdlib.h>
#include <string.h>

#define AT(type, address) ((type)(intptr_t)(address)) /* an address the tables hold as int64 */

/* A linear's fields in the layer table, all int64: kind (LINEAR_PANELS or a qdot.c format), weight
 * and bias (addresses; bias 0 for none), out and in features, and qdot.c's tiles_from. */
enum { LINEAR_PANELS = -1 };
typedef struct {
    int64_t kind, weight, bias, n, k, tiles_from;
} Linear;

/* One layer's row of the table (cpu_stack.py writes it in this order) */
typedef struct {
    int64_t input_norm, post_attention_norm; /* float32 [hidden] */
    int64_t q_norm, k_norm;                  /* float32 [head_dim], or 0: no q/k norms */
    Linear qkv, o, gate_up, down;
} Layer;

static void linear(const Linear *l, const float *x, float *y, long rows, int num_threads) {
    const float *bias = AT(const float *, l->bias);
    if (l->kind == LINEAR_PANELS)
        pagoda_gemm_invariant(y, l->n, x, l->k, AT(const float *, l->weight), bias, rows, l->n, l->k, num_threads);
    else
        pagoda_qd_matmul((int)l->kind, AT(const uint8_t *, l->weight), x, y, bias, rows, l->n, l->k, l->tiles_from,
                         num_threads);
}

/* Shapes of the model and of its paged cache; kv_bf16: the cache holds bfloat16 */
typedef struct {
    int64_t hidden, intermediate, num_heads, num_kv_heads, head_dim, block_size, kv_bf16;
} Dims;

/* One step's rows and attention metadata as the cpu backend's float32 metadata holds them
 * (addresses as int64): positions and slots [rows]; the decodes first, their block tables int32
 * [num_decodes, decode_max_blocks] and seq_lens int32 [num_decodes]; then the prefill chunks, their
 * block tables [num_prefills, prefill_max_blocks], query_start int32 [num_prefills + 1] (their rows
 * of the step) and seq_lens [num_prefills]. */
typedef struct {
    int64_t rows, positions, slots;
    int64_t num_decodes, decode_tables, decode_max_blocks, decode_seq_lens;
    int64_t num_prefills, prefill_tables, prefill_max_blocks, query_start, prefill_seq_lens;
} Step;

/* The cpu attention backend's float32 forward (attention/cpu_backend.py) on the rows' queries, keys
 * and values (rows q_stride, k_stride and v_stride floats apart): the prefill rows' keys and values
 * stored, then the decodes (which store their own) attended, then the prefill rows */
static void attend(const Step *s, const Dims *d, void *k_cache, void *v_cache, const float *q, long q_stride,
                   const float *k, long k_stride, const float *v, long v_stride, float *out, float scale,
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
    if (s->num_prefills)
        pagoda_prefill_attention(out, q, q_stride, k_cache, v_cache, AT(const int32_t *, s->prefill_tables),
                                 AT(const int32_t *, s->query_start), AT(const int32_t *, s->prefill_seq_lens),
                                 s->num_prefills, d->num_heads, d->num_kv_heads, d->head_dim, d->block_size,
                                 s->prefill_max_blocks, scale, (int)d->kv_bf16, num_threads);
}

/* heads [rows][heads * head_dim] copied out of src (rows src_stride floats apart) and normalized
 * per head in place: Qwen3's q or k norm as the CpuRMSNorm module computes it on a contiguous copy */
static void norm_heads(float *heads, const float *src, long src_stride, long rows, long width, const float *weight,
                       long head_dim, float eps, int num_threads) {
    for (long r = 0; r < rows; r++) memcpy(heads + r * width, src + r * src_stride, sizeof(float) * width);
    pagoda_rms_norm(heads, heads, weight, rows * (width / head_dim), head_dim, eps, 0, num_threads);
}

/* Layers of `table` [num_layers] over a step's rows. residual [rows, hidden]: the embeddings in,
 * the stream before the last MLP output out; x [rows, hidden]: that last MLP output (the final
 * norm adds it in). kv_caches [num_layers][2]: each layer's key and value cache addresses; cos
 * and signed_sin the rotary tables [max_positions, head_dim]. */
void pagoda_decoder_layers(const int64_t *table, long num_layers, const int64_t *kv_caches, const Dims *d,
                           const Step *step, float *residual, float *x, const float *cos, const float *signed_sin,
                           float eps, float scale, int num_threads) {
    const long rows = step->rows, q_size = d->num_heads * d->head_dim, kv_size = d->num_kv_heads * d->head_dim;
    const long qkv_n = q_size + 2 * kv_size;
    float *qkv = malloc(sizeof(float) * rows * qkv_n), *attn = malloc(sizeof(float) * rows * q_size);
    float *q_heads = malloc(sizeof(float) * rows * q_size), *k_heads = malloc(sizeof(float) * rows * kv_size);
    float *gate_up = malloc(sizeof(float) * rows * 2 * d->intermediate);
    float *act = malloc(sizeof(float) * rows * d->intermediate);
    const int64_t *positions = AT(const int64_t *, step->positions);
    for (long i = 0; i < num_layers; i++) {
        const Layer *l = (const Layer *)(table + i * (sizeof(Layer) / sizeof(int64_t)));
        const float *input_norm = AT(const float *, l->input_norm);
        if (i == 0) pagoda_rms_norm(x, residual, input_norm, rows, d->hidden, eps, 0, num_threads);
        else pagoda_add_rms_norm(x, residual, input_norm, rows, d->hidden, eps, 0, num_threads);
        linear(&l->qkv, x, qkv, rows, num_threads);
        float *q = qkv, *k = qkv + q_size;
        long q_stride = qkv_n, k_stride = qkv_n;
        if (l->q_norm) { /* Qwen3: queries and keys normalized per head into their own rows, then rotated */
            q = q_heads, k = k_heads, q_stride = q_size, k_stride = kv_size;
            norm_heads(q, qkv, qkv_n, rows, q_size, AT(const float *, l->q_norm), d->head_dim, eps, num_threads);
            norm_heads(k, qkv + q_size, qkv_n, rows, kv_size, AT(const float *, l->k_norm), d->head_dim, eps,
                       num_threads);
            pagoda_rotary(q, cos, signed_sin, positions, rows, d->num_heads, d->head_dim, q_stride, 0, num_threads);
            pagoda_rotary(k, cos, signed_sin, positions, rows, d->num_kv_heads, d->head_dim, k_stride, 0, num_threads);
        } else { /* queries and keys rotated in one go, in place in qkv */
            pagoda_rotary(qkv, cos, signed_sin, positions, rows, d->num_heads + d->num_kv_heads, d->head_dim, qkv_n,
                          0, num_threads);
        }
        attend(step, d, AT(void *, kv_caches[2 * i]), AT(void *, kv_caches[2 * i + 1]), q, q_stride, k, k_stride,
               qkv + q_size + kv_size, qkv_n, attn, scale, num_threads);
        linear(&l->o, attn, x, rows, num_threads);
        pagoda_add_rms_norm(x, residual, AT(const float *, l->post_attention_norm), rows, d->hidden, eps, 0,
                            num_threads);
        linear(&l->gate_up, x, gate_up, rows, num_threads);
        pagoda_silu_mul(act, gate_up, rows, d->intermediate, 0, num_threads);
        linear(&l->down, act, x, rows, num_threads);
    }
    free(qkv);
    free(q_heads);
    free(k_heads);
    free(attn);
    free(gate_up);
    free(act);
}
