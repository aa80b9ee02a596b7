/* A row of a K-type weight (Q4_K, Q5_K, Q6_K) kept as the GGUF's super-blocks of 256, times one fp32
 * input row rounded to int16 per block of 32 (lblocks.c says how and why; issue 42), or times up to
 * four such rows at once, each super-block's scales and codes unpacked once for them (a prefill's
 * rows; each row's result bit for bit the one-row value). blockdot.c calls them.
 *
 * Why: a step streams every weight once, so the bytes a weight takes bound the speed. ggml stores a
 * Q4_K super-block in 144 bytes (0.5625 a weight): fp16 d and dmin, twelve bytes holding eight 6-bit
 * scales and eight 6-bit mins, 128 bytes of nibbles. Read as blocks of 32 with fp32 scales and
 * offsets it took 0.75. Here the super-block is read as stored, as llama.cpp's ggml-cpu reads it:
 * the scales are unpacked and multiplied by d (dmin) in registers, once per 256 weights. Q5_K adds
 * 32 bytes of fifth bits (176: 0.6875 a weight), Q6_K is 210 bytes (0.8203125; it was 1.25).
 *
 * The weights are exactly gguf's: d * sc (an fp16 times a 6-bit, or Q6_K's int8, integer) has at
 * most 18 significant bits, so fp32 holds it exactly, the same number gguf's dequantizer forms;
 * a sub-block's sum is scale * dx * sum(code q) - offset * sum(x): the codes times the rounded input in
 * int32, exactly, and the offsets times the sums of the unrounded input (fp32), as for every type.
 * Layouts (ggml-common.h's block_q4_K, block_q5_K, block_q6_K; dequantize_row_q*_K in ggml-quants.c):
 *   Q4_K: d, dmin, scales[12], qs[128]: weights 64 j + l (l < 32) are qs[32 j + l]'s low nibble
 *         (sub-block 2 j), 64 j + 32 + l its high nibble (2 j + 1).
 *   Q5_K: d, dmin, scales[12], qh[32], qs[128]: as Q4_K, plus bit s of qh[l] as sub-block s's fifth bit.
 *   Q6_K: ql[128], qh[64], scales[16] (int8), d; each half n of 128: weights 32 k + l (k < 4, l < 32)
 *         are ql[64 n + l] (k even) or ql[64 n + 32 + l] (k odd), low nibble for k < 2, high for
 *         k >= 2, with bits 2 k, 2 k + 1 of qh[32 n + l] on top, less 32; a scale per 16.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kblocks.h"
#include "rowcommon.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

static inline float f16_at(const uint8_t *b) {
    uint16_t h;
    memcpy(&h, b, 2);
    return half_to_float(h);
}

/* ggml's get_scale_min_k4 for the eight sub-blocks, times d and dmin (exact products, as above). */
static inline void k4_scales(const uint8_t *b, float sc[8], float mn[8]) {
    const float d = f16_at(b), dmin = f16_at(b + 2);
    const uint8_t *q = b + 4;
    for (int j = 0; j < 4; j++) {
        sc[j] = d * (float)(q[j] & 63);
        mn[j] = dmin * (float)(q[j + 4] & 63);
        sc[j + 4] = d * (float)((q[j + 8] & 0x0F) | ((q[j] >> 6) << 4));
        mn[j + 4] = dmin * (float)((q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4));
    }
}

#if defined(__AVX2__) && defined(__FMA__)

/* k4_scales in lanes: the twelve bytes' 6-bit scales and mins regrouped with 32-bit masks and
 * shifts (as ggml's AVX2 Q4_K code does: four scale bytes a word), widened to fp32 and times d and
 * dmin: lane j holds sc[j] (mn[j]), the same products k4_scales forms, without its 16 scalar
 * conversions a super-block. */
