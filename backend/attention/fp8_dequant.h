/* KV blocks stored narrower than float32 read as float32, for the compiled attention routines: 8-bit
 * (fp8 e4m3fn / e5m2, both routines) and bfloat16 (the decode routine). */
#ifndef PAGEDLLM_FP8_DEQUANT_H
#define PAGEDLLM_FP8_DEQUANT_H

#include <stdint.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

/* A narrow cache: one KV head's blocks, its format and its scale (bf16: two bytes an element, no scale). */
enum { FP8_E4M3FN = 0, FP8_E5M2 = 1, KV_BF16 = 2 };
typedef struct {
    const uint8_t* head;
    int format;
    float scale;
} fp8_head;

/* n bytes of an 8-bit block as floats times scale, in scratch, through float16, which both formats widen
 * into exactly: e5m2 is float16's upper byte, and e4m3's bits shifted into float16's fields stand for the
 * value times 2^-8 (the exponent biases differ by 8), subnormals included; the 2^8 goes into the scale.
 * With AVX-512 sixteen bytes at a time become float16 and then float32 in one instruction (vcvtph2ps);
 * the rest, and other CPUs, take the same bit arithmetic to float32 directly. NaN encodings are never
 * written (writes saturate), so they are not special-cased. */
static inline uint32_t fp8_to_float_bits(uint32_t b, int format) {
    /* exponent and mantissa fields of each format, rebiased for float32 (bias 127 vs 7 or 15) */
    const uint32_t sign = (b & 0x80u) << 24;
    const uint32_t mantissa_bits = format == FP8_E4M3FN ? 3u : 2u;
    const uint32_t exponent = (b & 0x7Fu) >> mantissa_bits, mantissa = b & ((1u << mantissa_bits) - 1u);
    const uint32_t normal = sign | ((exponent + (format == FP8_E4M3FN ? 120u : 112u)) << 23)
                            | (mantissa << (23 - mantissa_bits));
    /* a subnormal is mantissa x the smallest step, 2^-9 or 2^-16: built as float32 bits of an exact product */
    float subnormal_value = (float)mantissa * (format == FP8_E4M3FN ? 0x1p-9f : 0x1p-16f);
    uint32_t subnormal;
    __builtin_memcpy(&subnormal, &subnormal_value, sizeof subnormal);
    const uint32_t is_normal = 0u - (uint32_t)(exponent != 0); /* all ones or zero: a select without a branch */
    return (normal & is_normal) | ((sign | subnormal) & ~is_normal);
}

/* Bytes an element of a cache of this format takes. */
static inline int64_t kv_element_bytes(int format) { return format == KV_BF16 ? 2 : 1; }

/* n bf16 values as float32, exactly: a bf16 is the upper half of a float32. */
static inline const float* widen_bf16_block(const uint16_t* restrict block, int64_t n, float* restrict scratch) {
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) {
        const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(block + i)));
        _mm512_storeu_ps(scratch + i, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
    }
#endif
    for (; i < n; ++i) {
        const uint32_t bits = (uint32_t)block[i] << 16;
        __builtin_memcpy(scratch + i, &bits, sizeof bits);
    }
    return scratch;
}

/* x rounded to the nearest bfloat16 (ties to even), kept as a float32; x finite. */
static inline float round_to_bf16(float x) {
    uint32_t bits;
    __builtin_memcpy(&bits, &x, sizeof bits);
    bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
    __builtin_memcpy(&x, &bits, sizeof x);
    return x;
}

/* n elements of a narrow block (a cache of fp8.format) as float32 in scratch. */
static inline const float* dequantize_block(const uint8_t* restrict block, int64_t n, fp8_head fp8,
                                            float* restrict scratch) {
    if (fp8.format == KV_BF16) return widen_bf16_block((const uint16_t*)block, n, scratch);
    int64_t i = 0;
#ifdef __AVX512F__
    const int e4m3 = fp8.format == FP8_E4M3FN;
    const __m512 scale16 = _mm512_set1_ps(e4m3 ? fp8.scale * 256.0f : fp8.scale);
    for (; i + 16 <= n; i += 16) {
        const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(block + i)));
        const __m256i half = e4m3 ? _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(bytes, _mm256_set1_epi16(0x80)), 8),
                                                    _mm256_slli_epi16(_mm256_and_si256(bytes, _mm256_set1_epi16(0x7F)), 7))
                                  : _mm256_slli_epi16(bytes, 8);
        _mm512_storeu_ps(scratch + i, _mm512_mul_ps(_mm512_cvtph_ps(half), scale16));
    }
#endif
    for (; i < n; ++i) {
        const uint32_t bits = fp8_to_float_bits(block[i], fp8.format);
        float value;
        __builtin_memcpy(&value, &bits, sizeof value);
        scratch[i] = value * fp8.scale;
    }
    return scratch;
}

#endif
