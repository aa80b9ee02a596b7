/* Integer products for the legacy block types (issue 42), and the int16 rounding of the input rows
 * that every block type multiplies (kblocks.c's K types too).
 *
 * Why: widening every code to fp32 and FMA-ing it with fp32 inputs made a 1-thread decode step
 * compute-bound (SmolLM2 Q4_1: 47.5 tok/s of weight matmuls where llama.cpp decodes the file at 59).
 * llama.cpp rounds its inputs to 8 bits; kvviz rounds them to 16: each block of 32 inputs gets a step
 * dx = max|x| / 32767 and integers q = round(x / dx), so |x - q dx| <= dx / 2, 1/65534 of the block's
 * largest value (8 bits: 1/254). The codes (0..15, 0..31 or int8) are widened to int16 lanes and
 * multiplied by q with madd (pairs of products summed into int32 lanes): a block's sum is exact in
 * integers and is converted to fp32 once, then scaled by the weight's scale times dx. Offsets
 * (Q4_1's and Q5_1's m) keep multiplying the fp32 sums of the unrounded inputs (blockdot.c), exactly.
 * So y = sum_i w_i x_i to within sum_b (dx_b / 2) sum_{i in b} |w_i| plus fp32 accumulation.
 *
 * int32 cannot overflow: |q| <= 32767 and |code - zero| <= 128 (int8 -128), so a block of 32 sums
 * to at most 32 * 128 * 32767 = 134,213,632 < 2^31 - 1, a madd pair to 2 * 128 * 32767.
 * The portable C does the same integer sums (exactly the same values), converted once a block.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "lblocks.h"
#include "rowcommon.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

void kv_quantize_row(const float *x, int n, int16_t *q, float *dx) {
    for (int b = 0; (size_t)b * KV_QB < (size_t)n; b++) {
        const float *xb = x + (size_t)b * KV_QB;
        int16_t *qb = q + (size_t)b * KV_QB;
        const int len = n - b * KV_QB < KV_QB ? n - b * KV_QB : KV_QB;
        float amax = 0.0f;
        int finite = 1;
        for (int k = 0; k < len; k++) {
            const float a = fabsf(xb[k]);
            finite &= a <= 3.4028234663852886e38f; /* false for NaN and infinities */
            amax = a > amax ? a : amax;
        }
        float d = amax / (float)KV_QMAX;
        if (!finite) d = NAN;
        if (!finite || d == 0.0f) { /* all zero (or under 32767 x the least subnormal): q = 0 */
            memset(qb, 0, sizeof(int16_t) * (size_t)len);
        } else {
            /* In double the quotient is exact enough that rounding it is rounding the true x / dx
             * (a tie is a tie): |x - q dx| <= dx / 2. Clamped only for a subnormal dx (max|x| under
             * 3.9e-34), where dx itself is inexact. */
            for (int k = 0; k < len; k++) {
                double t = nearbyint((double)xb[k] / (double)d);
                t = t > KV_QMAX ? KV_QMAX : (t < -KV_QMAX ? -KV_QMAX : t);
                qb[k] = (int16_t)t;
            }
        }
        dx[b] = d;
    }
}

/* How a row's codes are laid out, a constant to each row loop: int8 in blocks of 32 or 16, or packed. */
enum { K8_32, K8_16, K4, K5 };

#if defined(__AVX2__) && defined(__FMA__)

/* Sixteen bits of a 5-bit block's fifth-bit word (the little-endian half at p) as sixteen int16 lanes
 * of 0 or 16. Read from memory here, so the compiler broadcasts it from memory (vpbroadcastw m16),
 * not through a general register. */
static inline __m256i fifth16(const uint8_t *p) {
    uint16_t h16;
    memcpy(&h16, p, 2);
    const __m256i m = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                        (short)0x8000);
    const __m256i v = _mm256_and_si256(_mm256_set1_epi16((short)(uint16_t)h16), m);
    return _mm256_and_si256(_mm256_cmpeq_epi16(v, m), _mm256_set1_epi16(16));
}

