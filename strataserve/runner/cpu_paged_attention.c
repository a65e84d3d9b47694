/* Paged attention on the CPU, reading K/V from the blocks in place (no gather into a contiguous copy), except for
 * long float32 prompt chunks, which are copied out once and run as tiles of sgemm (cpu_attention_gemm.h).
 *
 * Math, for one query row of sequence s at position pos = kv_lens[s] - query_len + i and query head h, keys
 * [lo, pos] with lo = max(0, pos - window + 1) (window <= 0: lo = 0), kv head kh = h / (hq / hkv):
 *     s_j = scale * <q_h, K[j, kh]>,   p_j = exp(s_j - max_j s_j) / sum_j exp(s_j - max_j s_j),
 *     out_h = sum_j p_j V[j, kh]
 * in float32 whatever the cache dtype (float32, bfloat16 or float16). Token j of a sequence lives in block
 * block_table[j / bs], row j % bs of caches laid out [num_blocks, bs, hkv, d] (runner/attention.py).
 *
 * Two passes per query row: scores for every key and head into a per-thread buffer, softmax, then the weighted
 * sum of V. Each key's K (then V) row of hkv * d values is read once for all query heads, in block order, so the
 * reads stream through memory. Rows (one per query) are handed out two at a time to the engine's threads
 * (cpu_par.h: the work-sharing pool, or OpenMP without it; the library links libgomp.so.1, which resolves to the
 * copy torch already loaded). On AVX-512 machines float32 rows with a head dim that is a multiple of 16 take
 * cpu_attention_avx512.h's row.
 * exp is a polynomial that gcc vectorises (libm's expf stays scalar without -ffast-math, which we avoid: a
 * -ffast-math shared object sets flush-to-zero for the whole process).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <stdatomic.h>

#include "cpu_math.h"
#include "cpu_par.h"

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline void prefetch_block(const void *p, size_t bytes) {
    for (size_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)p + i, 0, 3);
}

/* Scores of one key for every query head: st[h] = <q_h, k_{h / g}>. */
#define DEFINE_QK(NAME, T, LOAD)                                                                                  \
    static inline __attribute__((always_inline)) void NAME(float *st, const float *q, const T *kp, int hq, int g, \
                                                          const int D) {                                         \
        for (int h = 0; h < hq; ++h) {                                                                            \
            const T *kh = kp + (size_t)(h / g) * D;                                                               \
            const float *qh = q + (size_t)h * D;                                                                  \
            float s = 0.0f;                                                                                       \
            _Pragma("omp simd reduction(+:s)") for (int c = 0; c < D; ++c) s += qh[c] * LOAD(kh[c]);              \
            st[h] = s;                                                                                            \
        }                                                                                                         \
    }

#define LOAD_F32(x) (x)
#define LOAD_BF16(x) bf16_to_f32(x)
#define LOAD_F16(x) ((float)(x))
DEFINE_QK(qk_generic_f32, float, LOAD_F32)

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* The sums of eight vectors as one vector, in order (a generic loop would reduce each dot product alone). */
static inline __m256 hsum8(const __m256 *v) {
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

static inline __attribute__((always_inline)) void qk_f32(float *st, const float *q, const float *kp, int hq, int g,
                                                         const int D) {
    if (D % 8 || hq % 8) {
        qk_generic_f32(st, q, kp, hq, g, D);
        return;
    }
    for (int h8 = 0; h8 < hq; h8 += 8) {
        __m256 a[8];
        for (int j = 0; j < 8; ++j) {
            const float *kh = kp + (size_t)((h8 + j) / g) * D, *qh = q + (size_t)(h8 + j) * D;
            __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(qh), _mm256_loadu_ps(kh));
            for (int c = 8; c < D; c += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + c), _mm256_loadu_ps(kh + c), acc);
            a[j] = acc;
        }
        _mm256_storeu_ps(st + h8, hsum8(a));
    }
}
#else
#define qk_f32 qk_generic_f32
#endif

/* Scores sc[key][head] of n keys turned into unnormalised softmax weights exp(s - max over keys), in place; sum[h]
 * receives head h's total. */
