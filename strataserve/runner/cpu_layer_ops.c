/* The elementwise parts of a decoder layer on the CPU, float32, each in one pass over its rows.
 *
 * Why: at 64 rows a step of the tiny models a CPU serves runs ~40 PyTorch ops per layer besides the matmuls and
 * attention. Each costs 20-100 us in place (dispatch, composite ops, cold caches after a GEMM) whatever its size,
 * and runs on one thread while torch's other OpenMP worker falls asleep and must be woken for the next matmul.
 * Here each group is one call, its rows shared among the engine's threads (cpu_par.h: the work-sharing pool, or
 * OpenMP without it).
 *
 * The arithmetic follows PyTorch's eager ops and transformers' order of operations, and the file is built with
 * -ffp-contract=off so that a * b - c * d is rounded as PyTorch rounds it (no fused multiply-add):
 *   add + RMSNorm: x += residual (in place), out = (x * (1 / sqrt(mean(x^2) + eps))) * w;
 *   rotary (neox halves): o1 = x1 * cos - x2 * sin, o2 = x2 * cos + x1 * sin, with Qwen3's per-head RMSNorm of
 *   q and k first when given; then k and v are copied into the paged cache rows of slot_mapping;
 *   SiLU-and-mul: out = g / (1 + exp(-g)) * u;
 * and the greedy token of each logits row: the first index of its largest value, NaN counting as largest (torch's
 * max / argmax rule), in 0.29-0.45 of torch.max(dim=-1)'s time at 64-256 rows of 4,096-151,936 entries.
 * Sums of squares run in float lanes, so they may differ from PyTorch's reduction in the last bit.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#include "cpu_math.h"
#include "cpu_par.h"

/* Below this many elements a call stays on the calling thread: a parallel region costs more than it saves. */
#define PAR_MIN 16384

static inline float rstd_of(const float *x, int64_t h, float eps) {
    float lanes[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= h; i += 16)
        _Pragma("omp simd") for (int l = 0; l < 16; ++l) lanes[l] += x[i + l] * x[i + l];
    float s = 0.0f;
    for (int l = 0; l < 16; ++l) s += lanes[l];
    for (; i < h; ++i) s += x[i] * x[i];
    return 1.0f / sqrtf(s / (float)h + eps);
}

struct norm_ctx {
    float *x;
    const float *residual, *w;
    float *out;
    int64_t x_stride, rows, h, n;
    float eps;
};

static void norm_chunk(void *p, int64_t c) {
    const struct norm_ctx *a = p;
    for (int64_t r = PAR_LO(c, a->rows, a->n); r < PAR_LO(c + 1, a->rows, a->n); ++r) {
        const int64_t h = a->h;
        float *xr = a->x + r * a->x_stride, *o = a->out + r * h;
        const float *w = a->w;
        if (a->residual) {
            const float *rr = a->residual + r * h;
            _Pragma("omp simd") for (int64_t i = 0; i < h; ++i) xr[i] = xr[i] + rr[i];
        }
        const float rs = rstd_of(xr, h, a->eps);
        _Pragma("omp simd") for (int64_t i = 0; i < h; ++i) o[i] = (xr[i] * rs) * w[i];
    }
}

/* rows of h values at x + r * x_stride: with residual (contiguous [rows, h]) x += residual first, in place;
 * out (contiguous [rows, h]) = RMSNorm(x) * w. */
void strata_add_rms_norm(float *x, int64_t x_stride, const float *residual, const float *w, float *out,
                         int64_t rows, int64_t h, float eps) {
    struct norm_ctx a = {x, residual, w, out, x_stride, rows, h, par_chunks(rows, h, PAR_MIN), eps};
    par_run(norm_chunk, &a, a.n);
}

static inline void norm_head(float *x, const float *w, int d, float eps) {
    const float rs = rstd_of(x, d, eps);
    _Pragma("omp simd") for (int i = 0; i < d; ++i) x[i] = (x[i] * rs) * w[i];
}

static inline void rotate_head(float *x, const float *cs, int d) {
    const int half = d / 2;
    const float *c = cs, *s = cs + half;
    _Pragma("omp simd") for (int i = 0; i < half; ++i) {
        const float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * c[i] - x2 * s[i];
        x[i + half] = x2 * c[i] + x1 * s[i];
    }
}

struct rot_ctx {
    float *qkv;
    int64_t row_stride, tokens, n;
    int32_t hq, hkv, d;
    const int64_t *positions;
    const float *cos_sin, *q_norm, *k_norm;
    float eps;
    float *k_cache, *v_cache;
    const int64_t *slot_mapping;
};