static inline __m128i load16(const void *p) { return _mm_loadu_si128((const __m128i *)p); }
static inline __m256i load16x2(const int16_t *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* A block's codes as int16 lanes, unpacked once however many input rows then multiply them: u[0]
 * codes 0-15, u[1] codes 16-31 (blocks of 16: u[0] only). A 4-bit block's 16 bytes (byte k = code k |
 * code k + 16 << 4) are widened to int16 once; an AND gives codes 0-15, a shift 16-31. zf: a zero to
 * subtract (Q4_0, Q5_0), a constant, so the types without one (SmolLM2's Q4_1) pay nothing for it. */
static inline __attribute__((always_inline)) void unpack(const uint8_t *c, const int kind, __m256i zero, const int zf,
                                                         __m256i u[2]) {
    if (kind == K8_16 || kind == K8_32) {
        u[0] = _mm256_cvtepi8_epi16(load16(c));
        if (kind == K8_32) u[1] = _mm256_cvtepi8_epi16(load16(c + 16));
        return;
    }
    const __m256i v = _mm256_cvtepu8_epi16(load16(kind == K5 ? c + 4 : c));
    __m256i lo = _mm256_and_si256(v, _mm256_set1_epi16(0x0F)), hi = _mm256_srli_epi16(v, 4);
    if (kind == K5) {
        lo = _mm256_or_si256(lo, fifth16(c));     /* bits 0-15 of the word: codes 0-15 */
        hi = _mm256_or_si256(hi, fifth16(c + 2)); /* bits 16-31: codes 16-31 */
    }
    if (zf) {
        lo = _mm256_sub_epi16(lo, zero);
        hi = _mm256_sub_epi16(hi, zero);
    }
    u[0] = lo;
    u[1] = hi;
}

/* An unpacked block's integer products with one input row's q, summed into eight int32 lanes (exact:
 * see the top). */
static inline __attribute__((always_inline)) __m256i imul(const __m256i u[2], const int16_t *q, const int kind) {
    const __m256i p0 = _mm256_madd_epi16(u[0], load16x2(q));
    return kind == K8_16 ? p0 : _mm256_add_epi32(p0, _mm256_madd_epi16(u[1], load16x2(q + 16)));
}

/* One block's products with q: unpack, then imul. */
static inline __attribute__((always_inline)) __m256i iblock(const uint8_t *c, const int16_t *q, const int kind,
                                                            __m256i zero, const int zf) {
    __m256i u[2];
    unpack(c, kind, zero, zf, u);
    return imul(u, q, kind);
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Each block's int32 lanes converted once and scaled by s[b] * dx into one of two accumulators (even
 * and odd blocks), so consecutive blocks do not wait on one another. Called with a constant kind. */
static inline __attribute__((always_inline)) float row_blocks(const uint8_t *c, const float *s, const int16_t *q,
                                                              const float *dx, int nb, const int kind, int zero,
                                                              const int zf) {
    const int width = kind == K8_16 ? 16 : 32, stride = kind == K4 ? 16 : (kind == K5 ? 20 : width);
    const int dsh = kind == K8_16; /* blocks of 16: two share a dx */
    const __m256i z = _mm256_set1_epi16((short)zero);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    int b = 0;
    for (; b + 2 <= nb; b += 2) {
        const uint8_t *cb = c + (size_t)b * stride;
        const int16_t *qb = q + (size_t)b * width;
        a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iblock(cb, qb, kind, z, zf)), _mm256_set1_ps(s[b] * dx[b >> dsh]), a0);
        a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iblock(cb + stride, qb + width, kind, z, zf)),
                             _mm256_set1_ps(s[b + 1] * dx[(b + 1) >> dsh]), a1);
    }
    if (b < nb)
        a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iblock(c + (size_t)b * stride, q + (size_t)b * width, kind, z, zf)),
                             _mm256_set1_ps(s[b] * dx[b >> dsh]), a0);
    return hsum8(_mm256_add_ps(a0, a1));
}

