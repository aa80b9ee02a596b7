/* What the row kernels share (rowops.c: GPT-2's (in, out) layout; rowdot.c: nn.Linear's
 * (out, in) layout; blockdot.c and kblocks.c: block codes): exp without a libm call, so the activation
 * loops vectorize (and exp8, the same on eight AVX2 lanes), fp16 widening, RMSNorm, RoPE. */
#ifndef KVVIZ_ROWCOMMON_H
#define KVVIZ_ROWCOMMON_H

#include <math.h>
#include <stdint.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

/* The many-row block loops' loops over their R input rows (lblocks.c, kblocks.c), unrolled early so
 * each row's accumulators live in registers. */
#define KV_UNROLL _Pragma("GCC unroll 4")

/* An IEEE half as fp32 (exact: every half is an fp32). blockdot.c and kblocks.c read the GGUF's fp16 scales. */
static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, ex = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    union { uint32_t u; float f; } v;
    if (ex == 0) { /* zero or subnormal: man * 2^-24, exact */
        const float f = ldexpf((float)man, -24);
        return sign ? -f : f;
    }
    v.u = sign | (ex == 31 ? 0x7F800000u | (man << 13) : ((ex + 112u) << 23) | (man << 13));
    return v.f;
#endif
}

/* exp(v) for |v| <= 88 in plain arithmetic, so the activation loops vectorize (a call to expf
 * would not): v = k ln2 + r with |r| <= ln2/2, e^r by its degree-6 Taylor polynomial (error < 2e-7
 * relative there), 2^k built in the exponent bits. The constants are Cephes' expf. */
static inline float exp_poly(float v) {
    v = v > 88.0f ? 88.0f : (v < -88.0f ? -88.0f : v);
    const float k = nearbyintf(v * 1.44269504088896341f);
    const float r = (v - k * 0.693359375f) + k * 2.12194440e-4f; /* v - k ln2, in two parts */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { float f; int i; } two_k = {.i = ((int)k + 127) << 23};
    return p * two_k.f;
}

/* RMSNorm of one row, as transformers computes it in fp32: x * rsqrt(mean(x^2) + eps) * w
 * (the sum of squares in double, so the row's length does not cost accuracy). rowdot.c (Llama)
 * and blockdot.c (Gemma 3) share it; out may be x. */
static inline void rms_norm(const float *x, int n, const float *w, float eps, float *out) {
    double ss = 0.0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    const float r = (float)(1.0 / sqrt(ss / n + eps));
    for (int i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
}

/* transformers' rotate_half RoPE on one head of hs values: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s). */
static inline void rope_head(float *h, const float *c, const float *s, int hs) {
    const int half = hs / 2;
    for (int k = 0; k < half; k++) {
        const float a = h[k], b = h[k + half];
        h[k] = a * c[k] - b * s[k];
        h[k + half] = b * c[k + half] + a * s[k + half];
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* exp_poly on eight lanes, the same operations in the same order (no FMA), so a lane gives what
 * the scalar code gives (rowdot.c's SwiGLU, logits.c's softmax sums: GCC leaves exp_poly's loop
 * scalar, its round and float-to-int). */
static inline __m256 exp8(__m256 v) {
    v = _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-88.0f)), _mm256_set1_ps(88.0f));
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_add_ps(_mm256_sub_ps(v, _mm256_mul_ps(k, _mm256_set1_ps(0.693359375f))),
                                   _mm256_mul_ps(k, _mm256_set1_ps(2.12194440e-4f)));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r), _mm256_set1_ps(1.0f));
    const __m256i two_k = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two_k));
}
#endif

#endif
