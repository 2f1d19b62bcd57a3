/* A whole decode step of a decoder's layers in one call: for each layer the kernels the Python
 * modules call one by one (model_executor/models/decoder.py through cpu_layers, cpu_invariant,
 * quant_linear and the cpu attention backend), with the same arguments in the same order, so the
 * result is bitwise theirs. What it saves is the Python around them: at batch 1 a layer's ten or
 * so module calls, views and argument conversions cost more than its norms, rotary and SiLU.
 *
 * Scope: float32 decode-only steps (one new token per row) of a decoder without q/k norms whose
 * linears are all batch-invariant fp32 GEMMs (gemm.c) or quantized (qdot.c); model_executor/
 * cpu_stack.py decides when it applies and falls back to the modules otherwise. */
#include "kernels.h"
#include <stdlib.h>

/* A linear's row of the layer table, all int64: kind (LINEAR_PANELS or a qdot.c format), weight
 * and bias (addresses; bias 0 for none), out and in features, and the rows from which qdot.c's
 * AMX tiles run (0: never). */
enum { LINEAR_PANELS = -1 };
typedef struct {
    int64_t kind, weight, bias, n, k, tiles_from;
} Linear;

/* One layer's row of the table (cpu_stack.py writes it in this order) */
typedef struct {
    int64_t input_norm, post_attention_norm; /* float32 [hidden] */
    Linear qkv, o, gate_up, down;
} Layer;

static void linear(const Linear *l, const float *x, float *y, long rows, int num_threads) {
    const float *bias = (const float *)(intptr_t)l->bias;
    if (l->kind == LINEAR_PANELS)
        pagoda_gemm_invariant(y, l->n, x, l->k, (const float *)(intptr_t)l->weight, bias, rows, l->n, l->k,
                              num_threads);
    else
        pagoda_qd_matmul((int)l->kind, (const uint8_t *)(intptr_t)l->weight, x, y, bias, rows, l->n, l->k,
                         l->tiles_from > 0 && rows >= l->tiles_from, num_threads);
}

/* Shapes of the model and of this step's paged cache */
typedef struct {
    int64_t hidden, intermediate, num_heads, num_kv_heads, head_dim, block_size, max_blocks;
} Dims;

/* Layers of `table` [num_layers] over `rows` decodes. residual [rows, hidden]: the embeddings in,
 * the stream before the last MLP output out; x [rows, hidden]: that last MLP output (the final
 * norm adds it in). kv_caches [num_layers][2]: each layer's key and value cache addresses;
 * positions int64, slots int64, seq_lens int32 [rows]; block_tables int32 [rows, max_blocks];
 * cos and signed_sin the rotary tables [max_positions, head_dim]. */
void pagoda_decode_layers(const int64_t *table, long num_layers, const int64_t *kv_caches, const Dims *d,
                          float *residual, float *x, const int64_t *positions, const int64_t *slots,
                          const int32_t *block_tables, const int32_t *seq_lens, const float *cos,
                          const float *signed_sin, long rows, float eps, float scale, int num_threads) {
    const long q_size = d->num_heads * d->head_dim, kv_size = d->num_kv_heads * d->head_dim;
    const long qkv_n = q_size + 2 * kv_size;
    float *qkv = malloc(sizeof(float) * rows * qkv_n), *attn = malloc(sizeof(float) * rows * q_size);
    float *gate_up = malloc(sizeof(float) * rows * 2 * d->intermediate);
    float *act = malloc(sizeof(float) * rows * d->intermediate);
    for (long i = 0; i < num_layers; i++) {
        const Layer *l = (const Layer *)(table + i * (sizeof(Layer) / sizeof(int64_t)));
        const float *input_norm = (const float *)(intptr_t)l->input_norm;
        if (i == 0) pagoda_rms_norm(x, residual, input_norm, rows, d->hidden, eps, 0, num_threads);
        else pagoda_add_rms_norm(x, residual, input_norm, rows, d->hidden, eps, 0, num_threads);
        linear(&l->qkv, x, qkv, rows, num_threads);
        pagoda_rotary(qkv, cos, signed_sin, positions, rows, d->num_heads + d->num_kv_heads, d->head_dim, qkv_n, 0,
                      num_threads);
        pagoda_paged_decode_attention(attn, qkv, qkv_n, qkv + q_size, qkv_n, qkv + q_size + kv_size, qkv_n, slots,
                                      (float *)(intptr_t)kv_caches[2 * i], (float *)(intptr_t)kv_caches[2 * i + 1],
                                      block_tables, seq_lens, rows, d->num_heads, d->num_kv_heads, d->head_dim,
                                      d->block_size, d->max_blocks, scale, num_threads);
        linear(&l->o, attn, x, rows, num_threads);
        pagoda_add_rms_norm(x, residual, (const float *)(intptr_t)l->post_attention_norm, rows, d->hidden, eps, 0,
                            num_threads);
        linear(&l->gate_up, x, gate_up, rows, num_threads);
        pagoda_silu_mul(act, gate_up, rows, d->intermediate, 0, num_threads);
        linear(&l->down, act, x, rows, num_threads);
    }
    free(qkv);
    free(attn);
    free(gate_up);
    free(act);
}
