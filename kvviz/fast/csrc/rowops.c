/* One row through one linear layer, fp32, on the CPU threads: y = act(LN(x) @ W + b) + res.
 *
 * Why this exists: a decode step multiplies ONE row by every weight matrix, so it is bound by
 * streaming the weights, and MKL's kernels stream a single row's weights well below what the
 * caches deliver (docs/performance.md has the measurements). Each call also fuses what would be
 * separate PyTorch ops around the matmul (LayerNorm before; bias, GELU and the residual add
 * after), since every op saved is a dispatch saved. kvviz/fast/rowops.py builds and loads this file; the
 * flat decode step (kvviz/fast/gpt2.py) calls it; tests hold it to PyTorch's ops.
 *
 * W is GPT-2's Conv1D layout, (n_in, n_out) row-major, read in place (no packed copy). The
 * output columns are cut into tiles of TILE; a tile's accumulators stay in registers while the
 * loop walks the rows of W, reading TILE contiguous floats per row. Threads share out tiles.
 */
#include <math.h>
#include <omp.h>
#include <stddef.h>

#include "rowcommon.h"

#define TILE 128
#define MAX_LN 16384 /* widest LayerNorm input, checked on the Python side too */
#define WIDE_ROW 1024 /* wider outputs take the row-blocked order (a row of W spans pages) */
#define ROW_BLOCK 8

typedef struct {
    const float *w;    /* (n_in, n_out), row-major */
    const float *bias; /* (n_out,) or NULL */
    const float *ln_w; /* (n_in,) or NULL: LayerNorm the input first */
    const float *ln_b; /* (n_in,) or NULL */
    float eps;
    int n_in;
    int n_out;
    int gelu; /* 1: GPT-2's tanh-approximated GELU on the output (gelu_new) */
} kv_linear;

static void layer_norm(const float *x, const kv_linear *p, float *out) {
    /* Two passes in double: the mean and biased variance PyTorch's layer_norm uses. */
    double sum = 0.0, var = 0.0;
    for (int i = 0; i < p->n_in; i++) sum += x[i];
    double mean = sum / p->n_in;
    for (int i = 0; i < p->n_in; i++) var += (x[i] - mean) * (x[i] - mean);
    float m = (float)mean, rstd = (float)(1.0 / sqrt(var / p->n_in + p->eps));
    for (int i = 0; i < p->n_in; i++) {
        float v = (x[i] - m) * rstd * p->ln_w[i];
        out[i] = p->ln_b ? v + p->ln_b[i] : v;
    }
}

/* GPT-2's gelu_new: 0.5 v (1 + tanh(sqrt(2/pi) (v + 0.044715 v^3))), tanh(u) = 1 - 2 / (e^2u + 1). */
static inline float gelu_tanh(float v) {
    const float u = 0.7978845608028654f * (v + 0.044715f * v * v * v);
    return 0.5f * v * (2.0f - 2.0f / (exp_poly(2.0f * u) + 1.0f));
}

/* The epilogue of output column c: bias, GELU, residual. */
static inline float finish(const kv_linear *p, float v, const float *res, int c) {
    if (p->bias) v += p->bias[c];
    if (p->gelu) v = gelu_tanh(v);
    return res ? res[c] + v : v;
}

/* Columns c0 .. c0+width of the output over all rows; width == TILE lets the compiler keep the
 * accumulators in registers. Best while a row of W spans at most a page (n_out <= 1024): the
 * tile's reads then step through a few pages at a time, which the prefetchers follow. */
static inline void tile(const kv_linear *p, const float *x, const float *res, float *y, int c0,
                        int width) {
    float acc[TILE];
    for (int j = 0; j < width; j++) acc[j] = 0.0f;
    const float *w = p->w + c0;
    for (int i = 0; i < p->n_in; i++) {
        const float xi = x[i];
        const float *wr = w + (size_t)i * p->n_out;
        for (int j = 0; j < width; j++) acc[j] += xi * wr[j];
    }
    for (int j = 0; j < width; j++) y[c0 + j] = finish(p, acc[j], res, c0 + j);
}