#define MAX_HQ 256
static inline void softmax_keys(float *sc, int n, int hq, float *sum) {
    float m[MAX_HQ];
    for (int h = 0; h < hq; ++h) {
        m[h] = sc[h];
        sum[h] = 0.0f;
    }
    for (int j = 1; j < n; ++j)
#pragma omp simd
        for (int h = 0; h < hq; ++h) m[h] = sc[(size_t)j * hq + h] > m[h] ? sc[(size_t)j * hq + h] : m[h];
    for (int j = 0; j < n; ++j) {
        float *st = sc + (size_t)j * hq;
#pragma omp simd
        for (int h = 0; h < hq; ++h) {
            st[h] = exp_nonpos(st[h] - m[h]);
            sum[h] += st[h];
        }
    }
}

/* acc[h] /= sum[h] for the hq heads of D values. */
static inline void normalize_heads(float *acc, const float *sum, int hq, int D) {
    for (int h = 0; h < hq; ++h) {
        const float inv = 1.0f / sum[h];
        for (int c = 0; c < D; ++c) acc[(size_t)h * D + c] *= inv;
    }
}

/* One query row, cache element type T (LOAD converts one element to float), head dim D (a constant in the
 * specialised copies below, so the inner loops unroll into whole vectors). Keys are walked block by block, each
 * block's rows of hkv * D values read front to back for all heads at once (the reads stream; the next block is
 * prefetched while this one is used). Scores are kept key-major, sc[key][head], so the softmax statistics of all
 * heads are elementwise vector operations over the keys. */
#define DEFINE_ROW(NAME, T, LOAD, QK)                                                                               \
    static inline __attribute__((always_inline)) void NAME(                                                      \
        const float *q, float *acc, const T *kc, const T *vc, const int32_t *bt, int lo, int hi, int hq,          \
        int hkv, const int D, int bs, float *sc) {                                                                \
        const int g = hq / hkv, n = hi - lo;                                                                      \
        const size_t tok = (size_t)hkv * D, block = (size_t)bs * tok;                                             \
        for (int p = lo; p < hi;) {                                                                               \
            const int b = p / bs, off = p % bs, end = hi < (b + 1) * bs ? hi : (b + 1) * bs;                      \
            if (end < hi) prefetch_block(kc + (size_t)bt[b + 1] * block, block * sizeof(T));                      \
            const T *kp = kc + (size_t)bt[b] * block + (size_t)off * tok;                                         \
            for (; p < end; ++p, kp += tok) QK(sc + (size_t)(p - lo) * hq, q, kp, hq, g, D);                     \
        }                                                                                                         \
        float sum[MAX_HQ];                                                                                        \
        softmax_keys(sc, n, hq, sum);                                                                             \
        memset(acc, 0, sizeof(float) * (size_t)hq * D);                                                           \
        for (int p = lo; p < hi;) {                                                                               \
            const int b = p / bs, off = p % bs, end = hi < (b + 1) * bs ? hi : (b + 1) * bs;                      \
            if (end < hi) prefetch_block(vc + (size_t)bt[b + 1] * block, block * sizeof(T));                      \
            const T *vp = vc + (size_t)bt[b] * block + (size_t)off * tok;                                         \
            for (; p < end; ++p, vp += tok) {                                                                     \
                const float *w = sc + (size_t)(p - lo) * hq;                                                      \
                for (int h = 0; h < hq; ++h) {                                                                    \
                    const T *vh = vp + (size_t)(h / g) * D;                                                       \
                    float *a = acc + (size_t)h * D;                                                               \
                    const float x = w[h];                                                                         \
                    _Pragma("omp simd") for (int c = 0; c < D; ++c) a[c] += x * LOAD(vh[c]);                      \
                }                                                                                                 \
            }                                                                                                     \
        }                                                                                                         \
        normalize_heads(acc, sum, hq, D);                                                                         \
    }

DEFINE_QK(qk_bf16, uint16_t, LOAD_BF16)
DEFINE_QK(qk_f16, _Float16, LOAD_F16)
DEFINE_ROW(row_f32, float, LOAD_F32, qk_f32)
DEFINE_ROW(row_bf16, uint16_t, LOAD_BF16, qk_bf16)
DEFINE_ROW(row_f16, _Float16, LOAD_F16, qk_f16)