static inline void k4_scales8(const uint8_t *b, __m256 *sc, __m256 *mn) {
    uint32_t u[3], w[4];
    memcpy(u, b + 4, 12);
    w[0] = u[0] & 0x3f3f3f3fu;                                              /* sc 0..3 */
    w[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);      /* sc 4..7 */
    w[2] = u[1] & 0x3f3f3f3fu;                                              /* mn 0..3 */
    w[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4); /* mn 4..7 */
    const __m128i v = _mm_loadu_si128((const __m128i *)w);
    *sc = _mm256_mul_ps(_mm256_set1_ps(f16_at(b)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)));
    *mn = _mm256_mul_ps(_mm256_set1_ps(f16_at(b + 2)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))));
}

static inline __m256i wide16(const uint8_t *c) { return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)c)); }
static inline __m256i q16(const int16_t *q) { return _mm256_loadu_si256((const __m256i *)q); }

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Sub-blocks 2 j and 2 j + 1 of a Q4_K (five = 0) or Q5_K (1) super-block as int16 lanes, from the 32
 * bytes of nibbles at qs (qs[32 j ..]): lo0|lo1 sub-block 2 j's 32 codes (low nibbles), hi0|hi1 sub-block
 * 2 j + 1's (high). Q5_K's fifth bits come from h0, h1 (qh widened; bit 2 j now bit 0, 2 j + 1 bit 1),
 * moved to bit 4; h0 and h1 are then shifted down 2 for the next pair. */
static inline __attribute__((always_inline)) void k45_codes(const uint8_t *qs, const int five, __m256i *h0,
                                                            __m256i *h1, __m256i *lo0, __m256i *lo1, __m256i *hi0,
                                                            __m256i *hi1) {
    const __m256i m4 = _mm256_set1_epi16(0x0F), b4 = _mm256_set1_epi16(0x10);
    const __m256i v0 = wide16(qs), v1 = wide16(qs + 16);
    *lo0 = _mm256_and_si256(v0, m4), *lo1 = _mm256_and_si256(v1, m4);
    *hi0 = _mm256_srli_epi16(v0, 4), *hi1 = _mm256_srli_epi16(v1, 4);
    if (five) {
        *lo0 = _mm256_or_si256(*lo0, _mm256_and_si256(_mm256_slli_epi16(*h0, 4), b4));
        *lo1 = _mm256_or_si256(*lo1, _mm256_and_si256(_mm256_slli_epi16(*h1, 4), b4));
        *hi0 = _mm256_or_si256(*hi0, _mm256_and_si256(_mm256_slli_epi16(*h0, 3), b4));
        *hi1 = _mm256_or_si256(*hi1, _mm256_and_si256(_mm256_slli_epi16(*h1, 3), b4));
        *h0 = _mm256_srli_epi16(*h0, 2);
        *h1 = _mm256_srli_epi16(*h1, 2);
    }
}

/* One Q4_K (five = 0) or Q5_K (1) super-block on the rounded input q (dx: its eight steps): each
 * sub-block's integer products summed in int32 lanes (codes <= 31, so 32 * 31 * 32767 fits), converted
 * once and scaled by sc * dx into acc0 (even sub-blocks) or acc1 (odd); the eight offsets times sx's
 * eight sums of the unrounded input, lane by lane, into off. 16 bytes of nibbles are widened to int16
 * once and give 16 codes of two sub-blocks (an AND, a shift). */