static void rot_chunk(void *p, int64_t c) {
    const struct rot_ctx *a = p;
    const int32_t hq = a->hq, hkv = a->hkv, d = a->d;
    const int64_t kv = (int64_t)hkv * d;
    for (int64_t t = PAR_LO(c, a->tokens, a->n); t < PAR_LO(c + 1, a->tokens, a->n); ++t) {
        float *q = a->qkv + t * a->row_stride, *k = q + (int64_t)hq * d, *v = k + kv;
        const float *cs = a->cos_sin + a->positions[t] * d;
        for (int h = 0; h < hq; ++h) {
            if (a->q_norm) norm_head(q + (int64_t)h * d, a->q_norm, d, a->eps);
            rotate_head(q + (int64_t)h * d, cs, d);
        }
        for (int h = 0; h < hkv; ++h) {
            if (a->k_norm) norm_head(k + (int64_t)h * d, a->k_norm, d, a->eps);
            rotate_head(k + (int64_t)h * d, cs, d);
        }
        if (a->k_cache && a->slot_mapping[t] >= 0) {
            memcpy(a->k_cache + a->slot_mapping[t] * kv, k, sizeof(float) * kv);
            memcpy(a->v_cache + a->slot_mapping[t] * kv, v, sizeof(float) * kv);
        }
    }
}

/* Token t's q (hq heads), k and v (hkv heads each) of head dim d are consecutive in row t of qkv (row stride
 * row_stride). q and k are rotated in place for position positions[t] (cos_sin: [max_positions, d], cos half then
 * sin half), after their per-head RMSNorm when q_norm / k_norm are given; then, when k_cache is given, k and v
 * go to row slot_mapping[t] of the caches ([slots, hkv, d] each; a negative slot is skipped). */
void strata_rotary_store(float *qkv, int64_t row_stride, int64_t tokens, int32_t hq, int32_t hkv, int32_t d,
                         const int64_t *positions, const float *cos_sin, const float *q_norm, const float *k_norm,
                         float eps, float *k_cache, float *v_cache, const int64_t *slot_mapping) {
    struct rot_ctx a = {qkv, row_stride, tokens, par_chunks(tokens, (int64_t)(hq + 2 * hkv) * d, PAR_MIN), hq, hkv,
                        d, positions, cos_sin, q_norm, k_norm, eps, k_cache, v_cache, slot_mapping};
    par_run(rot_chunk, &a, a.n);
}

struct silu_ctx {
    const float *x;
    float *out;
    int64_t x_stride, rows, cols, n;
};

static void silu_chunk(void *p, int64_t c) {
    const struct silu_ctx *a = p;
    for (int64_t r = PAR_LO(c, a->rows, a->n); r < PAR_LO(c + 1, a->rows, a->n); ++r) {
        const float *restrict g = a->x + r * a->x_stride, *restrict u = g + a->cols;
        float *restrict o = a->out + r * a->cols;
        const int m = (int)a->cols;
        _Pragma("omp simd") for (int i = 0; i < m; ++i) {
            /* g / (1 + exp(-g)) from exp of a non-positive argument only: e = exp(-|g|) */
            const float v = g[i], e = exp_nonpos(-fabsf(v));
            o[i] = (v >= 0.0f ? v / (1.0f + e) : (v * e) / (1.0f + e)) * u[i];
        }
    }
}

/* x: rows of [gate (n) | up (n)] at x + r * x_stride; out (contiguous [rows, n]) = silu(gate) * up. */
void strata_silu_mul(const float *x, int64_t x_stride, float *out, int64_t rows, int64_t n) {
    struct silu_ctx a = {x, out, x_stride, rows, n, par_chunks(rows, n, PAR_MIN)};
    par_run(silu_chunk, &a, a.n);
}

struct argmax_ctx {
    const float *x;
    int64_t *out;
    int64_t x_stride, rows, cols, n;
};

/* Two vectorised passes: the largest value (and whether any NaN), then the first index holding it. */
static int64_t argmax_row(const float *x, int64_t n) {
    float best = x[0];
    int nan = 0;
    _Pragma("omp simd reduction(|:nan) reduction(max:best)") for (int64_t j = 0; j < n; ++j) {
        nan |= x[j] != x[j];
        best = x[j] > best ? x[j] : best;
    }
    if (nan) {
        for (int64_t j = 0; j < n; ++j)
            if (x[j] != x[j]) return j;
    }
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) { /* a vectorised any-equal per 64 entries, then the exact place */
        int hit = 0;
        _Pragma("omp simd reduction(|:hit)") for (int k = 0; k < 64; ++k) hit |= x[i + k] == best;
        if (hit) break;
    }
    for (; i < n; ++i)
        if (x[i] == best) return i;
    return 0; /* not reached: best is one of the values */
}

static void argmax_chunk(void *p, int64_t c) {
    const struct argmax_ctx *a = p;
    for (int64_t r = PAR_LO(c, a->rows, a->n); r < PAR_LO(c + 1, a->rows, a->n); ++r)
        a->out[r] = argmax_row(a->x + r * a->x_stride, a->cols);
}

/* out[r] = the greedy token of row r of x (rows at x + r * x_stride, cols >= 1 entries each). */
void strata_row_argmax(const float *x, int64_t x_stride, int64_t *out, int64_t rows, int64_t cols) {
    struct argmax_ctx a = {x, out, x_stride, rows, cols, par_chunks(rows, cols, PAR_MIN)};
    par_run(argmax_chunk, &a, a.n);
}
