/* A row of a K-type weight (Q4_K, Q5_K, Q6_K) kept as the GGUF's super-blocks of 256, times one fp32
 * input row (issue 42). blockdot.c calls it for each (weight row, input row).
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
 * a sub-block's sum is scale * sum(code x) - offset * sum(x), as blockdot.c computes every type.
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

/* Eight bytes widened to eight int32 lanes (zero-extended). */
static inline __m256i zx8(const uint8_t *c) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)c)); }

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One Q4_K (five = 0) or Q5_K (1) super-block: each sub-block's products summed in lanes, scaled
 * into acc0 (even sub-blocks) or acc1 (odd); the eight offsets times sx's eight sums, lane by lane, into off.
 * Each 8 bytes of nibbles are widened once and give 8 codes of two sub-blocks (an AND, a shift). */
static inline __attribute__((always_inline)) void q45k_block(const uint8_t *b, const float *x, const float *sx,
                                                             const int five, __m256 *acc0, __m256 *acc1, __m256 *off) {
    float sc[8], mn[8];
    k4_scales(b, sc, mn);
    *off = _mm256_fmadd_ps(_mm256_loadu_ps(mn), _mm256_loadu_ps(sx), *off);
    const uint8_t *qs = b + (five ? 48 : 16);
    const __m256i m4 = _mm256_set1_epi32(0x0F), b4 = _mm256_set1_epi32(0x10);
    __m256i h[4];
    if (five)
        for (int g = 0; g < 4; g++) h[g] = zx8(b + 16 + 8 * g); /* qh[8 g .. 8 g + 7]; shifted down 2 a pair */
    for (int j = 0; j < 4; j++) { /* sub-blocks 2 j (low nibbles of qs[32 j ..]) and 2 j + 1 (high) */
        const uint8_t *q = qs + 32 * j;
        const float *xa = x + 64 * j, *xb = xa + 32;
        __m256 pa = _mm256_setzero_ps(), pb = pa;
        for (int g = 0; g < 4; g++) {
            const __m256i v = zx8(q + 8 * g);
            __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_srli_epi32(v, 4);
            if (five) { /* bit 2 j (now bit 0) and 2 j + 1 (bit 1) of qh[l], moved to bit 4 */
                lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi32(h[g], 4), b4));
                hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi32(h[g], 3), b4));
                h[g] = _mm256_srli_epi32(h[g], 2);
            }
            pa = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_loadu_ps(xa + 8 * g), pa);
            pb = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_loadu_ps(xb + 8 * g), pb);
        }
        *acc0 = _mm256_fmadd_ps(_mm256_set1_ps(sc[2 * j]), pa, *acc0);
        *acc1 = _mm256_fmadd_ps(_mm256_set1_ps(sc[2 * j + 1]), pb, *acc1);
    }
}

float kv_row_q45k(const uint8_t *c, const float *x, int nsb, const float *sx, int bits) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, off = a0;
    const size_t size = kv_k_block_bytes(bits);
    if (bits == 5) /* two loops, each with its constant: the Q4_K loop has no fifth-bit work */
        for (int k = 0; k < nsb; k++) q45k_block(c + k * size, x + (size_t)k * KV_QK_K, sx + 8 * (size_t)k, 1, &a0, &a1, &off);
    else
        for (int k = 0; k < nsb; k++) q45k_block(c + k * size, x + (size_t)k * KV_QK_K, sx + 8 * (size_t)k, 0, &a0, &a1, &off);
    return hsum8(_mm256_add_ps(a0, a1)) - hsum8(off);
}

/* Half a Q6_K super-block (128 weights; the layout above): for each l-range of 16, the four
 * sub-blocks' codes (k = 0..3) summed in lanes, then scaled by d * sc into acc. */
