/* A few fp32 rows through weights kept as a GGUF file keeps them: int8 codes in blocks, each block
 * with its own scale (and, for the "_1" and K types, its own offset):
 *   w[r, i] = scale[r, b] * codes[r, i] - minv[r, b],   b = i / block
 *   y[row, r] = sum_i w[r, i] x[row, i]
 *             = sum_b scale[r, b] * (sum_{i in b} codes[r, i] x[i]) - sum_b minv[r, b] * (sum_{i in b} x[i])
 *
 * Why this exists: a decode step of Gemma 3 270M streams every weight once, and in fp32 its tied
 * 262,144 x 640 head alone is 640 MiB, more than the rest of the model. Kept as the file's int8
 * codes with an fp32 scale per block of 32 (the Q8_0 head: 1.125 bytes a weight), the same values
 * stream in under a third of the bytes. The weights are not approximated: scale * code - minv is
 * exactly what gguf's dequantizer computes for each weight (kvviz/engine/loading/gguf_codes.py;
 * tests check it value for value); only the order of the additions differs from an fp32 matmul,
 * as it does between any two matmul kernels. The activations stay fp32: nothing is quantized.
 *
 * Segments sit side by side in the output (q|k|v; gate|up), each with its own block size (16 or
 * 32) and types. A thread owns one contiguous stretch of output rows, read front to back.
 * kvviz/fast/rowops.py builds this file with the others; kvviz/fast/blockdot.py calls it.
 */
#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "rowcommon.h"

#define MAX_BSEG 3
#define MAX_BLOCKS_STACK 4096 /* per-block input sums up to this many stay on the stack */

typedef struct {
    const int8_t *codes[MAX_BSEG]; /* segment s: (n_out[s], n_in) row-major */
    const float *scale[MAX_BSEG];  /* (n_out[s], n_in / block[s]) */
    const float *minv[MAX_BSEG];   /* the same shape, or NULL: no offsets */
    const float *bias[MAX_BSEG];   /* (n_out[s],) added to each output, or NULL (Qwen2's q/k/v) */
    int n_out[MAX_BSEG];
    int block[MAX_BSEG]; /* 16 or 32 */
    int n_seg;
    int n_in;
    /* What a Gemma or Llama layer does around its matmuls, fused so a step is a few calls, not dozens of ops: */
    const float *norm_w; /* (n_in,) or NULL: RMSNorm each input row first, scaled by norm_w (Gemma's 1 + w) */
    float eps;
    int glu;              /* two segments, gate and up, n_out[0] outputs: 1 GeGLU, y = gelu_tanh(gate) * up
                           * (Gemma); 2 SwiGLU, y = silu(gate) * up (Llama); 0 none */
    const float *post_w;  /* (outputs,) or NULL: RMSNorm each output row, scaled by post_w, then + res */
    float post_eps;
    /* The q and k heads (head_dim > 0): RMSNorm over each of the first n_q heads (scaled by q_norm)
     * and the next n_k (by k_norm) when those are given (Gemma, Qwen3; NULL for Llama), then RoPE
     * at the row's position when the call gets tables. */
    const float *q_norm;
    const float *k_norm;
    int n_q, n_k, head_dim;
    float qk_eps;
} kv_blocks;

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* Eight codes widened to fp32. */
static inline __m256 cvt8(const int8_t *c) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)c)));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The four products of one block of 32 codes with x, summed lane by lane. */
static inline __m256 block32(const int8_t *c, const float *x) {
    __m256 p = _mm256_fmadd_ps(cvt8(c + 8), _mm256_loadu_ps(x + 8), _mm256_mul_ps(cvt8(c), _mm256_loadu_ps(x)));
    p = _mm256_fmadd_ps(cvt8(c + 16), _mm256_loadu_ps(x + 16), p);
    return _mm256_fmadd_ps(cvt8(c + 24), _mm256_loadu_ps(x + 24), p);
}

/* The two products of one block of 16 (Q6_K's scales). */
static inline __m256 block16(const int8_t *c, const float *x) {
    return _mm256_fmadd_ps(cvt8(c + 8), _mm256_loadu_ps(x + 8), _mm256_mul_ps(cvt8(c), _mm256_loadu_ps(x)));
}

static inline __attribute__((always_inline)) __m256 block_of(const int8_t *c, const float *x, const int block) {
    return block == 32 ? block32(c, x) : block16(c, x);
}

/* sum_b scale[b] * dot(codes of block b, x of block b) over nb blocks: each block's products
 * summed in lanes, then scaled into one of two accumulators (even and odd blocks), so consecutive
 * blocks do not wait on one another. Called with a constant block, so each size gets its own loop. */
