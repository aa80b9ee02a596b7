/* A few rows through one linear layer in nn.Linear's (out, in) layout, on the CPU threads:
 *   y = epilogue(RMSNorm(x) @ W^T + b) (+ res),  then RoPE on the first outputs
 * with W in fp32 or bf16 (widened to fp32 as it is read) and fp32 activations.
 *
 * Why this exists: a decode step of a Llama (SmolLM2: 30 layers of 7 matrices, then the tied
 * 49,152 x 576 LM head) multiplies one row by every weight, so it is bound by streaming the
 * weights. Each output is one dot product of a weight row with x: the rows are read front to
 * back, in place (nn.Linear's and the embedding's own layout, no transposed copy), a thread
 * owning one contiguous stretch of them. bf16 weights halve the bytes streamed. Each call
 * also fuses the ops around the matmul (docs/performance.md has the measurements):
 *   - RMSNorm of the input rows first (input_layernorm, post_attention_layernorm, model.norm);
 *   - up to three weight "segments" whose outputs sit side by side: q, k and v in one call;
 *   - SwiGLU: segments 0 and 1 are gate and up, read in one pass, y = silu(gate) * up;
 *   - the residual add after (o_proj, down_proj);
 *   - RoPE on the first rope_dims outputs (q's and k's heads), at each row's position.
 * kvviz/fast/rowops.py builds and loads this file with rowops.c; kvviz/fast/llama.py calls it.
 */
#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "rowcommon.h"
#include "rowdot.h"

#define STACK_FLOATS 16384 /* normalized input rows up to this size stay on the stack */

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = {.u = (uint32_t)h << 16};
    return v.f;
}

static inline float w_at(const void *w, size_t i, const int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* Eight weights from w + i as fp32: bf16 widens by moving its 16 bits to the top of a float. */
static inline __attribute__((always_inline)) __m256 ld8(const void *w, size_t i, const int bf16) {
    if (bf16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)w + i);
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* out[k] = dot(row k, x) for four weight rows: x is loaded once for the four, and two
 * accumulators per row keep eight FMAs in flight (several input rows: compute counts). */
static inline __attribute__((always_inline)) void dot4(const void *const r[4], const float *x, int n,
                                                       const int bf16, float out[4]) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
        a0 = _mm256_fmadd_ps(ld8(r[0], i, bf16), x0, a0);
        b0 = _mm256_fmadd_ps(ld8(r[0], i + 8, bf16), x1, b0);
        a1 = _mm256_fmadd_ps(ld8(r[1], i, bf16), x0, a1);
        b1 = _mm256_fmadd_ps(ld8(r[1], i + 8, bf16), x1, b1);
        a2 = _mm256_fmadd_ps(ld8(r[2], i, bf16), x0, a2);
        b2 = _mm256_fmadd_ps(ld8(r[2], i + 8, bf16), x1, b2);
        a3 = _mm256_fmadd_ps(ld8(r[3], i, bf16), x0, a3);
        b3 = _mm256_fmadd_ps(ld8(r[3], i + 8, bf16), x1, b3);
    }
    for (; i + 8 <= n; i += 8) {
        const __m256 x0 = _mm256_loadu_ps(x + i);
        a0 = _mm256_fmadd_ps(ld8(r[0], i, bf16), x0, a0);
        a1 = _mm256_fmadd_ps(ld8(r[1], i, bf16), x0, a1);
        a2 = _mm256_fmadd_ps(ld8(r[2], i, bf16), x0, a2);
        a3 = _mm256_fmadd_ps(ld8(r[3], i, bf16), x0, a3);
    }
    out[0] = hsum8(_mm256_add_ps(a0, b0));
    out[1] = hsum8(_mm256_add_ps(a1, b1));
    out[2] = hsum8(_mm256_add_ps(a2, b2));
    out[3] = hsum8(_mm256_add_ps(a3, b3));
    for (; i < n; i++)
        for (int k = 0; k < 4; k++) out[k] += w_at(r[k], i, bf16) * x[i];
}

/* dot(row, x) with four accumulators: one weight row streamed front to back. */
static inline __attribute__((always_inline)) float dot1(const void *r, const float *x, int n, const int bf16) {
    __m256 a = _mm256_setzero_ps(), b = a, c = a, d = a;
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        a = _mm256_fmadd_ps(ld8(r, i, bf16), _mm256_loadu_ps(x + i), a);
        b = _mm256_fmadd_ps(ld8(r, i + 8, bf16), _mm256_loadu_ps(x + i + 8), b);
        c = _mm256_fmadd_ps(ld8(r, i + 16, bf16), _mm256_loadu_ps(x + i + 16), c);
        d = _mm256_fmadd_ps(ld8(r, i + 24, bf16), _mm256_loadu_ps(x + i + 24), d);
    }
    for (; i + 8 <= n; i += 8) a = _mm256_fmadd_ps(ld8(r, i, bf16), _mm256_loadu_ps(x + i), a);
    float s = hsum8(_mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(c, d)));
    for (; i < n; i++) s += w_at(r, i, bf16) * x[i];
    return s;
}