static inline __attribute__((always_inline)) void q45k_block(const uint8_t *b, const int16_t *q, const float *dx,
                                                             const float *sx, const int five, __m256 *acc0,
                                                             __m256 *acc1, __m256 *off) {
    __m256 scv, mnv;
    k4_scales8(b, &scv, &mnv);
    *off = _mm256_fmadd_ps(mnv, _mm256_loadu_ps(sx), *off);
    const __m256 sdv = _mm256_mul_ps(scv, _mm256_loadu_ps(dx)); /* sc * dx, lane j: sub-block j */
    const uint8_t *qs = b + (five ? 48 : 16);
    __m256i h0 = _mm256_setzero_si256(), h1 = h0;
    if (five) { /* qh[0..15] and qh[16..31]; shifted down 2 a pair of sub-blocks */
        h0 = wide16(b + 16);
        h1 = wide16(b + 32);
    }
    for (int j = 0; j < 4; j++) { /* sub-blocks 2 j (low nibbles of qs[32 j ..]) and 2 j + 1 (high) */
        __m256i lo0, lo1, hi0, hi1;
        k45_codes(qs + 32 * j, five, &h0, &h1, &lo0, &lo1, &hi0, &hi1);
        const int16_t *qa = q + 64 * j;
        const __m256i ia = _mm256_add_epi32(_mm256_madd_epi16(lo0, q16(qa)), _mm256_madd_epi16(lo1, q16(qa + 16)));
        const __m256i ib = _mm256_add_epi32(_mm256_madd_epi16(hi0, q16(qa + 32)), _mm256_madd_epi16(hi1, q16(qa + 48)));
        *acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia), _mm256_permutevar8x32_ps(sdv, _mm256_set1_epi32(2 * j)), *acc0);
        *acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ib), _mm256_permutevar8x32_ps(sdv, _mm256_set1_epi32(2 * j + 1)), *acc1);
    }
}

float kv_row_q45k(const uint8_t *c, const int16_t *q, const float *dx, int nsb, const float *sx, int bits) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, off = a0;
    const size_t size = kv_k_block_bytes(bits);
    if (bits == 5) /* two loops, each with its constant: the Q4_K loop has no fifth-bit work */
        for (int k = 0; k < nsb; k++)
            q45k_block(c + k * size, q + (size_t)k * KV_QK_K, dx + 8 * (size_t)k, sx + 8 * (size_t)k, 1, &a0, &a1, &off);
    else
        for (int k = 0; k < nsb; k++)
            q45k_block(c + k * size, q + (size_t)k * KV_QK_K, dx + 8 * (size_t)k, sx + 8 * (size_t)k, 0, &a0, &a1, &off);
    return hsum8(_mm256_add_ps(a0, a1)) - hsum8(off);
}

/* Half a Q6_K super-block (128 weights; the layout above) on the rounded input: for each l-range of
 * 16, the four sub-blocks' codes (k = 0..3, each -32..31) times q, madd into int32 lanes, converted
 * once and scaled by d * sc * dx (dx[k]: the block of 32 holding sub-block k's 16) into acc. */
static inline void q6k_half(const uint8_t *ql, const uint8_t *qh, const int8_t *sc, float d, const int16_t *q,
                            const float *dx, __m256 *acc0, __m256 *acc1) {
    const __m256i m4 = _mm256_set1_epi16(0x0F), m30 = _mm256_set1_epi16(0x30), c32 = _mm256_set1_epi16(32);
    for (int s = 0; s < 2; s++) { /* l in [16 s, 16 s + 16): sub-blocks s, 2 + s, 4 + s, 6 + s */
        const __m256i a = wide16(ql + 16 * s), b = wide16(ql + 32 + 16 * s), h = wide16(qh + 16 * s);
        const __m256i c[4] = {_mm256_or_si256(_mm256_and_si256(a, m4), _mm256_and_si256(_mm256_slli_epi16(h, 4), m30)),
                              _mm256_or_si256(_mm256_and_si256(b, m4), _mm256_and_si256(_mm256_slli_epi16(h, 2), m30)),
                              _mm256_or_si256(_mm256_srli_epi16(a, 4), _mm256_and_si256(h, m30)),
                              _mm256_or_si256(_mm256_srli_epi16(b, 4), _mm256_and_si256(_mm256_srli_epi16(h, 2), m30))};
        for (int k = 0; k < 4; k += 2) {
            const __m256i i0 = _mm256_madd_epi16(_mm256_sub_epi16(c[k], c32), q16(q + 32 * k + 16 * s));
            const __m256i i1 = _mm256_madd_epi16(_mm256_sub_epi16(c[k + 1], c32), q16(q + 32 * (k + 1) + 16 * s));
            *acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_set1_ps(d * (float)sc[2 * k + s] * dx[k]), *acc0);
            *acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_set1_ps(d * (float)sc[2 * k + 2 + s] * dx[k + 1]), *acc1);
        }
    }
}