static inline __attribute__((always_inline)) float row_blocks(const int8_t *c, const float *s, const float *x, int nb,
                                                              const int block) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    int b = 0;
    for (; b + 2 <= nb; b += 2) {
        const size_t at = (size_t)b * block;
        a0 = _mm256_fmadd_ps(_mm256_set1_ps(s[b]), block_of(c + at, x + at, block), a0);
        a1 = _mm256_fmadd_ps(_mm256_set1_ps(s[b + 1]), block_of(c + at + block, x + at + block, block), a1);
    }
    if (b < nb) a0 = _mm256_fmadd_ps(_mm256_set1_ps(s[b]), block_of(c + (size_t)b * block, x + (size_t)b * block, block), a0);
    return hsum8(_mm256_add_ps(a0, a1));
}

#else /* portable C */

static inline float row_blocks(const int8_t *c, const float *s, const float *x, int nb, int block) {
    float acc = 0.0f;
    for (int b = 0; b < nb; b++) {
        float d = 0.0f;
        const int8_t *cb = c + (size_t)b * block;
        const float *xb = x + (size_t)b * block;
#pragma omp simd reduction(+ : d)
        for (int i = 0; i < block; i++) d += (float)cb[i] * xb[i];
        acc += s[b] * d;
    }
    return acc;
}
#endif

static float row_b32(const int8_t *c, const float *s, const float *x, int nb) { return row_blocks(c, s, x, nb, 32); }
static float row_b16(const int8_t *c, const float *s, const float *x, int nb) { return row_blocks(c, s, x, nb, 16); }

/* Rows r0..r1 of segment s for every input row; outputs at column col + r of each row of y.
 * sx: each input row's per-block sums of x at this segment's block size (when it has offsets). */
static void segment(const kv_blocks *p, int s, int r0, int r1, int col, const float *x, int m, const float *sx,
                    int ld, float *y) {
    const int n_in = p->n_in, block = p->block[s], nb = n_in / block;
    const float *mv = p->minv[s], *bias = p->bias[s];
    for (int r = r0; r < r1; r++) {
        const int8_t *c = p->codes[s] + (size_t)r * n_in;
        const float *sc = p->scale[s] + (size_t)r * nb;
        for (int i = 0; i < m; i++) { /* the row's codes stay in L1 for the next input row */
            const float *xi = x + (size_t)i * n_in;
            float v = block == 32 ? row_b32(c, sc, xi, nb) : row_b16(c, sc, xi, nb);
            if (mv) {
                const float *mr = mv + (size_t)r * nb, *si = sx + (size_t)i * nb;
                float o = 0.0f;
                for (int b = 0; b < nb; b++) o += mr[b] * si[b];
                v -= o;
            }
            if (bias) v += bias[r]; /* after the sum, as F.linear adds it */
            y[(size_t)i * ld + col + r] = v;
        }
    }
}

/* GELU, tanh approximation (PyTorch's approximate="tanh"). */
static inline float gelu_tanh(float g) {
    const float k = 0.7978845608028654f; /* sqrt(2 / pi) */
    return 0.5f * g * (1.0f + tanhf(k * (g + 0.044715f * g * g * g)));
}

/* SiLU as rowdot.c computes it (exp_poly: no libm call). */
static inline float silu(float g) { return g / (1.0f + exp_poly(-g)); }

static int matmul(const kv_blocks *p, const float *x, int m, float *y, int n_threads);

/* y (m, outputs) = epilogue(RMSNorm(x) @ W^T + b) (+ res): the optional input norm, the segments side
 * by side (each with its bias), then GeGLU or SwiGLU or the output norm plus the residual, or the
 * q/k heads' norms and RoPE.
 * x (m, n_in), res (m, outputs) or NULL; cos and sin (period, head_dim): row i at row i % period,
 * or NULL for no RoPE. Returns 0, or -1 when a block size is not 16 or 32 or a buffer cannot be had. */