/* silu(g) * u, (+ res), for n values, eight lanes at a time with exp8 (rowcommon.h). */
static inline float silu(float g);

static void silu_mul(float *g, const float *u, const float *res, int n) {
    int k = 0;
    for (; k + 8 <= n; k += 8) {
        const __m256 gv = _mm256_loadu_ps(g + k);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        __m256 v = _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), _mm256_loadu_ps(u + k));
        if (res) v = _mm256_add_ps(_mm256_loadu_ps(res + k), v);
        _mm256_storeu_ps(g + k, v);
    }
    for (; k < n; k++) g[k] = res ? res[k] + silu(g[k]) * u[k] : silu(g[k]) * u[k];
}

#else /* portable C: OpenMP's simd reductions let the compiler vectorize what it can */

static inline void dot4(const void *const r[4], const float *x, int n, const int bf16, float out[4]) {
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int i = 0; i < n; i++) {
        s0 += w_at(r[0], i, bf16) * x[i];
        s1 += w_at(r[1], i, bf16) * x[i];
        s2 += w_at(r[2], i, bf16) * x[i];
        s3 += w_at(r[3], i, bf16) * x[i];
    }
    out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

static inline float dot1(const void *r, const float *x, int n, const int bf16) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; i++) s += w_at(r, i, bf16) * x[i];
    return s;
}

static inline float silu(float g);

static void silu_mul(float *g, const float *u, const float *res, int n) {
    for (int k = 0; k < n; k++) g[k] = res ? res[k] + silu(g[k]) * u[k] : silu(g[k]) * u[k];
}
#endif

static inline const void *row_of(const kv_dot *p, int s, int r) {
    const size_t at = (size_t)r * p->n_in;
    return p->bf16 ? (const void *)((const uint16_t *)p->w[s] + at) : (const void *)((const float *)p->w[s] + at);
}

static inline float silu(float g) { return g / (1.0f + exp_poly(-g)); }

static int n_total(const kv_dot *p) {
    if (p->swiglu) return p->n_out[0];
    int n = 0;
    for (int s = 0; s < p->n_seg; s++) n += p->n_out[s];
    return n;
}

/* Rows r0..r1 of segment s, for every input row; outputs at column col + r of each row of y. */
static inline __attribute__((always_inline)) void segment(const kv_dot *p, int s, int r0, int r1, int col,
                                                          const float *x, int m, const float *res, float *y,
                                                          int ld, const int bf16) {
    const float *b = p->bias[s];
    int r = r0;
    /* One input row (a decode step): the weight rows one after another, a single stream the
     * prefetchers follow, which read bf16 rows faster than four interleaved streams. Several
     * input rows: four weight rows at a time, each x loaded once for the four. */
    for (; m > 1 && r + 4 <= r1; r += 4) {
        const void *rows[4] = {row_of(p, s, r), row_of(p, s, r + 1), row_of(p, s, r + 2), row_of(p, s, r + 3)};
        for (int i = 0; i < m; i++) {
            float acc[4];
            dot4(rows, x + (size_t)i * p->n_in, p->n_in, bf16, acc);
            float *yo = y + (size_t)i * ld + col + r;
            const float *ro = res ? res + (size_t)i * ld + col + r : NULL;
            for (int k = 0; k < 4; k++) {
                float v = b ? acc[k] + b[r + k] : acc[k];
                yo[k] = ro ? ro[k] + v : v;
            }
        }
    }
    for (; r < r1; r++) {
        const void *row = row_of(p, s, r);
        for (int i = 0; i < m; i++) {
            float v = dot1(row, x + (size_t)i * p->n_in, p->n_in, bf16);
            if (b) v += b[r];
            const size_t at = (size_t)i * ld + col + r;
            y[at] = res ? res[at] + v : v;
        }
    }
}

/* SwiGLU outputs j0..j1: several input rows take gate rows j, j+1 and up rows j, j+1 through one dot4. */
static inline __attribute__((always_inline)) void swiglu(const kv_dot *p, int j0, int j1, const float *x, int m,
                                                         const float *res, float *y, int ld, const int bf16) {
    const float *bg = p->bias[0], *bu = p->bias[1];
    int j = j0;
    if (m == 1) { /* a decode step: gate row j, then up row j, each streamed whole */
        float up[j1 > j0 ? j1 - j0 : 1];
        for (; j < j1; j++) {
            y[j] = dot1(row_of(p, 0, j), x, p->n_in, bf16);
            up[j - j0] = dot1(row_of(p, 1, j), x, p->n_in, bf16);
        }
        /* then the epilogue over the whole stretch, eight lanes at a time */
        float *g = y + j0, *u = up;
        const int n = j1 - j0;
        if (bg) for (int k = 0; k < n; k++) g[k] += bg[j0 + k];
        if (bu) for (int k = 0; k < n; k++) u[k] += bu[j0 + k];
        silu_mul(g, u, res ? res + j0 : NULL, n);
        return;
    }
    for (; j < j1; j += 2) {
        const int two = j + 1 < j1;
        const void *rows[4] = {row_of(p, 0, j), row_of(p, 0, j + two), row_of(p, 1, j), row_of(p, 1, j + two)};
        for (int i = 0; i < m; i++) {
            float acc[4];
            dot4(rows, x + (size_t)i * p->n_in, p->n_in, bf16, acc);
            for (int k = 0; k <= two; k++) {
                const float g = bg ? acc[k] + bg[j + k] : acc[k];
                const float u = bu ? acc[2 + k] + bu[j + k] : acc[2 + k];
                const size_t at = (size_t)i * ld + j + k;
                const float v = silu(g) * u;
                y[at] = res ? res[at] + v : v;
            }
        }
    }
}