/* The row for a runtime head dim, with the common head dims as compile-time constants. */
#define DISPATCH_D(ROW, T)                                                                                        \
    static void ROW##_any(const float *q, float *acc, const T *kc, const T *vc, const int32_t *bt, int lo,       \
                          int hi, int hq, int hkv, int D, int bs, float *sc) {                                    \
        switch (D) {                                                                                              \
        case 32: ROW(q, acc, kc, vc, bt, lo, hi, hq, hkv, 32, bs, sc); break;                                     \
        case 64: ROW(q, acc, kc, vc, bt, lo, hi, hq, hkv, 64, bs, sc); break;                                     \
        case 128: ROW(q, acc, kc, vc, bt, lo, hi, hq, hkv, 128, bs, sc); break;                                   \
        default: ROW(q, acc, kc, vc, bt, lo, hi, hq, hkv, D, bs, sc);                                             \
        }                                                                                                         \
    }
DISPATCH_D(row_f32, float)
DISPATCH_D(row_bf16, uint16_t)
DISPATCH_D(row_f16, _Float16)

#include "cpu_attention_avx512.h" /* row_f32_x16 on AVX-512 machines */

struct attn_ctx {
    const void *q, *k_cache, *v_cache;
    void *out;
    int64_t q_row_stride, bt_stride;
    const int32_t *block_tables, *q_start, *q_len, *kv_lens, *item;
    int32_t rows, hq, hkv, d, bs, window, dtype, max_keys;
    float scale;
    _Atomic int failed;
};

/* A thread's buffer of at least `floats`, grown as needed and kept between calls (buf, cap: its thread-locals). */
static float *grown(float **buf, size_t *cap, size_t floats) { /* NULL when out of memory */
    if (floats > *cap) {
        free(*buf);
        *buf = malloc(sizeof(float) * floats);
        *cap = *buf ? floats : 0;
    }
    return *buf;
}
/* Scratch of the calling thread (scores, scaled q, accumulator; a tile's q, scores and output). */
static __thread float *scratch_buf = NULL;
static __thread size_t scratch_cap = 0;
static float *scratch(size_t floats) { return grown(&scratch_buf, &scratch_cap, floats); }

#define ROWS_PER_CHUNK 2

/* The first key a query at position pos sees: pos - window + 1 with a window (window > 0), else 0. */
static inline int window_start(int pos, int window) {
    return window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
}

#include "cpu_attention_gemm.h" /* long float32 prompt chunks as tiles of matrix products */

static void attn_chunk(void *p, int64_t c) {
    struct attn_ctx *a = p;
    const int32_t hq = a->hq, d = a->d;
    const size_t hd = (size_t)hq * d;
    float *buf = scratch((size_t)hq * a->max_keys + 2 * hd);
    if (!buf) {
        a->failed = 1;
        return;
    }
    float *sc = buf, *qf = buf + (size_t)hq * a->max_keys, *acc = qf + hd;
    const int end = (int)(c + 1) * ROWS_PER_CHUNK < a->rows ? (int)(c + 1) * ROWS_PER_CHUNK : a->rows;
    for (int i = (int)c * ROWS_PER_CHUNK; i < end; ++i) {
        const int s = a->item[2 * i], j = a->item[2 * i + 1], r = a->q_start[s] + j;
        const int pos = a->kv_lens[s] - a->q_len[s] + j, window = a->window;
        const int lo = window_start(pos, window), hi = pos + 1;
        const int32_t *bt = a->block_tables + (size_t)s * a->bt_stride;
        const float scale = a->scale;
        if (a->dtype == DT_F32) {
            const float *qr = (const float *)a->q + (size_t)r * a->q_row_stride;
            for (size_t e = 0; e < hd; ++e) qf[e] = qr[e] * scale;
#ifdef STRATA_ROW_F32_X16
            if (d % 16 == 0)
                row_f32_x16_any(qf, acc, a->k_cache, a->v_cache, bt, lo, hi, hq, a->hkv, d, a->bs, sc);
            else
#endif
                row_f32_any(qf, acc, a->k_cache, a->v_cache, bt, lo, hi, hq, a->hkv, d, a->bs, sc);
            memcpy((float *)a->out + (size_t)r * hd, acc, sizeof(float) * hd);
        } else if (a->dtype == DT_BF16) {
            const uint16_t *qr = (const uint16_t *)a->q + (size_t)r * a->q_row_stride;
            for (size_t e = 0; e < hd; ++e) qf[e] = bf16_to_f32(qr[e]) * scale;
            row_bf16_any(qf, acc, a->k_cache, a->v_cache, bt, lo, hi, hq, a->hkv, d, a->bs, sc);
            uint16_t *o = (uint16_t *)a->out + (size_t)r * hd;
            for (size_t e = 0; e < hd; ++e) o[e] = f32_to_bf16(acc[e]);
        } else {
            const _Float16 *qr = (const _Float16 *)a->q + (size_t)r * a->q_row_stride;
            for (size_t e = 0; e < hd; ++e) qf[e] = (float)qr[e] * scale;
            row_f16_any(qf, acc, a->k_cache, a->v_cache, bt, lo, hi, hq, a->hkv, d, a->bs, sc);
            _Float16 *o = (_Float16 *)a->out + (size_t)r * hd;
            for (size_t e = 0; e < hd; ++e) o[e] = (_Float16)acc[e];
        }
    }
}