/* Each input row's products s[b] * dx[b'] for a weight row (b' the block of 32 holding block b), eight
 * at a time: the same fp32 products row_blocks forms one by one, so the main loop below loads them
 * (a broadcast from memory) instead of spending a multiply and a broadcast a block a row. */
static inline void block_steps(const float *s, const float *dx, int nb, const int dsh, float *sd) {
    int b = 0;
    if (!dsh)
        for (; b + 8 <= nb; b += 8) _mm256_storeu_ps(sd + b, _mm256_mul_ps(_mm256_loadu_ps(s + b), _mm256_loadu_ps(dx + b)));
    for (; b < nb; b++) sd[b] = s[b] * dx[b >> dsh];
}

/* row_blocks for R input rows at once (R a constant, 2..4): each block is unpacked once and multiplied
 * by the R rows (q + i * qs, dx + i * dxs), each row with its own two accumulators taking exactly the
 * operations row_blocks gives it, in the same order, so out[i] is bit for bit row_blocks' value. */
static inline __attribute__((always_inline)) void rows_blocks(const uint8_t *c, const float *s, const int16_t *q,
                                                              size_t qs, const float *dx, size_t dxs, int nb,
                                                              const int kind, int zero, const int zf, const int R,
                                                              float *out) {
    const int width = kind == K8_16 ? 16 : 32, stride = kind == K4 ? 16 : (kind == K5 ? 20 : width);
    const int dsh = kind == K8_16;
    const __m256i z = _mm256_set1_epi16((short)zero);
    float sd[R][nb];
    KV_UNROLL
    for (int i = 0; i < R; i++) block_steps(s, dx + i * dxs, nb, dsh, sd[i]);
    __m256 a0[4], a1[4];
    KV_UNROLL
    for (int i = 0; i < R; i++) a0[i] = a1[i] = _mm256_setzero_ps();
    __m256i u[2], v[2];
    int b = 0;
    for (; b + 2 <= nb; b += 2) {
        const uint8_t *cb = c + (size_t)b * stride;
        unpack(cb, kind, z, zf, u);
        unpack(cb + stride, kind, z, zf, v);
        KV_UNROLL
        for (int i = 0; i < R; i++) {
            const int16_t *qb = q + i * qs + (size_t)b * width;
            a0[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(imul(u, qb, kind)), _mm256_broadcast_ss(&sd[i][b]), a0[i]);
            a1[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(imul(v, qb + width, kind)), _mm256_broadcast_ss(&sd[i][b + 1]), a1[i]);
        }
    }
    if (b < nb) {
        unpack(c + (size_t)b * stride, kind, z, zf, u);
        KV_UNROLL
        for (int i = 0; i < R; i++)
            a0[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(imul(u, q + i * qs + (size_t)b * width, kind)),
                                    _mm256_broadcast_ss(&sd[i][b]), a0[i]);
    }
    KV_UNROLL
    for (int i = 0; i < R; i++) out[i] = hsum8(_mm256_add_ps(a0[i], a1[i]));
}

/* R (1..4) a constant in each branch, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void rows_any(const uint8_t *c, const float *s, const int16_t *q,
                                                           size_t qs, const float *dx, size_t dxs, int nb,
                                                           const int kind, int zero, const int zf, int R, float *out) {
    if (R == 4) rows_blocks(c, s, q, qs, dx, dxs, nb, kind, zero, zf, 4, out);
    else if (R == 3) rows_blocks(c, s, q, qs, dx, dxs, nb, kind, zero, zf, 3, out);
    else if (R == 2) rows_blocks(c, s, q, qs, dx, dxs, nb, kind, zero, zf, 2, out);
    else out[0] = row_blocks(c, s, q, dx, nb, kind, zero, zf);
}

#else /* portable C: every code unpacked one by one, the same integer sums */

