/* kv_dot, the spec of one fused call into rowdot.c, shared with rowstep.c (which chains a
 * layer's four of them with the cache write and attention in one call). */
#ifndef KVVIZ_ROWDOT_H
#define KVVIZ_ROWDOT_H

#include <stdint.h>

#define MAX_SEG 3

typedef struct {
    const void *w[MAX_SEG];     /* segment s: (n_out[s], n_in) row-major, fp32 or bf16 */
    const float *bias[MAX_SEG]; /* (n_out[s],) or NULL */
    int n_out[MAX_SEG];
    int n_seg;
    int n_in;
    int bf16;            /* 1: the weights are bf16 */
    const float *norm_w; /* (n_in,) or NULL: RMSNorm each input row first */
    float eps;
    int swiglu;    /* 1: two segments, gate and up; y = silu(gate) * up, n_out[0] outputs */
    int rope_dims; /* rotate outputs [0, rope_dims) of each row, head by head; 0: none */
    int head_dim;
    const float *cos; /* (positions, head_dim) fp32 tables, read at each row's position */
    const float *sin;
} kv_dot;

int kv_dot_rows(const kv_dot *p, const float *x, int m, const float *res, float *y, int n_threads,
                const int64_t *pos, int period);

#endif
