/* A few fp32 rows through weights kept as a GGUF file keeps them: integer codes in blocks, each block
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
 * tests check it value for value).
 *
 * The activations are rounded to int16 per block of 32 (issue 42; lblocks.c): dx_b = max|x_b| / 32767,
 * q = round(x / dx_b), so the codes multiply them in integers (madd) and a block's sum is converted to
 * fp32 once. The result is the exact product to within sum_b (dx_b / 2) sum_{i in b} |w_i| (1/65534 of
 * each block's largest input) plus fp32 accumulation; offsets (minv) multiply the unrounded inputs' sums.
 *
 * Packed codes (issue 42): the 4- and 5-bit types stream as the file packs them, two codes a byte
 * (plus a bit plane of fifth bits), unpacked in registers, and the legacy types' fp16 scales stay
 * fp16 (widened a row at a time): SmolLM2's Q4_1 layers read 0.625 bytes a weight, as llama.cpp
 * reads them, where one int8 code a weight and fp32 scale and offset read 1.25.
 *
 * The K types (Q4_K, Q5_K, Q6_K) stream their super-blocks of 256 as the file stores them, fp16 d
 * and dmin and 6-bit sub-block scales unpacked in registers (kblocks.c): 0.5625, 0.6875 and
 * 0.8203125 bytes a weight, as llama.cpp reads them. The legacy types' rows are lblocks.c's.
 *
 * Segments sit side by side in the output (q|k|v; gate|up), each with its own block size (16 or
 * 32), packing and types. A thread owns one contiguous stretch of output rows, read front to back.
 * kvviz/fast/rowops.py builds this file with the others; kvviz/fast/blockdot.py calls it.
 */
#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kblocks.h"
#include "lblocks.h"
#include "rowcommon.h"

#define MAX_BSEG 3
#define MAX_BLOCKS_STACK 4096 /* per-block input sums up to this many stay on the stack */

typedef struct {
    const void *codes[MAX_BSEG];  /* segment s: n_out[s] rows of row_bytes(bits[s], n_in) bytes */
    const void *scale[MAX_BSEG];  /* (n_out[s], n_in / block[s]) fp32, or fp16 when half[s] */
    const void *minv[MAX_BSEG];   /* the same shape and type, or NULL: no offsets */
    const float *bias[MAX_BSEG];  /* (n_out[s],) added to each output, or NULL (Qwen2's q/k/v) */
    int n_out[MAX_BSEG];
    int block[MAX_BSEG]; /* 16 or 32 (packed codes: 32) */
    int bits[MAX_BSEG];  /* 8: one int8 code a weight. 4: 16 bytes a block of 32, byte k holding code k
                          * (low nibble) and code k + 16 (high), as ggml's Q4_0 packs them. 5: 20 bytes a
                          * block, a little-endian uint32 whose bit k is code k's fifth bit, then the
                          * nibbles as for 4 (ggml's Q5_0 without its scale). */
    int zero[MAX_BSEG];  /* subtracted from each unpacked 4/5-bit code: Q4_0's 8, Q5_0's 16, else 0 */
    int half[MAX_BSEG];  /* scale and minv are fp16 (the legacy types' own d and m: exact) */
    int kq[MAX_BSEG];    /* 1: the codes are K super-blocks of 256 as the file stores them (bits 4 Q4_K,
                          * 5 Q5_K, 6 Q6_K; kblocks.c reads them); scale and minv are then NULL */
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

/* Bytes one row of segment s takes. */
static inline size_t row_bytes(int bits, int kq, int n_in) {
    if (kq) return (size_t)(n_in / KV_QK_K) * kv_k_block_bytes(bits);
    return bits == 8 ? (size_t)n_in : (size_t)(n_in / 32) * (bits == 4 ? 16 : 20);
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

/* One row's nb scales (or offsets) as fp32: the row itself, or its fp16 values widened into buf
 * (eight at a time with F16C: once the products are integer, this and the offsets below are a large
 * part of a Q4_1 row's work). */
static inline const float *row_floats(const void *t, int half, int r, int nb, float *buf) {
    if (!half) return (const float *)t + (size_t)r * nb;
    const uint16_t *h = (const uint16_t *)t + (size_t)r * nb;
    int b = 0;
#if defined(__F16C__) && defined(__AVX__)
    for (; b + 8 <= nb; b += 8) _mm256_storeu_ps(buf + b, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + b))));
#endif
    for (; b < nb; b++) buf[b] = half_to_float(h[b]);
    return buf;
}