/* Output units u0..u1 (columns of the side-by-side segments, or SwiGLU outputs). */
static inline __attribute__((always_inline)) void units(const kv_dot *p, int u0, int u1, const float *x, int m,
                                                        const float *res, float *y, int ld, const int bf16) {
    if (p->swiglu) {
        swiglu(p, u0, u1, x, m, res, y, ld, bf16);
        return;
    }
    int off = 0;
    for (int s = 0; s < p->n_seg; s++) {
        const int a = u0 > off ? u0 : off, b = u1 < off + p->n_out[s] ? u1 : off + p->n_out[s];
        if (a < b) segment(p, s, a - off, b - off, off, x, m, res, y, ld, bf16);
        off += p->n_out[s];
    }
}

static void units_f32(const kv_dot *p, int u0, int u1, const float *x, int m, const float *res, float *y, int ld) {
    units(p, u0, u1, x, m, res, y, ld, 0);
}

static void units_bf16(const kv_dot *p, int u0, int u1, const float *x, int m, const float *res, float *y, int ld) {
    units(p, u0, u1, x, m, res, y, ld, 1);
}

/* y (m, n_total) = epilogue(RMSNorm(x) @ W^T + b) (+ res), on up to n_threads OpenMP threads.
 * x (m, n_in), res (m, n_total) or NULL, y (m, n_total): contiguous fp32, y distinct from both.
 * pos: each row's position for RoPE (row i at pos[i % period]), or NULL when rope_dims is 0.
 * Returns 0, or -1 when the buffer for the normalized rows cannot be had. */
int kv_dot_rows(const kv_dot *p, const float *x, int m, const float *res, float *y, int n_threads,
                const int64_t *pos, int period) {
    const int n_in = p->n_in, ld = n_total(p);
    float stack[p->norm_w && (size_t)m * n_in <= STACK_FLOATS ? (size_t)m * n_in : 1];
    float *xn = NULL;
    if (p->norm_w) {
        xn = (size_t)m * n_in <= STACK_FLOATS ? stack : malloc(sizeof(float) * (size_t)m * n_in);
        if (!xn) return -1;
    }
    /* Each thread owns a contiguous stretch of output units, cut at multiples of 4 (one dot4). */
    const int n_units = ld, per4 = (n_units + 3) / 4;
    int nt = n_threads < per4 ? n_threads : per4;
    if (nt < 1) nt = 1;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const int tid = omp_get_thread_num(), n = omp_get_num_threads();
        if (xn) {
#pragma omp for schedule(static)
            for (int i = 0; i < m; i++) rms_norm(x + (size_t)i * n_in, n_in, p->norm_w, p->eps, xn + (size_t)i * n_in);
        } /* the implicit barrier: every normalized row is ready */
        const float *xin = xn ? xn : x;
        const int u0 = (int)((long)per4 * tid / n) * 4;
        int u1 = (int)((long)per4 * (tid + 1) / n) * 4;
        if (u1 > n_units) u1 = n_units;
        if (p->bf16)
            units_bf16(p, u0, u1, xin, m, res, y, ld);
        else
            units_f32(p, u0, u1, xin, m, res, y, ld);
        if (p->rope_dims > 0) {
#pragma omp barrier
#pragma omp for schedule(static)
            for (int i = 0; i < m; i++) {
                const size_t at = (size_t)pos[i % period] * p->head_dim;
                for (int h = 0; h < p->rope_dims; h += p->head_dim)
                    rope_head(y + (size_t)i * ld + h, p->cos + at, p->sin + at, p->head_dim);
            }
        }
    }
    if (xn && xn != stack) free(xn);
    return 0;
}

/* The constants the Python side checks before it trusts this build. */
int kv_dot_struct_size(void) { return (int)sizeof(kv_dot); }
int kv_dot_max_seg(void) { return MAX_SEG; }
/* 1 when this build has the AVX2 paths. Every file of the library is compiled in one command with
 * one set of flags, so this answers for all of them (fast/logits.py reads it for logits.c's). */
int kv_dot_simd(void) {
#if defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}