/* Code i (0..31) of a block, unpacked and centred. */
static inline int code_at(const uint8_t *c, int i, int kind, int zero) {
    if (kind == K8_32 || kind == K8_16) return ((const int8_t *)c)[i];
    const uint8_t *n = kind == K5 ? c + 4 : c;
    int v = i < 16 ? (n[i] & 0x0F) : (n[i - 16] >> 4);
    if (kind == K5) {
        uint32_t h;
        memcpy(&h, c, 4);
        v |= (int)((h >> i) & 1u) << 4;
    }
    return v - zero;
}

static inline float row_blocks(const uint8_t *c, const float *s, const int16_t *q, const float *dx, int nb, int kind,
                               int zero, int zf) {
    (void)zf; /* the plain loop subtracts zero (0 or not) from every code */
    const int width = kind == K8_16 ? 16 : 32, stride = kind == K4 ? 16 : (kind == K5 ? 20 : width);
    const int dsh = kind == K8_16;
    float acc = 0.0f;
    for (int b = 0; b < nb; b++) {
        const uint8_t *cb = c + (size_t)b * stride;
        const int16_t *qb = q + (size_t)b * width;
        int32_t t = 0;
        for (int i = 0; i < width; i++) t += code_at(cb, i, kind, zero) * qb[i];
        acc += (float)t * (s[b] * dx[b >> dsh]);
    }
    return acc;
}

/* One row at a time: the portable loop has one order, the same for any number of rows. */
static inline void rows_any(const uint8_t *c, const float *s, const int16_t *q, size_t qs, const float *dx, size_t dxs,
                            int nb, int kind, int zero, int zf, int R, float *out) {
    for (int i = 0; i < R; i++) out[i] = row_blocks(c, s, q + i * qs, dx + i * dxs, nb, kind, zero, zf);
}
#endif

float kv_row_i8_32(const uint8_t *c, const float *s, const int16_t *q, const float *dx, int nb, int z) { return row_blocks(c, s, q, dx, nb, K8_32, z, 0); }
float kv_row_i8_16(const uint8_t *c, const float *s, const int16_t *q, const float *dx, int nb, int z) { return row_blocks(c, s, q, dx, nb, K8_16, z, 0); }
float kv_row_p4(const uint8_t *c, const float *s, const int16_t *q, const float *dx, int nb, int z) { return row_blocks(c, s, q, dx, nb, K4, z, 0); }
float kv_row_p4z(const uint8_t *c, const float *s, const int16_t *q, const float *dx, int nb, int z) { return row_blocks(c, s, q, dx, nb, K4, z, 1); }
float kv_row_p5(const uint8_t *c, const float *s, const int16_t *q, const float *dx, int nb, int z) { return row_blocks(c, s, q, dx, nb, K5, z, 0); }
float kv_row_p5z(const uint8_t *c, const float *s, const int16_t *q, const float *dx, int nb, int z) { return row_blocks(c, s, q, dx, nb, K5, z, 1); }

#define KV_ROWS(name, kind, zf)                                                                                          \
    void name(const uint8_t *c, const float *s, const int16_t *q, size_t qs, const float *dx, size_t dxs, int nb,      \
              int z, int r, float *out) {                                                                              \
        rows_any(c, s, q, qs, dx, dxs, nb, kind, z, zf, r, out);                                                       \
    }
KV_ROWS(kv_rows_i8_32, K8_32, 0)
KV_ROWS(kv_rows_i8_16, K8_16, 0)
KV_ROWS(kv_rows_p4, K4, 0)
KV_ROWS(kv_rows_p4z, K4, 1)
KV_ROWS(kv_rows_p5, K5, 0)
KV_ROWS(kv_rows_p5z, K5, 1)
