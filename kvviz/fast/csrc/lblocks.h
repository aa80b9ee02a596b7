/* Input rows rounded to int16 per block of 32, and a row of a legacy block type (Q4_0, Q4_1, Q5_0,
 * Q5_1 packed nibbles; Q8_0 int8 in blocks of 32, or int8 in blocks of 16) times one such row:
 * lblocks.c, called by blockdot.c (kblocks.c does the K types on the same rounded rows). */
#ifndef KVVIZ_LBLOCKS_H
#define KVVIZ_LBLOCKS_H

#include <stddef.h>
#include <stdint.h>

#define KV_QB 32        /* inputs sharing one step dx */
#define KV_QMAX 32767   /* the largest |q|: int16 without -32768, so madd's pairs never overflow */

/* x (n,) -> q (n,) and dx (ceil(n / 32),): for each block b of 32 (the last may be 16),
 * dx[b] = max|x_b| / 32767 in fp32 (0 for an all-zero block, NaN when the block holds a NaN or an
 * infinity, so the outputs it feeds are NaN as an fp32 product would make them) and
 * q[i] = round-to-nearest-even(x[i] / dx[b]), the quotient taken in double. */
void kv_quantize_row(const float *x, int n, int16_t *q, float *dx);

/* sum_b s[b] * dx[b'] * sum_{i in b} (code_i - zero) q_i over nb blocks, b' the block of 32 holding
 * block b. One function a layout: int8 blocks of 32 or 16; 4-bit packed (zero 0, or zero subtracted);
 * 5-bit packed (the same). */
typedef float (*kv_lrow)(const uint8_t *c, const float *s, const int16_t *q, const float *dx, int nb, int zero);
float kv_row_i8_32(const uint8_t *c, const float *s, const int16_t *q, const float *dx, int nb, int zero);
float kv_row_i8_16(const uint8_t *c, const float *s, const int16_t *q, const float *dx, int nb, int zero);
float kv_row_p4(const uint8_t *c, const float *s, const int16_t *q, const float *dx, int nb, int zero);
float kv_row_p4z(const uint8_t *c, const float *s, const int16_t *q, const float *dx, int nb, int zero);
float kv_row_p5(const uint8_t *c, const float *s, const int16_t *q, const float *dx, int nb, int zero);
float kv_row_p5z(const uint8_t *c, const float *s, const int16_t *q, const float *dx, int nb, int zero);

/* The same for r (1..4) input rows at once, q + i * qs and dx + i * dxs for row i: each block is unpacked
 * once for the r rows; out[i] equals, bit for bit, the one-row function's value for row i. */
typedef void (*kv_lrows)(const uint8_t *c, const float *s, const int16_t *q, size_t qs, const float *dx, size_t dxs,
                         int nb, int zero, int r, float *out);
void kv_rows_i8_32(const uint8_t *c, const float *s, const int16_t *q, size_t qs, const float *dx, size_t dxs, int nb, int zero, int r, float *out);
void kv_rows_i8_16(const uint8_t *c, const float *s, const int16_t *q, size_t qs, const float *dx, size_t dxs, int nb, int zero, int r, float *out);
void kv_rows_p4(const uint8_t *c, const float *s, const int16_t *q, size_t qs, const float *dx, size_t dxs, int nb, int zero, int r, float *out);
void kv_rows_p4z(const uint8_t *c, const float *s, const int16_t *q, size_t qs, const float *dx, size_t dxs, int nb, int zero, int r, float *out);
void kv_rows_p5(const uint8_t *c, const float *s, const int16_t *q, size_t qs, const float *dx, size_t dxs, int nb, int zero, int r, float *out);
void kv_rows_p5z(const uint8_t *c, const float *s, const int16_t *q, size_t qs, const float *dx, size_t dxs, int nb, int zero, int r, float *out);

#endif