/* sum_b m[b] * sx[b]: a row's offsets times the input's block sums (eight lanes with AVX2). */
static inline float offsets(const float *m, const float *sx, int nb) {
    float o = 0.0f;
    int b = 0;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    for (; b + 8 <= nb; b += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(m + b), _mm256_loadu_ps(sx + b), acc);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    o = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
#endif
    for (; b < nb; b++) o += m[b] * sx[b];
    return o;
}

/* The input rows as the products read them: x (m, n_in) fp32 for the offsets' sums, and rounded
 * (lblocks.h): q (m, n_in) int16 and dx (m, nq), a step for each block of 32. */
typedef struct {
    const float *x;
    const int16_t *q;
    const float *dx;
    int m, nq;
} rows_in;

#define ROWS_AT_ONCE 4 /* input rows multiplied by a weight row's codes unpacked once (lblocks.h, kblocks.h) */

/* Rows r0..r1 of segment s for every input row; outputs at column col + r of each row of y.
 * sx: each input row's per-block sums of x at this segment's block size (when it has offsets).
 * One input row (a decode step) takes the one-row functions; several go ROWS_AT_ONCE at a time
 * through the many-row ones, which unpack each block (and a K super-block's scales) once for them
 * and give each row, bit for bit, the one-row value (tests/engine/test_block_rows.py). */
static void segment(const kv_blocks *p, int s, int r0, int r1, int col, const rows_in *in, const float *sx, int ld,
                    float *y) {
    const int n_in = p->n_in, block = p->block[s], nb = n_in / block, bits = p->bits[s], half = p->half[s];
    const int zero = p->zero[s], kq = p->kq[s], m = in->m, nsb = n_in / KV_QK_K;
    const size_t rb = row_bytes(bits, kq, n_in), nq = (size_t)in->nq;
    const float *bias = p->bias[s];
    const kv_lrow row = bits == 4 ? (zero ? kv_row_p4z : kv_row_p4)
                                  : (bits == 5 ? (zero ? kv_row_p5z : kv_row_p5) : (block == 32 ? kv_row_i8_32 : kv_row_i8_16));
    const kv_lrows rows = bits == 4 ? (zero ? kv_rows_p4z : kv_rows_p4)
                                    : (bits == 5 ? (zero ? kv_rows_p5z : kv_rows_p5) : (block == 32 ? kv_rows_i8_32 : kv_rows_i8_16));
    float sbuf[half ? nb : 1], mbuf[half && p->minv[s] ? nb : 1], v[ROWS_AT_ONCE];
    for (int r = r0; r < r1; r++) {
        const uint8_t *c = (const uint8_t *)p->codes[s] + (size_t)r * rb;
        /* K super-blocks read their scales and offsets inside them (kblocks.c) */
        const float *sc = kq ? NULL : row_floats(p->scale[s], half, r, nb, sbuf);
        const float *mr = !kq && p->minv[s] ? row_floats(p->minv[s], half, r, nb, mbuf) : NULL;
        if (m == 1) { /* decode: the one-row functions, as they always were */
            float v1 = !kq ? row(c, sc, in->q, in->dx, nb, zero)
                           : (bits == 6 ? kv_row_q6k(c, in->q, in->dx, nsb) : kv_row_q45k(c, in->q, in->dx, nsb, sx, bits));
            if (mr) v1 -= offsets(mr, sx, nb); /* times the unrounded input's block sums */
            if (bias) v1 += bias[r];           /* after the sum, as F.linear adds it */
            y[col + r] = v1;
            continue;
        }
        for (int i0 = 0; i0 < m; i0 += ROWS_AT_ONCE) { /* the row's codes stay in L1 for the next input rows */
            const int n = m - i0 < ROWS_AT_ONCE ? m - i0 : ROWS_AT_ONCE;
            const int16_t *qi = in->q + (size_t)i0 * n_in;
            const float *dxi = in->dx + (size_t)i0 * nq, *sxi = sx ? sx + (size_t)i0 * nb : NULL;
            if (!kq)
                rows(c, sc, qi, (size_t)n_in, dxi, nq, nb, zero, n, v);
            else if (bits == 6)
                kv_rows_q6k(c, qi, (size_t)n_in, dxi, nq, nsb, n, v);
            else
                kv_rows_q45k(c, qi, (size_t)n_in, dxi, nq, nsb, sxi, (size_t)nb, bits, n, v);
            for (int k = 0; k < n; k++) {
                float o = v[k];
                if (mr) o -= offsets(mr, sx + (size_t)(i0 + k) * nb, nb);
                if (bias) o += bias[r];
                y[(size_t)(i0 + k) * ld + col + r] = o;
            }
        }
    }
}