float kv_row_q6k(const uint8_t *c, const int16_t *q, const float *dx, int nsb) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    for (int k = 0; k < nsb; k++) {
        const uint8_t *b = c + (size_t)k * 210;
        const float d = f16_at(b + 208);
        const int16_t *qk = q + (size_t)k * KV_QK_K;
        const float *dk = dx + 8 * (size_t)k;
        q6k_half(b, b + 128, (const int8_t *)(b + 192), d, qk, dk, &a0, &a1);
        q6k_half(b + 64, b + 160, (const int8_t *)(b + 200), d, qk + 128, dk + 4, &a0, &a1);
    }
    return hsum8(_mm256_add_ps(a0, a1));
}

/* kv_row_q45k for R input rows at once (R a constant, 2..4; row i at q + i * qs, dx + i * dxs,
 * sx + i * sxs): a super-block's scales are unpacked once and each pair of sub-blocks' codes once,
 * then multiplied by the R rows, each row's acc0, acc1 and off taking exactly q45k_block's operations
 * in its order, so out[i] is bit for bit kv_row_q45k's value. */
static inline __attribute__((always_inline)) void q45k_rows(const uint8_t *c, const int16_t *q, size_t qs,
                                                            const float *dx, size_t dxs, int nsb, const float *sx,
                                                            size_t sxs, const int five, const int R, float *out) {
    const size_t size = kv_k_block_bytes(five ? 5 : 4);
    __m256 a0[4], a1[4], off[4];
    KV_UNROLL
    for (int i = 0; i < R; i++) a0[i] = a1[i] = off[i] = _mm256_setzero_ps();
    for (int k = 0; k < nsb; k++) {
        const uint8_t *b = c + k * size, *qsb = b + (five ? 48 : 16);
        __m256 scv, mnv, sdv[4];
        k4_scales8(b, &scv, &mnv);
        KV_UNROLL
        for (int i = 0; i < R; i++) {
            off[i] = _mm256_fmadd_ps(mnv, _mm256_loadu_ps(sx + i * sxs + 8 * (size_t)k), off[i]);
            sdv[i] = _mm256_mul_ps(scv, _mm256_loadu_ps(dx + i * dxs + 8 * (size_t)k));
        }
        __m256i h0 = _mm256_setzero_si256(), h1 = h0;
        if (five) {
            h0 = wide16(b + 16);
            h1 = wide16(b + 32);
        }
        for (int j = 0; j < 4; j++) {
            __m256i lo0, lo1, hi0, hi1;
            k45_codes(qsb + 32 * j, five, &h0, &h1, &lo0, &lo1, &hi0, &hi1);
            KV_UNROLL
            for (int i = 0; i < R; i++) {
                const int16_t *qa = q + i * qs + (size_t)k * KV_QK_K + 64 * j;
                const __m256i ia = _mm256_add_epi32(_mm256_madd_epi16(lo0, q16(qa)), _mm256_madd_epi16(lo1, q16(qa + 16)));
                const __m256i ib = _mm256_add_epi32(_mm256_madd_epi16(hi0, q16(qa + 32)), _mm256_madd_epi16(hi1, q16(qa + 48)));
                a0[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia), _mm256_permutevar8x32_ps(sdv[i], _mm256_set1_epi32(2 * j)), a0[i]);
                a1[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ib), _mm256_permutevar8x32_ps(sdv[i], _mm256_set1_epi32(2 * j + 1)), a1[i]);
            }
        }
    }
    KV_UNROLL
    for (int i = 0; i < R; i++) out[i] = hsum8(_mm256_add_ps(a0[i], a1[i])) - hsum8(off[i]);
}