/* Attention of the query rows of num_seqs sequences. Sequence s owns the q_len[s] rows starting at q_start[s]
 * (its last positions) and kv_lens[s] keys including them; its block table is row s of block_tables.
 * q: row r at q + r * q_row_stride (element type = dtype), heads contiguous inside a row;
 * out: contiguous [rows, hq * d], only the rows of the sequences are written.
 * Returns 0, or -1 for an unknown dtype, -2 when hkv does not divide hq (or hq > MAX_HQ), -3 when out of
 * memory. */
int strata_paged_attention(const void *q, int64_t q_row_stride, void *out, const void *k_cache,
                           const void *v_cache, const int32_t *block_tables, int64_t bt_stride,
                           const int32_t *q_start, const int32_t *q_len, const int32_t *kv_lens, int32_t num_seqs,
                           int32_t hq, int32_t hkv, int32_t d, int32_t bs, float scale, int32_t window,
                           int32_t dtype) {
    if (dtype < DT_F32 || dtype > DT_F16) return -1;
    if (hkv <= 0 || hq % hkv != 0 || hq > MAX_HQ) return -2;
    int rows = 0, max_keys = 1;
    for (int s = 0; s < num_seqs; ++s) {
        rows += q_len[s];
        max_keys = kv_lens[s] > max_keys ? kv_lens[s] : max_keys;
    }
    if (rows <= 0) return 0;
    if (window > 0 && window < max_keys) max_keys = window;
    /* (sequence, query index) of each row taken alone; the long float32 prompt chunks go to the tiles instead */
    int32_t *item = malloc(sizeof(int32_t) * 2 * (size_t)rows), *tiled = malloc(sizeof(int32_t) * (size_t)num_seqs);
    if (!item || !tiled) {
        free(item);
        free(tiled);
        return -3;
    }
    int n_items = 0, n_tiled = 0;
    for (int s = 0; s < num_seqs; ++s) {
        if (dtype == DT_F32 && attn_sgemm && q_len[s] >= GEMM_MIN_ROWS) {
            tiled[n_tiled++] = s;
            continue;
        }
        for (int j = 0; j < q_len[s]; ++j, ++n_items) {
            item[2 * n_items] = s;
            item[2 * n_items + 1] = j;
        }
    }
    struct attn_ctx a = {q, k_cache, v_cache, out, q_row_stride, bt_stride, block_tables, q_start, q_len, kv_lens,
                         item, n_items, hq, hkv, d, bs, window, dtype, max_keys, scale, 0};
    if (n_items) par_run(attn_chunk, &a, (n_items + ROWS_PER_CHUNK - 1) / ROWS_PER_CHUNK);
    int rc = a.failed ? -3 : 0;
    if (rc == 0 && n_tiled) rc = gemm_attention(&a, tiled, n_tiled);
    free(item);
    free(tiled);
    return rc;
}