/* GELU, tanh approximation (PyTorch's approximate="tanh"): 0.5 g (1 + tanh(u)), u = sqrt(2 / pi) (g +
 * 0.044715 g^3), taken as g / (1 + exp(-2 u)) (the same function: 0.5 (1 + tanh(u)) = 1 / (1 + e^-2u)),
 * so it runs on exp_poly and eight lanes of exp8, where libm's tanhf kept it scalar: 0.76 ms of a
 * 16-row Gemma 3 gate|up call (32,768 values), 0.03 ms of each decode step's eighteen. The factor
 * 1 / (1 + E) carries E's relative error times E / (1 + E) <= 1, no cancellation, where 1 + tanh(u)
 * cancelled for negative g (tests/fast/test_fast_gemma3.py bounds it). */
static inline float gelu_tanh(float g) {
    const float u = 0.7978845608028654f * (g + 0.044715f * g * g * g);
    return g / (1.0f + exp_poly(-2.0f * u));
}

/* SiLU as rowdot.c computes it (exp_poly: no libm call). */
static inline float silu(float g) { return g / (1.0f + exp_poly(-g)); }

/* r[j] = act(r[j]) * r[n + j] for j < n (gate, then up, in one row): GeGLU (glu 1) or SwiGLU (2), eight
 * lanes at a time with exp8 (rowcommon.h: exp_poly's operations lane by lane, so a lane gives what the
 * scalar tail gives; the build does not contract to FMA). */
static void glu_row(float *r, int n, int glu) {
    int j = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; j + 8 <= n; j += 8) {
        const __m256 g = _mm256_loadu_ps(r + j);
        __m256 t; /* the exponent: -2 u (GeGLU) or -g (SwiGLU) */
        if (glu == 1) {
            const __m256 c = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), g), g), g);
            const __m256 u = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f), _mm256_add_ps(g, c));
            t = _mm256_mul_ps(_mm256_set1_ps(-2.0f), u);
        } else {
            t = _mm256_sub_ps(_mm256_setzero_ps(), g);
        }
        const __m256 a = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(t)));
        _mm256_storeu_ps(r + j, _mm256_mul_ps(a, _mm256_loadu_ps(r + n + j)));
    }
#endif
    for (; j < n; j++) r[j] = (glu == 1 ? gelu_tanh(r[j]) : silu(r[j])) * r[n + j];
}

static int matmul(const kv_blocks *p, const float *x, int m, float *y, int n_threads);

/* y (m, outputs) = epilogue(RMSNorm(x) @ W^T + b) (+ res): the optional input norm, the segments side
 * by side (each with its bias), then GeGLU or SwiGLU or the output norm plus the residual, or the
 * q/k heads' norms and RoPE.
 * x (m, n_in), res (m, outputs) or NULL; cos and sin (period, head_dim): row i at row i % period,
 * or NULL for no RoPE. Returns 0, or -1 when a block size is not 16 or 32 (or packed codes not in
 * blocks of 32), or a buffer cannot be had. */
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
            if (p->glu) glu_row(r, outs, p->glu);
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
        if (p->kq[s] ? (n_in % KV_QK_K || p->block[s] != (p->bits[s] == 6 ? 16 : 32) || !kv_k_block_bytes(p->bits[s]))
                     : (p->bits[s] != 8 && (p->block[s] != 32 || (p->bits[s] != 4 && p->bits[s] != 5))))
            return -1;
        ld += p->n_out[s];
        if (p->minv[s] || (p->kq[s] && p->bits[s] != 6)) need_sums = 1; /* Q4_K and Q5_K have offsets */
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
    /* The rounded rows: per-call scratch (the app runs several decodes at once), filled before the
     * threads start, which then only read them. */
    const int nq = (n_in + KV_QB - 1) / KV_QB;
    int16_t *q = malloc(sizeof(int16_t) * (size_t)m * n_in + 1);
    float *dx = malloc(sizeof(float) * (size_t)m * nq + 1);
    if (!q || !dx) {
        free(q);
        free(dx);
        if (sums32 && sums32 != sums && sums32 != stack32) free(sums32);
        if (sums != stack) free(sums);
        return -1;
    }
    for (int i = 0; i < m; i++) kv_quantize_row(x + (size_t)i * n_in, n_in, q + (size_t)i * n_in, dx + (size_t)i * nq);
    const rows_in in = {x, q, dx, m, nq};
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
            if (a < b) segment(p, s, a - off, b - off, off, &in, p->block[s] == 16 ? sums : sums32, ld, y);
            off += p->n_out[s];
        }
    }
    free(q);
    free(dx);
    if (sums32 && sums32 != sums && sums32 != stack32) free(sums32);
    if (sums != stack) free(sums);
    return 0;
}

int kv_blocks_struct_size(void) { return (int)sizeof(kv_blocks); }
int kv_blocks_max_seg(void) { return MAX_BSEG; }