/* kv_row_q6k for R input rows at once (as q45k_rows): each l-range's four sub-blocks' codes are
 * unpacked once (less 32) and multiplied by the R rows in q6k_half's order. */
static inline __attribute__((always_inline)) void q6k_rows(const uint8_t *c, const int16_t *q, size_t qs,
                                                           const float *dx, size_t dxs, int nsb, const int R,
                                                           float *out) {
    const __m256i m4 = _mm256_set1_epi16(0x0F), m30 = _mm256_set1_epi16(0x30), c32 = _mm256_set1_epi16(32);
    __m256 a0[4], a1[4];
    KV_UNROLL
    for (int i = 0; i < R; i++) a0[i] = a1[i] = _mm256_setzero_ps();
    for (int k = 0; k < nsb; k++) {
        const uint8_t *blk = c + (size_t)k * 210;
        const float d = f16_at(blk + 208);
        for (int n = 0; n < 2; n++) { /* the halves, as kv_row_q6k calls q6k_half */
            const uint8_t *ql = blk + 64 * n, *qh = blk + 128 + 32 * n;
            const int8_t *sc = (const int8_t *)(blk + 192) + 8 * n;
            for (int s = 0; s < 2; s++) {
                const __m256i a = wide16(ql + 16 * s), b = wide16(ql + 32 + 16 * s), h = wide16(qh + 16 * s);
                const __m256i cv[4] = {
                    _mm256_sub_epi16(_mm256_or_si256(_mm256_and_si256(a, m4), _mm256_and_si256(_mm256_slli_epi16(h, 4), m30)), c32),
                    _mm256_sub_epi16(_mm256_or_si256(_mm256_and_si256(b, m4), _mm256_and_si256(_mm256_slli_epi16(h, 2), m30)), c32),
                    _mm256_sub_epi16(_mm256_or_si256(_mm256_srli_epi16(a, 4), _mm256_and_si256(h, m30)), c32),
                    _mm256_sub_epi16(_mm256_or_si256(_mm256_srli_epi16(b, 4), _mm256_and_si256(_mm256_srli_epi16(h, 2), m30)), c32)};
                for (int kk = 0; kk < 4; kk += 2)
                    KV_UNROLL
                    for (int i = 0; i < R; i++) {
                        const int16_t *qn = q + i * qs + (size_t)k * KV_QK_K + 128 * n;
                        const float *dn = dx + i * dxs + 8 * (size_t)k + 4 * n;
                        const __m256i i0 = _mm256_madd_epi16(cv[kk], q16(qn + 32 * kk + 16 * s));
                        const __m256i i1 = _mm256_madd_epi16(cv[kk + 1], q16(qn + 32 * (kk + 1) + 16 * s));
                        a0[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_set1_ps(d * (float)sc[2 * kk + s] * dn[kk]), a0[i]);
                        a1[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_set1_ps(d * (float)sc[2 * kk + 2 + s] * dn[kk + 1]), a1[i]);
                    }
            }
        }
    }
    KV_UNROLL
    for (int i = 0; i < R; i++) out[i] = hsum8(_mm256_add_ps(a0[i], a1[i]));
}

void kv_rows_q45k(const uint8_t *c, const int16_t *q, size_t qs, const float *dx, size_t dxs, int nsb, const float *sx,
                  size_t sxs, int bits, int r, float *out) {
    const int five = bits == 5; /* each branch with its constants: R and whether there are fifth bits */
    if (r == 4) five ? q45k_rows(c, q, qs, dx, dxs, nsb, sx, sxs, 1, 4, out) : q45k_rows(c, q, qs, dx, dxs, nsb, sx, sxs, 0, 4, out);
    else if (r == 3) five ? q45k_rows(c, q, qs, dx, dxs, nsb, sx, sxs, 1, 3, out) : q45k_rows(c, q, qs, dx, dxs, nsb, sx, sxs, 0, 3, out);
    else if (r == 2) five ? q45k_rows(c, q, qs, dx, dxs, nsb, sx, sxs, 1, 2, out) : q45k_rows(c, q, qs, dx, dxs, nsb, sx, sxs, 0, 2, out);
    else out[0] = kv_row_q45k(c, q, dx, nsb, sx, bits);
}

