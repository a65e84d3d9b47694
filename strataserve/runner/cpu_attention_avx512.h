/* The float32 query row of cpu_paged_attention.c on AVX-512 machines, for head dims that are a multiple of 16.
 * Included by that file after MAX_HQ, prefetch_block, softmax_keys and normalize_heads; defines
 * STRATA_ROW_F32_X16 when it provides row_f32_x16_any.
 *
 * Same math and passes as the generic row (scores, softmax, weighted V sum), arranged for 512-bit registers:
 * - scores: the (key, head) pairs are taken in the order the score buffer stores them, sixteen dot products at a
 *   time, and the sixteen partial vectors are reduced together into one vector of sixteen scores (a transpose-and-
 *   add tree: 15 combines, where reducing each dot product alone would take 4 shuffles and adds apiece);
 * - weighted V sum: per run of up to 16 keys, each head's accumulator stays in registers across the keys (the
 *   generic loop loads and stores the accumulator once per key and head);
 * - keys are located by a cursor stepped one key at a time, and K rows are prefetched PF_KEYS keys ahead, across
 *   block boundaries, where the hardware prefetcher loses the stream.
 * On the decode step of a batch of 64 sequences (8 query heads, 4 KV heads, head dim 32, ~290 keys each) it reads
 * K/V at 1.3x the time of a bare read of the same rows, against 1.7x for the generic row (one thread). */
#if defined(__AVX512F__)
#include <immintrin.h>
#define STRATA_ROW_F32_X16 1

/* out[i] = sum of the lanes of v[i], for sixteen vectors. */
static inline __m512 hsum16(const __m512 *v) {
    __m512 b[8], c[4];
    for (int i = 0; i < 8; ++i) /* 128-bit lane l of b[i]: partial sums of v[2i], v[2i+1], v[2i], v[2i+1] */
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) /* lane l of c[i]: partial sums of v[4i .. 4i + 3] */
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xee));
    const __m512 e = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
    const __m512 f = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e, f, 0x88), _mm512_shuffle_f32x4(e, f, 0xdd));
}

/* A key's row offset in the caches, stepped one key at a time (no division per key). */
struct key_cursor {
    const int32_t *bt;
    int b, off, bs;
    size_t tok, block;
};
static inline size_t cursor_at(const struct key_cursor *c) {
    return (size_t)c->bt[c->b] * c->block + (size_t)c->off * c->tok;
}
static inline void cursor_next(struct key_cursor *c) {
    if (++c->off == c->bs) {
        c->off = 0;
        ++c->b;
    }
}

#define PF_KEYS 8 /* prefetch distance in keys (4 and 16 measured no better) */

/* <q_h, k> over D values, q and k 64-byte aligned or not. */
static inline __attribute__((always_inline)) __m512 dot16(const float *q, const float *k, const int D) {
    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k));
    for (int c = 16; c < D; c += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + c), _mm512_loadu_ps(k + c), a);
    return a;
}

/* Scores sc[key][head] of keys [lo, hi) for the scaled query row q (hq heads of D). */
static inline __attribute__((always_inline)) void scores_x16(float *sc, const float *q, const float *kc,
                                                            const int32_t *bt, int lo, int hi, int hq, int hkv,
                                                            const int D, int bs) {
    const int g = hq / hkv, total = (hi - lo) * hq;
    const size_t tok = (size_t)hkv * D;
    int koff[MAX_HQ];
    for (int h = 0; h < hq; ++h) koff[h] = (h / g) * D;
    struct key_cursor k = {bt, lo / bs, lo % bs, bs, tok, (size_t)bs * tok}, pf = k;
    int ahead = lo; /* the key pf points at */
    for (; ahead < hi && ahead < lo + PF_KEYS; ++ahead) cursor_next(&pf);
    const float *kp = kc + cursor_at(&k);
/* Past the last key of the row the cursor may point beyond the block table: kp is not moved there. */
#define SCORES_NEXT_KEY(more)                                                                                     \
    do {                                                                                                          \
        h = 0;                                                                                                    \
        cursor_next(&k);                                                                                          \
        if (ahead < hi) {                                                                                         \
            prefetch_block(kc + cursor_at(&pf), tok * sizeof(float));                                             \
            cursor_next(&pf);                                                                                     \
            ++ahead;                                                                                              \
        }                                                                                                         \
        if (more) kp = kc + cursor_at(&k);                                                                        \
    } while (0)
    int h = 0, e = 0;
    /* Sixteen at a time with a constant count, so that v[] stays in registers; then one at a time. */
    for (; e < total; e += 16) {
        const int m = total - e < 16 ? total - e : 16;
        __m512 v[16];
        if (m == 16) {
            for (int i = 0; i < 16; ++i) {
                v[i] = dot16(q + (size_t)h * D, kp + koff[h], D);
                if (++h == hq) SCORES_NEXT_KEY(e + i + 1 < total);
            }
            _mm512_storeu_ps(sc + e, hsum16(v));
        } else {
            for (int i = 0; i < m; ++i) {
                sc[e + i] = _mm512_reduce_add_ps(dot16(q + (size_t)h * D, kp + koff[h], D));
                if (++h == hq) SCORES_NEXT_KEY(e + i + 1 < total);
            }
        }
    }
#undef SCORES_NEXT_KEY
}

