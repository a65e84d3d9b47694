/* The elementwise parts of a decoder layer on the CPU, float32, each in one pass over its rows.
 *
 * Why: at 64 rows a step of the tiny models a CPU serves runs ~40 PyTorch ops per layer besides the matmuls and
 * attention. Each costs 20-100 us in place (dispatch, composite ops, cold caches after a GEMM) whatever its size,
 * and runs on one thread while torch's other OpenMP worker falls asleep and must be woken for the next matmul.
 * Here each group is one call, shared among the same OpenMP threads as torch (libgomp.so.1, one pool).
 *
 * The arithmetic follows PyTorch's eager ops and transformers' order of operations, and the file is built with
 * -ffp-contract=off so that a * b - c * d is rounded as PyTorch rounds it (no fused multiply-add):
 *   add + RMSNorm: x += residual (in place), out = (x * (1 / sqrt(mean(x^2) + eps))) * w;
 *   rotary (neox halves): o1 = x1 * cos - x2 * sin, o2 = x2 * cos + x1 * sin, with Qwen3's per-head RMSNorm of
 *   q and k first when given; then k and v are copied into the paged cache rows of slot_mapping;
 *   SiLU-and-mul: out = g / (1 + exp(-g)) * u.
 * Sums of squares run in float lanes, so they may differ from PyTorch's reduction in the last bit.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#include "cpu_math.h"

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

/* rows of h values at x + r * x_stride: with residual (contiguous [rows, h]) x += residual first, in place;
 * out (contiguous [rows, h]) = RMSNorm(x) * w. */
void strata_add_rms_norm(float *x, int64_t x_stride, const float *residual, const float *w, float *out,
                         int64_t rows, int64_t h, float eps) {
#pragma omp parallel for schedule(static) if (rows * h >= PAR_MIN)
    for (int64_t r = 0; r < rows; ++r) {
        float *xr = x + r * x_stride, *o = out + r * h;
        if (residual) {
            const float *rr = residual + r * h;
            _Pragma("omp simd") for (int64_t i = 0; i < h; ++i) xr[i] = xr[i] + rr[i];
        }
        const float rs = rstd_of(xr, h, eps);
        _Pragma("omp simd") for (int64_t i = 0; i < h; ++i) o[i] = (xr[i] * rs) * w[i];
    }
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

/* Token t's q (hq heads), k and v (hkv heads each) of head dim d are consecutive in row t of qkv (row stride
 * row_stride). q and k are rotated in place for position positions[t] (cos_sin: [max_positions, d], cos half then
 * sin half), after their per-head RMSNorm when q_norm / k_norm are given; then, when k_cache is given, k and v
 * go to row slot_mapping[t] of the caches ([slots, hkv, d] each; a negative slot is skipped). */
void strata_rotary_store(float *qkv, int64_t row_stride, int64_t tokens, int32_t hq, int32_t hkv, int32_t d,
                         const int64_t *positions, const float *cos_sin, const float *q_norm, const float *k_norm,
                         float eps, float *k_cache, float *v_cache, const int64_t *slot_mapping) {
    const int64_t kv = (int64_t)hkv * d;
#pragma omp parallel for schedule(static) if (tokens * (hq + 2 * hkv) * d >= PAR_MIN)
    for (int64_t t = 0; t < tokens; ++t) {
        float *q = qkv + t * row_stride, *k = q + (int64_t)hq * d, *v = k + kv;
        const float *cs = cos_sin + positions[t] * d;
        for (int h = 0; h < hq; ++h) {
            if (q_norm) norm_head(q + (int64_t)h * d, q_norm, d, eps);
            rotate_head(q + (int64_t)h * d, cs, d);
        }
        for (int h = 0; h < hkv; ++h) {
            if (k_norm) norm_head(k + (int64_t)h * d, k_norm, d, eps);
            rotate_head(k + (int64_t)h * d, cs, d);
        }
        if (k_cache && slot_mapping[t] >= 0) {
            memcpy(k_cache + slot_mapping[t] * kv, k, sizeof(float) * kv);
            memcpy(v_cache + slot_mapping[t] * kv, v, sizeof(float) * kv);
        }
    }
}

/* x: rows of [gate (n) | up (n)] at x + r * x_stride; out (contiguous [rows, n]) = silu(gate) * up. */
void strata_silu_mul(const float *x, int64_t x_stride, float *out, int64_t rows, int64_t n) {
#pragma omp parallel for schedule(static) if (rows * n >= PAR_MIN)
    for (int64_t r = 0; r < rows; ++r) {
        const float *restrict g = x + r * x_stride, *restrict u = g + n;
        float *restrict o = out + r * n;
        const int m = (int)n;
        _Pragma("omp simd") for (int i = 0; i < m; ++i) {
            /* g / (1 + exp(-g)) from exp of a non-positive argument only: e = exp(-|g|) */
            const float a = g[i], e = exp_nonpos(-fabsf(a));
            o[i] = (a >= 0.0f ? a / (1.0f + e) : (a * e) / (1.0f + e)) * u[i];
        }
    }
}
