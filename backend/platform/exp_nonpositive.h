/* A vectorizable exp for the compiled routines, which avoid -ffast-math and so cannot count on libmvec. */
#ifndef PAGEDLLM_EXP_NONPOSITIVE_H
#define PAGEDLLM_EXP_NONPOSITIVE_H

#include <math.h>
#include <stdint.h>

/* exp(x) for x <= 0, within 2 ulp: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a degree-6 polynomial. */
#pragma omp declare simd
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = nearbyintf(x * 1.44269504f);
    float r = x - n * 0.693145752f - n * 1.42860677e-6f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { int32_t i; float f; } scale = { .i = ((int32_t)n + 127) << 23 };
    return p * scale.f;
}

#endif