static void full_tile(const kv_linear *p, const float *x, const float *res, float *y, int c0) {
    tile(p, x, res, y, c0, TILE);
}

/* Rows i0 .. i1 of columns c .. c+width, added into y. */
static inline void block(const kv_linear *p, const float *x, float *y, int c, int i0, int i1,
                         int width) {
    float acc[TILE];
    for (int j = 0; j < width; j++) acc[j] = y[c + j];
    for (int i = i0; i < i1; i++) {
        const float xi = x[i];
        const float *wr = p->w + (size_t)i * p->n_out + c;
        for (int j = 0; j < width; j++) acc[j] += xi * wr[j];
    }
    for (int j = 0; j < width; j++) y[c + j] = acc[j];
}

/* Wide rows (n_out > 1024: a row of W spans pages): each thread owns a contiguous range of
 * tiles and sweeps ROW_BLOCK rows at a time across all of it, so it reads its share of each row
 * front to back, and the partial sums wait in y (a few KB, in L1/L2). On gpt2-small's shapes
 * this streams as fast as MKL (19.5 vs 19.0 ms for a step's 49 matmuls, best of 9), where the
 * tile order took 26 ms; on tiny's narrow rows the tile order is faster (134 vs 158 us). */
static void row_blocked(const kv_linear *p, const float *x, const float *res, float *y, int nt) {
    const int n_tiles = (p->n_out + TILE - 1) / TILE;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const int tid = omp_get_thread_num(), n = omp_get_num_threads();
        const int c0 = (int)((long)n_tiles * tid / n) * TILE;
        int c1 = (int)((long)n_tiles * (tid + 1) / n) * TILE;
        if (c1 > p->n_out) c1 = p->n_out;
        for (int c = c0; c < c1; c++) y[c] = 0.0f;
        for (int i0 = 0; i0 < p->n_in; i0 += ROW_BLOCK) {
            const int i1 = i0 + ROW_BLOCK < p->n_in ? i0 + ROW_BLOCK : p->n_in;
            for (int c = c0; c < c1; c += TILE) {
                if (c1 - c >= TILE)
                    block(p, x, y, c, i0, i1, TILE);
                else
                    block(p, x, y, c, i0, i1, c1 - c);
            }
        }
        for (int c = c0; c < c1; c++) y[c] = finish(p, y[c], res, c);
    }
}

/* y (n_out,) = act(LN(x) @ W + bias) (+ res), on up to n_threads OpenMP threads.
 * x (n_in,), res (n_out,) or NULL, y (n_out,): contiguous fp32, y distinct from x and res. */
void kv_linear_row(const kv_linear *p, const float *x, const float *res, float *y, int n_threads) {
    float xn[p->ln_w ? p->n_in : 1];
    if (p->ln_w) {
        layer_norm(x, p, xn); /* once, on the calling thread: n_in floats, well under a microsecond */
        x = xn;
    }
    const int n_tiles = (p->n_out + TILE - 1) / TILE;
    const int last = n_tiles - 1, tail = p->n_out - last * TILE;
    int nt = n_threads < n_tiles ? n_threads : n_tiles;
    if (nt < 1) nt = 1;
    if (p->n_out > WIDE_ROW) {
        row_blocked(p, x, res, y, nt);
        return;
    }
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int t = 0; t < n_tiles; t++) {
        if (t == last && tail != TILE)
            tile(p, x, res, y, t * TILE, tail);
        else
            full_tile(p, x, res, y, t * TILE);
    }
}

/* The constants the Python side checks before it trusts this build. */
int kv_max_ln(void) { return MAX_LN; }
int kv_struct_size(void) { return (int)sizeof(kv_linear); }
