/* One row of a K type (Q4_K, Q5_K, Q6_K) kept as the GGUF's super-blocks, times one input row rounded to
 * int16 per block of 32 (lblocks.h's kv_quantize_row): kblocks.c, called by blockdot.c (one input row, or up to four at once). */
#ifndef KVVIZ_KBLOCKS_H
#define KVVIZ_KBLOCKS_H

#include <stddef.h>
#include <stdint.h>

#define KV_QK_K 256 /* weights in a K super-block */

/* Bytes of one super-block by bits (ggml's block_q4_K, block_q5_K, block_q6_K), 0 for others. */
static inline size_t kv_k_block_bytes(int bits) { return bits == 4 ? 144 : (bits == 5 ? 176 : (bits == 6 ? 210 : 0)); }

/* sum_i w[i] x[i] over nsb super-blocks of Q4_K (bits 4) or Q5_K (5), x rounded to q (int16) with a
 * step dx a block of 32 (nsb * 8 of them); sx: the unrounded input's sums over each block of 32, for
 * the offsets. */
float kv_row_q45k(const uint8_t *c, const int16_t *q, const float *dx, int nsb, const float *sx, int bits);

/* The same for Q6_K (no offsets). */
float kv_row_q6k(const uint8_t *c, const int16_t *q, const float *dx, int nsb);

/* The same for r (1..4) input rows at once, row i at q + i * qs, dx + i * dxs (and sx + i * sxs): each
 * super-block's scales and codes are unpacked once for the r rows; out[i] equals, bit for bit, the
 * one-row function's value for row i. */
void kv_rows_q45k(const uint8_t *c, const int16_t *q, size_t qs, const float *dx, size_t dxs, int nsb, const float *sx,
                  size_t sxs, int bits, int r, float *out);
void kv_rows_q6k(const uint8_t *c, const int16_t *q, size_t qs, const float *dx, size_t dxs, int nsb, int r, float *out);

#endif