static inline void q6k_half(const uint8_t *ql, const uint8_t *qh, const int8_t *sc, float d, const float *x,
                            __m256 *acc0, __m256 *acc1) {
    const __m256i m4 = _mm256_set1_epi32(0x0F), m30 = _mm256_set1_epi32(0x30), c32 = _mm256_set1_epi32(32);
    for (int s = 0; s < 2; s++) { /* l in [16 s, 16 s + 16): sub-blocks s, 2 + s, 4 + s, 6 + s */
        __m256 p[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int g = 2 * s; g < 2 * s + 2; g++) {
            const __m256i a = zx8(ql + 8 * g), b = zx8(ql + 32 + 8 * g), h = zx8(qh + 8 * g);
            const __m256i q[4] = {_mm256_or_si256(_mm256_and_si256(a, m4), _mm256_and_si256(_mm256_slli_epi32(h, 4), m30)),
                                  _mm256_or_si256(_mm256_and_si256(b, m4), _mm256_and_si256(_mm256_slli_epi32(h, 2), m30)),
                                  _mm256_or_si256(_mm256_srli_epi32(a, 4), _mm256_and_si256(h, m30)),
                                  _mm256_or_si256(_mm256_srli_epi32(b, 4), _mm256_and_si256(_mm256_srli_epi32(h, 2), m30))};
            for (int k = 0; k < 4; k++)
                p[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q[k], c32)), _mm256_loadu_ps(x + 32 * k + 8 * g), p[k]);
        }
        for (int k = 0; k < 4; k += 2) {
            *acc0 = _mm256_fmadd_ps(_mm256_set1_ps(d * (float)sc[2 * k + s]), p[k], *acc0);
            *acc1 = _mm256_fmadd_ps(_mm256_set1_ps(d * (float)sc[2 * k + 2 + s]), p[k + 1], *acc1);
        }
    }
}

float kv_row_q6k(const uint8_t *c, const float *x, int nsb) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    for (int k = 0; k < nsb; k++) {
        const uint8_t *b = c + (size_t)k * 210;
        const float d = f16_at(b + 208);
        const float *xk = x + (size_t)k * KV_QK_K;
        q6k_half(b, b + 128, (const int8_t *)(b + 192), d, xk, &a0, &a1);
        q6k_half(b + 64, b + 160, (const int8_t *)(b + 200), d, xk + 128, &a0, &a1);
    }
    return hsum8(_mm256_add_ps(a0, a1));
}

#else /* portable C: every code unpacked one by one */

float kv_row_q45k(const uint8_t *c, const float *x, int nsb, const float *sx, int bits) {
    const size_t size = kv_k_block_bytes(bits);
    float acc = 0.0f, off = 0.0f;
    for (int k = 0; k < nsb; k++) {
        const uint8_t *b = c + k * size, *qh = b + 16, *qs = b + (bits == 5 ? 48 : 16);
        float sc[8], mn[8];
        k4_scales(b, sc, mn);
        for (int j = 0; j < 8; j++) {
            const float *xj = x + (size_t)k * KV_QK_K + 32 * j;
            float d = 0.0f;
            for (int l = 0; l < 32; l++) {
                int q = (qs[32 * (j >> 1) + l] >> (4 * (j & 1))) & 0x0F;
                if (bits == 5) q |= ((qh[l] >> j) & 1) << 4;
                d += (float)q * xj[l];
            }
            acc += sc[j] * d;
            off += mn[j] * sx[8 * (size_t)k + j];
        }
    }
    return acc - off;
}

float kv_row_q6k(const uint8_t *c, const float *x, int nsb) {
    float acc = 0.0f;
    for (int k = 0; k < nsb; k++)
        for (int n = 0; n < 2; n++) {
            const uint8_t *b = c + (size_t)k * 210, *ql = b + 64 * n, *qh = b + 128 + 32 * n;
            const int8_t *sc = (const int8_t *)(b + 192) + 8 * n;
            const float d = f16_at(b + 208), *xn = x + (size_t)k * KV_QK_K + 128 * n;
            float part[8] = {0};
            for (int kk = 0; kk < 4; kk++)
                for (int l = 0; l < 32; l++) {
                    const int lo = ((kk & 1 ? ql[32 + l] : ql[l]) >> (kk >= 2 ? 4 : 0)) & 0x0F;
                    const int q = (lo | (((qh[l] >> (2 * kk)) & 3) << 4)) - 32;
                    part[2 * kk + l / 16] += (float)q * xn[32 * kk + l];
                }
            for (int i = 0; i < 8; i++) acc += (d * (float)sc[i]) * part[i];
        }
    return acc;
}
#endif