/* acc[h] += sum over keys [lo, hi) of w[key][h] * V[key, h / g], up to 16 keys at a time with each head's
 * accumulator (up to 64 values at once) held in registers. */
static inline __attribute__((always_inline)) void weighted_v_x16(float *acc, const float *w, const float *vc,
                                                                const int32_t *bt, int lo, int hi, int hq,
                                                                int hkv, const int D, int bs) {
    const int g = hq / hkv, n = hi - lo;
    const size_t tok = (size_t)hkv * D;
    struct key_cursor cur = {bt, lo / bs, lo % bs, bs, tok, (size_t)bs * tok};
    const float *vrow[16];
    for (int j0 = 0; j0 < n; j0 += 16) {
        const int nj = n - j0 < 16 ? n - j0 : 16;
        for (int j = 0; j < nj; ++j) {
            vrow[j] = vc + cursor_at(&cur);
            cursor_next(&cur);
        }
        for (int h = 0; h < hq; ++h) {
            const size_t koff = (size_t)(h / g) * D;
            const float *wh = w + (size_t)j0 * hq + h;
            for (int c = 0; c < D; c += 64) {
                const int nc = D - c < 64 ? (D - c) / 16 : 4; /* vectors of this slice */
                float *a = acc + (size_t)h * D + c;
                __m512 r0 = _mm512_loadu_ps(a), r1 = _mm512_setzero_ps(), r2 = r1, r3 = r1;
                if (nc > 1) r1 = _mm512_loadu_ps(a + 16);
                if (nc > 2) r2 = _mm512_loadu_ps(a + 32);
                if (nc > 3) r3 = _mm512_loadu_ps(a + 48);
                for (int j = 0; j < nj; ++j) {
                    const __m512 x = _mm512_set1_ps(wh[(size_t)j * hq]);
                    const float *vp = vrow[j] + koff + c;
                    r0 = _mm512_fmadd_ps(x, _mm512_loadu_ps(vp), r0);
                    if (nc > 1) r1 = _mm512_fmadd_ps(x, _mm512_loadu_ps(vp + 16), r1);
                    if (nc > 2) r2 = _mm512_fmadd_ps(x, _mm512_loadu_ps(vp + 32), r2);
                    if (nc > 3) r3 = _mm512_fmadd_ps(x, _mm512_loadu_ps(vp + 48), r3);
                }
                _mm512_storeu_ps(a, r0);
                if (nc > 1) _mm512_storeu_ps(a + 16, r1);
                if (nc > 2) _mm512_storeu_ps(a + 32, r2);
                if (nc > 3) _mm512_storeu_ps(a + 48, r3);
            }
        }
    }
}

static inline __attribute__((always_inline)) void row_f32_x16(const float *q, float *acc, const float *kc,
                                                             const float *vc, const int32_t *bt, int lo, int hi,
                                                             int hq, int hkv, const int D, int bs, float *sc) {
    float sum[MAX_HQ];
    scores_x16(sc, q, kc, bt, lo, hi, hq, hkv, D, bs);
    softmax_keys(sc, hi - lo, hq, sum);
    memset(acc, 0, sizeof(float) * (size_t)hq * D);
    weighted_v_x16(acc, sc, vc, bt, lo, hi, hq, hkv, D, bs);
    normalize_heads(acc, sum, hq, D);
}

/* The row for a runtime head dim (a multiple of 16), with the common ones as compile-time constants. */
static void row_f32_x16_any(const float *q, float *acc, const float *kc, const float *vc, const int32_t *bt, int lo,
                            int hi, int hq, int hkv, int D, int bs, float *sc) {
    switch (D) {
    case 32: row_f32_x16(q, acc, kc, vc, bt, lo, hi, hq, hkv, 32, bs, sc); break;
    case 64: row_f32_x16(q, acc, kc, vc, bt, lo, hi, hq, hkv, 64, bs, sc); break;
    case 128: row_f32_x16(q, acc, kc, vc, bt, lo, hi, hq, hkv, 128, bs, sc); break;
    default: row_f32_x16(q, acc, kc, vc, bt, lo, hi, hq, hkv, D, bs, sc);
    }
}
#endif
