/* A whole decode step of a Llama-shaped model for one row, in one call: every layer's four fused
 * calls, the write of the new K and V into a static cache, and attention over the cache.
 *
 * Why this exists: with the weights streamed by the row kernels, what is left of a decode step
 * beyond its weight-streaming floor is the Python between the calls: per layer, four calls
 * through ctypes, splitting q|k|v, the cache write and PyTorch's SDPA, tens of microseconds of
 * dispatch for a few microseconds of arithmetic, 30 times a SmolLM2 token. Here the layers follow
 * one another in C; the only thing done per layer outside the row kernels is attention for one
 * query row, whose work (nh x S dot products of head_dim, S the cached positions) is tiny next to
 * the weights.
 *
 * The four calls are either fp32/bf16 weights (rowdot.c's kv_dot: SmolLM2 from safetensors, or
 * bf16) or a GGUF's block codes (blockdot.c's kv_blocks, `blocks` = 1: issue 42; SmolLM2's Q4_1
 * file, Qwen2/Qwen3/Llama GGUFs, and Gemma 3, whose layer is the same four calls with its extra
 * norms fused into them). Per layer: RMSNorm + q|k|v (+ q/k norms) + RoPE; o_proj (+ Gemma's post
 * norm) + the residual; RMSNorm + SwiGLU or GeGLU; down_proj (+ post norm) + the residual.
 *
 * The cache is kvviz's StaticKVCache for batch 1, fp32 (fp32 weights, block codes) or bf16 (bf16
 * weights, whose activations rowdot.c keeps in fp32): per layer a K and a V buffer of (nkv,
 * max_len, hs), written at position `slot` (rounded to bf16 as torch rounds, to nearest even) and
 * read over 0..slot, widened to fp32. The maths is the readable model's: q and k rotated by RoPE at
 * `pos` (inside the calls), softmax(q k^T * scale) v with query head h reading KV head
 * h / (nh / nkv) (GQA). kvviz/fast/rowstep.py calls it; tests hold it to the readable model.
 */
#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "rowdot.h"

/* blockdot.c's fused call; its spec (kv_blocks) is only passed through here. */
int kv_block_rows(const void *p, const float *x, int m, float *y, const float *res, const float *cos,
                  const float *sin, int period, int n_threads);

#define STEP_STACK_FLOATS 16384 /* attention scores up to this many stay on the stack */

typedef struct {
    const void *const *ops;   /* 4 per layer: RMSNorm+q|k|v+RoPE, o_proj+res, RMSNorm+SwiGLU, down+res:
                               * kv_dot specs, or kv_blocks specs when `blocks` */
    void *const *kv;          /* 2 per layer: its K and V buffers, (nkv, max_len, hs) each */
    float *q_out;             /* (n_layer, nh hs): each layer's rotated query, or NULL */
    float *attn_out;          /* (n_layer, nh, max_len): each head's softmax row over 0..slot, or NULL */
    float *norm_out;          /* (n_layer, 2, nkv): L2 norms of the new K and V head vectors, or NULL */
    int n_layer;
    int nh, nkv, hs;
    int max_len;   /* positions per head in a K/V buffer */
    int n_embd;    /* C: the residual row */
    int mlp_width; /* the SwiGLU's output: down_proj's input */
    int kv_bf16;   /* 1: the K/V buffers hold bf16, else fp32 */
    int blocks;    /* 1: the ops are kv_blocks (block codes), else kv_dot */
    /* With `blocks`: each layer's RoPE tables, (positions, hs), read at row `pos` (Gemma 3's local and
     * global layers rotate by different tables; kv_dot specs carry their own). NULL otherwise. */
    const float *const *cos;
    const float *const *sin;
    float scale;   /* the attention scale: softmax(q k^T * scale); 0 means 1 / sqrt(hs) */
    /* Each layer's rows per head in its K/V buffers, or NULL: max_len for all. Gemma 3's sliding
     * layers keep a ring of W rows; the step runs only while no ring has wrapped (slot < W: slots
     * are positions), which kvviz.fast.rowstep checks. max_len is then the longest (attn_out's stride). */
    const int *layer_len;
} kv_step;