int kv_block_rows(const kv_blocks *p, const float *x, int m, float *y, const float *res, const float *cos,
                  const float *sin, int period, int n_threads) {
    int width = 0;
    for (int s = 0; s < p->n_seg; s++) width += p->n_out[s];
    const int outs = p->glu ? p->n_out[0] : width;
    float *xn = NULL, *raw = NULL;
    if (p->norm_w) {
        xn = malloc(sizeof(float) * (size_t)m * p->n_in);
        if (!xn) return -1;
        for (int i = 0; i < m; i++) rms_norm(x + (size_t)i * p->n_in, p->n_in, p->norm_w, p->eps, xn + (size_t)i * p->n_in);
        x = xn;
    }
    const int epilogue = p->glu || p->post_w || res;
    if (epilogue) {
        raw = malloc(sizeof(float) * (size_t)m * width);
        if (!raw) {
            free(xn);
            return -1;
        }
    }
    int rc = matmul(p, x, m, epilogue ? raw : y, n_threads);
    if (rc == 0 && epilogue) {
        for (int i = 0; i < m; i++) {
            float *r = raw + (size_t)i * width, *yi = y + (size_t)i * outs;
            if (p->glu == 1)
                for (int j = 0; j < outs; j++) r[j] = gelu_tanh(r[j]) * r[outs + j];
            else if (p->glu == 2)
                for (int j = 0; j < outs; j++) r[j] = silu(r[j]) * r[outs + j];
            if (p->post_w) rms_norm(r, outs, p->post_w, p->post_eps, r);
            const float *ri = res ? res + (size_t)i * outs : NULL;
            for (int j = 0; j < outs; j++) yi[j] = ri ? ri[j] + r[j] : r[j];
        }
    }
    if (rc == 0 && p->head_dim > 0) {
        const int hd = p->head_dim;
        for (int i = 0; i < m; i++) {
            const float *c = cos ? cos + (size_t)(i % period) * hd : NULL, *s = sin ? sin + (size_t)(i % period) * hd : NULL;
            for (int h = 0; h < p->n_q + p->n_k; h++) {
                float *head = y + (size_t)i * outs + (size_t)h * hd;
                const float *w = h < p->n_q ? p->q_norm : p->k_norm;
                if (w) rms_norm(head, hd, w, p->qk_eps, head);
                if (c) rope_head(head, c, s, hd);
            }
        }
    }
    free(raw);
    free(xn);
    return rc;
}

static int matmul(const kv_blocks *p, const float *x, int m, float *y, int n_threads) {
    const int n_in = p->n_in;
    int ld = 0, need_sums = 0, min_block = 32;
    for (int s = 0; s < p->n_seg; s++) {
        if ((p->block[s] != 16 && p->block[s] != 32) || n_in % p->block[s]) return -1;
        ld += p->n_out[s];
        if (p->minv[s]) need_sums = 1;
        if (p->block[s] < min_block) min_block = p->block[s];
    }
    /* Per-block sums of each input row at the smallest block size; a 32-block segment adds pairs. */
    const int nb16 = n_in / 16, nbs = n_in / min_block;
    const size_t n_sums = need_sums ? (size_t)m * nbs : 1;
    float stack[n_sums <= MAX_BLOCKS_STACK ? n_sums : 1];
    float *sums = n_sums <= MAX_BLOCKS_STACK ? stack : malloc(sizeof(float) * n_sums);
    if (!sums) return -1;
    float stack32[need_sums && min_block == 16 && (size_t)m * nb16 / 2 <= MAX_BLOCKS_STACK ? (size_t)m * nb16 / 2 : 1];
    float *sums32 = NULL;
    if (need_sums) {
        for (int i = 0; i < m; i++)
            for (int b = 0; b < nbs; b++) {
                float t = 0.0f;
                for (int k = 0; k < min_block; k++) t += x[(size_t)i * n_in + (size_t)b * min_block + k];
                sums[(size_t)i * nbs + b] = t;
            }
        if (min_block == 16) {
            const size_t n32 = (size_t)m * (n_in / 32);
            sums32 = n32 <= MAX_BLOCKS_STACK ? stack32 : malloc(sizeof(float) * (n32 ? n32 : 1));
            if (!sums32) {
                if (sums != stack) free(sums);
                return -1;
            }
            for (int i = 0; i < m; i++)
                for (int b = 0; b < n_in / 32; b++)
                    sums32[(size_t)i * (n_in / 32) + b] = sums[(size_t)i * nbs + 2 * b] + sums[(size_t)i * nbs + 2 * b + 1];
        } else {
            sums32 = sums;
        }
    }
    const int per4 = (ld + 3) / 4;
    int nt = n_threads < per4 ? n_threads : per4;
    if (nt < 1) nt = 1;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const int tid = omp_get_thread_num(), n = omp_get_num_threads();
        const int u0 = (int)((long)per4 * tid / n) * 4;
        int u1 = (int)((long)per4 * (tid + 1) / n) * 4;
        if (u1 > ld) u1 = ld;
        int off = 0;
        for (int s = 0; s < p->n_seg; s++) {
            const int a = u0 > off ? u0 : off, b = u1 < off + p->n_out[s] ? u1 : off + p->n_out[s];
            if (a < b) segment(p, s, a - off, b - off, off, x, m, p->block[s] == 16 ? sums : sums32, ld, y);
            off += p->n_out[s];
        }
    }
    if (sums32 && sums32 != sums && sums32 != stack32) free(sums32);
    if (sums != stack) free(sums);
    return 0;
}

int kv_blocks_struct_size(void) { return (int)sizeof(kv_blocks); }
int kv_blocks_max_seg(void) { return MAX_BSEG; }