void kv_rows_q6k(const uint8_t *c, const int16_t *q, size_t qs, const float *dx, size_t dxs, int nsb, int r, float *out) {
    if (r == 4) q6k_rows(c, q, qs, dx, dxs, nsb, 4, out);
    else if (r == 3) q6k_rows(c, q, qs, dx, dxs, nsb, 3, out);
    else if (r == 2) q6k_rows(c, q, qs, dx, dxs, nsb, 2, out);
    else out[0] = kv_row_q6k(c, q, dx, nsb);
}

#else /* portable C: every code unpacked one by one, the same integer sums */

float kv_row_q45k(const uint8_t *c, const int16_t *q, const float *dx, int nsb, const float *sx, int bits) {
    const size_t size = kv_k_block_bytes(bits);
    float acc = 0.0f, off = 0.0f;
    for (int k = 0; k < nsb; k++) {
        const uint8_t *b = c + k * size, *qh = b + 16, *qs = b + (bits == 5 ? 48 : 16);
        float sc[8], mn[8];
        k4_scales(b, sc, mn);
        for (int j = 0; j < 8; j++) {
            const int16_t *qj = q + (size_t)k * KV_QK_K + 32 * j;
            int32_t t = 0;
            for (int l = 0; l < 32; l++) {
                int v = (qs[32 * (j >> 1) + l] >> (4 * (j & 1))) & 0x0F;
                if (bits == 5) v |= ((qh[l] >> j) & 1) << 4;
                t += v * qj[l];
            }
            acc += (float)t * (sc[j] * dx[8 * (size_t)k + j]);
            off += mn[j] * sx[8 * (size_t)k + j];
        }
    }
    return acc - off;
}

float kv_row_q6k(const uint8_t *c, const int16_t *q, const float *dx, int nsb) {
    float acc = 0.0f;
    for (int k = 0; k < nsb; k++)
        for (int n = 0; n < 2; n++) {
            const uint8_t *b = c + (size_t)k * 210, *ql = b + 64 * n, *qh = b + 128 + 32 * n;
            const int8_t *sc = (const int8_t *)(b + 192) + 8 * n;
            const float d = f16_at(b + 208);
            const int16_t *qn = q + (size_t)k * KV_QK_K + 128 * n;
            const float *dn = dx + 8 * (size_t)k + 4 * n;
            int32_t part[8] = {0};
            for (int kk = 0; kk < 4; kk++)
                for (int l = 0; l < 32; l++) {
                    const int lo = ((kk & 1 ? ql[32 + l] : ql[l]) >> (kk >= 2 ? 4 : 0)) & 0x0F;
                    const int v = (lo | (((qh[l] >> (2 * kk)) & 3) << 4)) - 32;
                    part[2 * kk + l / 16] += v * qn[32 * kk + l];
                }
            for (int i = 0; i < 8; i++) acc += (float)part[i] * (d * (float)sc[i] * dn[i / 2]);
        }
    return acc;
}

/* One row at a time: the portable loops have one order, the same for any number of rows. */
void kv_rows_q45k(const uint8_t *c, const int16_t *q, size_t qs, const float *dx, size_t dxs, int nsb, const float *sx,
                  size_t sxs, int bits, int r, float *out) {
    for (int i = 0; i < r; i++) out[i] = kv_row_q45k(c, q + i * qs, dx + i * dxs, nsb, sx + i * sxs, bits);
}

void kv_rows_q6k(const uint8_t *c, const int16_t *q, size_t qs, const float *dx, size_t dxs, int nsb, int r, float *out) {
    for (int i = 0; i < r; i++) out[i] = kv_row_q6k(c, q + i * qs, dx + i * dxs, nsb);
}
#endif
