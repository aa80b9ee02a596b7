/* What a generation loop reads off each step's logits besides the sampled token, instead of torch's
 * five ops (isfinite + all, softmax, topk; each a pass and most an allocation): whether every logit
 * is finite, and the k most likely tokens with their softmax probabilities (the live views'
 * candidates) in one pass over the vocabulary.
 *
 * Why: for Gemma 3's vocabulary of 262,144 those ops took about 2 ms a decode step on the
 * project's 2-core machine, a tenth of the step. Here the top-k scan looks inside a block of 64
 * only when the block's maximum (a vectorized pass) beats the current k-th, and the sum of
 * exponentials runs eight lanes at a time (exp8, rowcommon.h) on the same block while it is in L1:
 * the sum is taken against the running maximum and rescaled (in double) when a block raises it, so
 * the 1 MiB of logits is read once, not twice (a second pass cost about 0.1 ms a step, read back
 * from L3).
 *
 * The maths is torch.softmax's: p_i = exp(x_i - max) / sum_j exp(x_j - max), the sum in double
 * here; ties keep the lower index first (torch.topk leaves their order unspecified).
 * kvviz/fast/logits.py calls it.
 */
#include <math.h>
#include <stdint.h>

#include "rowcommon.h"

#define BLOCK 64


/* sum_i exp(x_i - mx) over [b, e), in fp32 lanes. */
static inline float exp_sum(const float *x, int64_t b, int64_t e, float mx) {
    float s = 0.0f;
    int64_t i = b;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    const __m256 m = _mm256_set1_ps(mx);
    for (; i + 8 <= e; i += 8) acc = _mm256_add_ps(acc, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), m)));
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int j = 0; j < 8; j++) s += lanes[j];
#endif
    for (; i < e; i++) s += exp_poly(x[i] - mx);
    return s;
}

/* 1 when every one of the n values is finite: x - x is 0 for a finite x and NaN for an infinite or
 * NaN one, and a NaN survives the sum (no -ffast-math). */
int kv_all_finite(const float *x, int64_t n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += x[i] - x[i];
    return s == 0.0f;
}

static inline void insert(float v, int64_t i, int k, float *tv, int64_t *ti) {
    int j = k - 1; /* v beats the k-th: slide the smaller ones down */
    while (j > 0 && v > tv[j - 1]) {
        tv[j] = tv[j - 1];
        ti[j] = ti[j - 1];
        j--;
    }
    tv[j] = v;
    ti[j] = i;
}

/* The k (1..16) largest of n finite values, largest first, their indices in idx and their softmax
 * probabilities over all n in prob, in one pass: each block of 64 gives its maximum, the top-k scan
 * (only when that beats the k-th), then its exponentials' sum against the running maximum M. A block
 * whose maximum m beats M first rescales the sum taken so far by exp(M - m) (in double: one libm call
 * each time the maximum grows, a few times a row), so the sum is sum_j exp(x_j - max) as the two-pass
 * form took it, each term to exp_poly's relative error, whichever M it was taken against.
 * Non-finite values go as they went in the two-pass form: NaN and -inf never enter the top k (an
 * unfilled place keeps index -1), +inf does and makes every probability NaN; a NaN adds nothing to
 * the sum in exp8's lanes (its clamp takes -88) and NaN in the scalar tail of a row whose length is
 * not a multiple of 8. Returns 0, or -1 for k out of range or n < k. */
int kv_top_probs(const float *x, int64_t n, int k, int64_t *idx, float *prob) {
    if (k < 1 || k > 16 || n < k) return -1;
    float tv[16];
    for (int j = 0; j < k; j++) {
        tv[j] = -INFINITY;
        idx[j] = -1;
    }
    float mx = -INFINITY; /* the largest value so far (NaN ignored): tv[0] once it is filled */
    double sum = 0.0;     /* sum of exp(x - mx) over the blocks so far: fp32 partial sums of 64 in double */
    for (int64_t b = 0; b < n; b += BLOCK) {
        const int64_t e = b + BLOCK < n ? b + BLOCK : n;
        float m = -INFINITY;
#pragma omp simd reduction(max : m)
        for (int64_t i = b; i < e; i++) m = x[i] > m ? x[i] : m;
        if (m > tv[k - 1]) /* something here beats the k-th (finite values beat -inf) */
            for (int64_t i = b; i < e; i++)
                if (x[i] > tv[k - 1]) insert(x[i], i, k, tv, idx);
        if (m > mx) { /* the maximum grows: the earlier terms were taken against the old one */
            sum *= exp((double)mx - (double)m); /* 0 from -inf (nothing finite yet) or to +inf */
            mx = m;
        }
        sum += exp_sum(x, b, e, mx);
    }
    for (int j = 0; j < k; j++) prob[j] = (float)(exp_poly(tv[j] - mx) / sum);
    return 0;
}

/* The index of the first largest of n (>= 1) values, or -1 when any value is not finite (the caller
 * then asks torch, whose argmax has its own rule for NaN). Two passes: the maximum and a finiteness
 * sum (x - x: 0 for a finite value, NaN for an infinite or NaN one), then the first index holding
 * the maximum, as torch.argmax returns.
 * Why: greedy decoding takes an argmax of every step's logits, and torch's took 0.34 ms of Gemma 3's
 * 262,144 at one thread (a pass at 3 GB/s). */
int64_t kv_argmax(const float *x, int64_t n) {
    float m = -INFINITY, bad = 0.0f;
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 vm = _mm256_set1_ps(-INFINITY), vb = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        vm = _mm256_max_ps(vm, v);
        vb = _mm256_add_ps(vb, _mm256_sub_ps(v, v));
    }
    float lm[8], lb[8];
    _mm256_storeu_ps(lm, vm);
    _mm256_storeu_ps(lb, vb);
    for (int j = 0; j < 8; j++) {
        m = lm[j] > m ? lm[j] : m;
        bad += lb[j];
    }
#endif
    for (; i < n; i++) {
        m = x[i] > m ? x[i] : m;
        bad += x[i] - x[i];
    }
    if (bad != 0.0f || n < 1) return -1; /* (a NaN lane made max_ps's result arbitrary: no matter) */
    i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 want = _mm256_set1_ps(m);
    for (; i + 8 <= n; i += 8) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), want, _CMP_EQ_OQ));
        if (hit) return i + __builtin_ctz((unsigned)hit);
    }
#endif
    for (; i < n; i++)
        if (x[i] == m) return i;
    return -1; /* not reached: m is one of the values */
}