/* torch's fp32 -> bf16: round to nearest even, NaN to the canonical 0x7FC0. */
static inline uint16_t to_bf16(float f) {
    union { float f; uint32_t u; } v = {.f = f};
    if (f != f) return 0x7FC0;
    return (uint16_t)((v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16);
}

static inline float kv_at(const void *p, size_t i, int bf16) {
    if (!bf16) return ((const float *)p)[i];
    union { uint32_t u; float f; } v = {.u = (uint32_t)((const uint16_t *)p)[i] << 16};
    return v.f;
}

/* The L2 norm of the hs values stored at element `at`: as stored (rounded, for a bf16 cache). */
static inline float stored_norm(const void *buf, int bf16, size_t at, int hs) {
    float ss = 0.0f;
    for (int j = 0; j < hs; j++) {
        const float a = kv_at(buf, at + j, bf16);
        ss += a * a;
    }
    return sqrtf(ss);
}

/* hs values of src into buf at element `at` (a head's row at one position), in the buffer's dtype. */
static inline void put(void *buf, int bf16, size_t at, const float *src, int hs) {
    if (bf16) {
        uint16_t *d = (uint16_t *)buf + at;
        for (int j = 0; j < hs; j++) d[j] = to_bf16(src[j]);
    } else {
        memcpy((float *)buf + at, src, sizeof(float) * hs);
    }
}

/* y (nh, hs) = softmax(q k^T * scale) v for one query row; k, v (nkv, len, hs), positions
 * 0 .. S-1 read. scores: nh x S floats of scratch. probs: where the weights go for a capture,
 * (nh, max_len), or NULL: the live views read them instead of computing q k^T again in PyTorch.
 * Heads are shared among threads when S is long enough to pay for waking them. */
static void attend(const kv_step *s, const float *q, const void *k, const void *v, int S, int len, float *scores,
                   float *y, float *probs, int n_threads) {
    const int nh = s->nh, hs = s->hs, group = s->nh / s->nkv, bf = s->kv_bf16;
    const size_t head = (size_t)len * hs; /* a head's rows in this layer's buffers */
    const float scale = s->scale > 0.0f ? s->scale : 1.0f / sqrtf((float)hs);
#pragma omp parallel for schedule(static) num_threads(n_threads) if (n_threads > 1 && S >= 256)
    for (int h = 0; h < nh; h++) {
        const float *qh = q + (size_t)h * hs;
        const size_t kvh = (size_t)(h / group) * head; /* this query head's K/V head */
        float *sc = scores + (size_t)h * S, *yh = y + (size_t)h * hs;
        float mx = -INFINITY;
        for (int t = 0; t < S; t++) {
            const size_t kt = kvh + (size_t)t * hs;
            float d = 0.0f;
            if (bf)
                for (int j = 0; j < hs; j++) d += qh[j] * kv_at(k, kt + j, 1);
            else
                for (int j = 0; j < hs; j++) d += qh[j] * ((const float *)k)[kt + j];
            sc[t] = d * scale;
            if (sc[t] > mx) mx = sc[t];
        }
        double sum = 0.0;
        for (int t = 0; t < S; t++) {
            sc[t] = expf(sc[t] - mx);
            sum += sc[t];
        }
        const float inv = (float)(1.0 / sum);
        float *ph = probs ? probs + (size_t)h * s->max_len : NULL;
        for (int j = 0; j < hs; j++) yh[j] = 0.0f;
        for (int t = 0; t < S; t++) {
            const float p = sc[t] * inv;
            if (ph) ph[t] = p;
            const size_t vt = kvh + (size_t)t * hs;
            if (bf)
                for (int j = 0; j < hs; j++) yh[j] += p * kv_at(v, vt + j, 1);
            else
                for (int j = 0; j < hs; j++) yh[j] += p * ((const float *)v)[vt + j];
        }
    }
}

/* Fused call j (0..3) of layer i on one row: y = call(x) (+ res); the first call rotates at pos. */
static int call(const kv_step *s, int i, int j, const float *x, const float *res, float *y, int64_t pos, int n_threads) {
    const void *op = s->ops[4 * i + j];
    if (!s->blocks) return kv_dot_rows((const kv_dot *)op, x, 1, res, y, n_threads, j == 0 ? &pos : NULL, 1);
    const size_t at = (size_t)pos * s->hs;
    return kv_block_rows(op, x, 1, y, res, j == 0 ? s->cos[i] + at : NULL, j == 0 ? s->sin[i] + at : NULL, 1, n_threads);
}

/* x (n_embd,): the embedded token in, the residual stream after the last layer out (fp32,
 * contiguous). pos: the position RoPE rotates at; slot: the cache position written (S = slot + 1
 * positions attended). Returns 0, or -1 when scratch memory or a fused call fails (or, never from
 * kvviz.fast.rowstep, which checks them first, a slot out of range or nh not a multiple of nkv). */
int kv_llama_step(const kv_step *s, float *x, int64_t pos, int slot, int n_threads) {
    const int nh = s->nh, nkv = s->nkv, hs = s->hs, C = s->n_embd, S = slot + 1;
    const int qd = nh * hs, kvd = nkv * hs;
    if (slot < 0 || slot >= s->max_len || nh % nkv) return -1;
    float qkv[qd + 2 * kvd], y[qd], h[s->mlp_width], x2[C];
    const size_t n_sc = (size_t)nh * S;
    float sc_stack[n_sc <= STEP_STACK_FLOATS ? n_sc : 1];
    float *scores = n_sc <= STEP_STACK_FLOATS ? sc_stack : malloc(sizeof(float) * n_sc);
    if (!scores) return -1;
    int rc = 0;
    for (int i = 0; i < s->n_layer && rc == 0; i++) {
        void *kc = s->kv[2 * i], *vc = s->kv[2 * i + 1];
        const int len = s->layer_len ? s->layer_len[i] : s->max_len;
        if (slot >= len) {
            rc = -1;
            break;
        }
        const size_t head = (size_t)len * hs;
        rc |= call(s, i, 0, x, NULL, qkv, pos, n_threads); /* RMSNorm, q|k|v (q/k norms), RoPE on q, k */
        for (int g = 0; g < nkv; g++) { /* the new K and V: position `slot` of every KV head */
            const size_t at = g * head + (size_t)slot * hs;
            put(kc, s->kv_bf16, at, qkv + qd + (size_t)g * hs, hs);
            put(vc, s->kv_bf16, at, qkv + qd + kvd + (size_t)g * hs, hs);
            if (s->norm_out) {
                float *n = s->norm_out + (size_t)i * 2 * nkv;
                n[g] = stored_norm(kc, s->kv_bf16, at, hs);
                n[nkv + g] = stored_norm(vc, s->kv_bf16, at, hs);
            }
        }
        if (s->q_out) memcpy(s->q_out + (size_t)i * qd, qkv, sizeof(float) * qd);
        float *probs = s->attn_out ? s->attn_out + (size_t)i * nh * s->max_len : NULL;
        attend(s, qkv, kc, vc, S, len, scores, y, probs, n_threads); /* (nh, hs): the heads side by side */
        rc |= call(s, i, 1, y, x, x2, pos, n_threads); /* x + y Wo^T (post-normed: Gemma) */
        rc |= call(s, i, 2, x2, NULL, h, pos, n_threads); /* silu (gelu) of gate times up, of RMSNorm(x) */
        rc |= call(s, i, 3, h, x2, x, pos, n_threads); /* x + h Wd^T (post-normed), back into x */
    }
    if (scores != sc_stack) free(scores);
    return rc ? -1 : 0;
}

/* The constant the Python side checks before it trusts this build. */
int kv_step_struct_size(void) { return (int)sizeof(kv_step); }
