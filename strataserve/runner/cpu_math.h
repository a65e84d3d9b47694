/* Small float helpers shared by the CPU kernels (cpu_kernel.py hashes this header into each library's name). */
#ifndef STRATA_CPU_MATH_H
#define STRATA_CPU_MATH_H
#include <stdint.h>
#include <string.h>

/* exp(x) for x <= 0 (scores minus their max): x = n ln2 + r, |r| <= ln2 / 2, exp(r) by its Taylor series to
 * r^7 (truncation error < 1e-8 relative), 2^n built in the exponent bits. Below -87 the result is 0. */
static inline float exp_nonpos(float x) {
    const float log2e = 1.44269504088896341f, ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
    x = x < -87.0f ? -87.0f : x;
    float n = __builtin_floorf(x * log2e + 0.5f);
    float r = x - n * ln2_hi - n * ln2_lo;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &e, 4);
    return p * scale;
}

#endif
