/* The float32 elementwise steps of a Llama-family layer, fused, for the CPU.
 *
 * Built on first use by pagedllm/models/cpu_fused_ops.py and called through ctypes. In torch
 * each of these is 3-8 separate ops, each a dispatch and a pass over memory; here each is one
 * call and one pass. Compiled with -ffp-contract=off, so that a product and a sum round as
 * torch's separate multiply and add do: the rotary below gives torch's bits exactly. The norm's
 * sum of squares and SiLU's exp are not bit-equal to torch's (another summation order, another
 * exp), a float32 rounding apart.
 */
#include <math.h>
#include <stdint.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "../platform/exp_nonpositive.h"

/* Work below this many elements runs on one thread: waking a team costs more than it saves. */
#define PARALLEL_MIN 65536

/* RMSNorm, as transformers computes it in float32: out = weight * (h * 1/sqrt(mean(h^2) + eps)).
 * With a residual, h = residual + x is written back to the residual first (the layer's skip
 * connection); without one, h = x. Every array is dense, [rows, width]. */
void pagedllm_rms_norm_f32(const float* x, float* residual, const float* weight, float* out, int64_t rows,
                           int64_t width, float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * width >= PARALLEL_MIN) schedule(static)
    for (int64_t row = 0; row < rows; ++row) {
        const float* h = x + row * width;
        if (residual) {
            float* skip = residual + row * width;
#pragma omp simd
            for (int64_t i = 0; i < width; ++i) skip[i] = skip[i] + h[i];
            h = skip;
        }
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < width; ++i) squares += h[i] * h[i];
        const float inverse = 1.0f / sqrtf(squares / (float)width + eps);
        float* o = out + row * width;
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) o[i] = weight[i] * (h[i] * inverse);
    }
}

/* Rotary embedding in place, rotate_half style: x = x * cos + rotate_half(x) * sin, where
 * rotate_half(x) = (-x2, x1) for the halves x1, x2. Each row holds `heads` heads of head_dim
 * one after another from its start (a fused qkv row's q heads, then its k heads); rows are
 * row_stride apart. cos and sin are [rows, head_dim], dense. */
void pagedllm_rotary_f32(float* x, int64_t row_stride, const float* cos, const float* sin, int64_t rows,
                         int64_t heads, int64_t head_dim, int threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(threads) if (rows * heads * head_dim >= PARALLEL_MIN) schedule(static)
    for (int64_t row = 0; row < rows; ++row) {
        const float* c = cos + row * head_dim;
        const float* s = sin + row * head_dim;
        for (int64_t head = 0; head < heads; ++head) {
            float* first = x + row * row_stride + head * head_dim;
            float* second = first + half;
#pragma omp simd
            for (int64_t i = 0; i < half; ++i) {
                const float x1 = first[i], x2 = second[i];
                first[i] = x1 * c[i] + (-x2) * s[i];
                second[i] = x2 * c[half + i] + x1 * s[half + i];
            }
        }
    }
}

/* out = silu(gate) * up for rows of [gate | up], each half `width` wide; out is [rows, width]. */
void pagedllm_silu_mul_f32(const float* gate_up, float* out, int64_t rows, int64_t width, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * width >= PARALLEL_MIN) schedule(static)
    for (int64_t row = 0; row < rows; ++row) {
        const float* gate = gate_up + row * 2 * width;
        const float* up = gate + width;
        float* o = out + row * width;
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) {
            const float g = gate[i];
            /* sigmoid(g) from exp(-|g|), which cannot overflow: e / (1 + e) below zero, 1 / (1 + e) above.
             * The numerator is chosen before the one division, not the quotient after two: vectorized,
             * a select between two quotients computes both, and the divider is this loop's bottleneck.
             * Each lane still divides the same two floats, so the result is the same bit for bit. */
            const float e = exp_nonpositive(g < 0.0f ? g : -g);
            const float sigmoid = (g < 0.0f ? e : 1.0f) / (1.0f + e);
            o[i] = (g * sigmoid) * up[i];
        }
    }
}

/* RMSNorm, the rotary and SiLU-and-multiply on bf16 tensors, rounding to bf16 wherever torch's bf16 ops
 * round (after every add and product), so that outputs equal transformers' bf16 arithmetic bit for bit:
 * each op computes in float32 and rounds once, to nearest even. The norm's float32 sum of squares must
 * also be added in torch's order (sum_of_squares_as_torch below): summed in another order it moved 1 in
 * 10^4 outputs by one bf16 step, and that flipped greedy tokens of the embedded default model. */
static inline float bf16_to_float(uint16_t b) {
    const uint32_t bits = (uint32_t)b << 16;
    float value;
    __builtin_memcpy(&value, &bits, sizeof value);
    return value;
}

static inline uint16_t float_to_bf16(float x) {
    uint32_t bits;
    __builtin_memcpy(&bits, &x, sizeof bits);
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16); /* round to nearest even; no NaNs here */
}

static inline float round_bf16(float x) { return bf16_to_float(float_to_bf16(x)); }

void pagedllm_rotary_bf16(uint16_t* x, int64_t row_stride, const uint16_t* cos, const uint16_t* sin, int64_t rows,
                          int64_t heads, int64_t head_dim, int threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(threads) if (rows * heads * head_dim >= PARALLEL_MIN) schedule(static)
    for (int64_t row = 0; row < rows; ++row) {
        const uint16_t* c = cos + row * head_dim;
        const uint16_t* s = sin + row * head_dim;
        for (int64_t head = 0; head < heads; ++head) {
            uint16_t* first = x + row * row_stride + head * head_dim;
            uint16_t* second = first + half;
#pragma omp simd
            for (int64_t i = 0; i < half; ++i) {
                const float x1 = bf16_to_float(first[i]), x2 = bf16_to_float(second[i]);
                first[i] = float_to_bf16(round_bf16(x1 * bf16_to_float(c[i])) + round_bf16(-x2 * bf16_to_float(s[i])));
                second[i] = float_to_bf16(round_bf16(x2 * bf16_to_float(c[half + i]))
                                          + round_bf16(x1 * bf16_to_float(s[half + i])));
            }
        }
    }
}

/* SiLU-and-multiply on bf16 rows: out = bf16(silu_of[gate] * up). A bf16 gate has only 2^16 values, so silu(gate)
 * rounded to bf16 comes from a table the caller computes with torch's own silu (cpu_fused_ops.py): a load where the
 * arithmetic would need an exp and a division per element. The product of two bf16 values is exact in float32, so
 * rounding it once gives torch's bf16 multiply. silu_of holds the 2^16 values as float32, indexed by the gate's bits;
 * it comes first so that the caller can bind it once and call both dtypes' routines alike. */
void pagedllm_silu_mul_bf16(const float* silu_of, const uint16_t* gate_up, uint16_t* out, int64_t rows,
                            int64_t width, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * width >= PARALLEL_MIN) schedule(static)
    for (int64_t row = 0; row < rows; ++row) {
        const uint16_t* gate = gate_up + row * 2 * width;
        const uint16_t* up = gate + width;
        uint16_t* o = out + row * width;
        int64_t i = 0;
#ifdef __AVX512F__
        /* By hand: gcc does not emit gathers for this loop (it loads the 16 lanes one by one, ~1.5x slower). The
         * rounding is float_to_bf16's, in integers: vcvtneps2bf16 would flush subnormal products to zero. */
        const __m512i half_minus_one = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
        for (; i + 16 <= width; i += 16) {
            const __m512i gates = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(gate + i)));
            const __m512 silu = _mm512_i32gather_ps(gates, silu_of, sizeof(float));
            const __m512 u = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(up + i))), 16));
            const __m512i bits = _mm512_castps_si512(_mm512_mul_ps(silu, u));
            const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), one);
            const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(half_minus_one, odd));
            _mm256_storeu_si256((__m256i*)(o + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
        }
#endif
        for (; i < width; ++i) o[i] = float_to_bf16(silu_of[gate[i]] * bf16_to_float(up[i]));
    }
}

/* torch's CPU sum of a contiguous float32 row, reproduced addition for addition (ATen's cascade sum,
 * SumKernel.cpp, as this torch runs it on x86: 8-lane vectors, four interleaved vector accumulators,
 * carried up levels of 16, the scalar tail first, then the lanes in order), over the squares of bf16
 * values. The Python side checks it against torch once before using it (cpu_fused_ops.py). */
#define SUM_LANES 8

static inline float square_of(const uint16_t* h, int64_t i) {
    const float value = bf16_to_float(h[i]);
    return value * value;
}

static float sum_of_squares_as_torch(const uint16_t* h, int64_t n) {
    const int64_t vectors = n / SUM_LANES, quads = vectors / 4;
    const int64_t ceil_log2 = quads <= 2 ? 1 : 64 - __builtin_clzll((uint64_t)(quads - 1));
    const int64_t power = ceil_log2 / 4 > 4 ? ceil_log2 / 4 : 4, step = (int64_t)1 << power, mask = step - 1;
    float acc[4][4][SUM_LANES] = {{{0.0f}}}; /* [level][accumulator][lane] */
    int64_t i = 0;
    while (i + step <= quads) {
        for (int64_t j = 0; j < step; ++j, ++i)
            for (int k = 0; k < 4; ++k)
                for (int lane = 0; lane < SUM_LANES; ++lane) acc[0][k][lane] += square_of(h, (4 * i + k) * SUM_LANES + lane);
        for (int level = 1; level < 4; ++level) {
            for (int k = 0; k < 4; ++k)
                for (int lane = 0; lane < SUM_LANES; ++lane) {
                    acc[level][k][lane] += acc[level - 1][k][lane];
                    acc[level - 1][k][lane] = 0.0f;
                }
            if (i & (mask << (level * power))) break;
        }
    }
    for (; i < quads; ++i)
        for (int k = 0; k < 4; ++k)
            for (int lane = 0; lane < SUM_LANES; ++lane) acc[0][k][lane] += square_of(h, (4 * i + k) * SUM_LANES + lane);
    for (int level = 1; level < 4; ++level)
        for (int k = 0; k < 4; ++k)
            for (int lane = 0; lane < SUM_LANES; ++lane) acc[0][k][lane] += acc[level][k][lane];
    for (int64_t v = quads * 4; v < vectors; ++v)
        for (int lane = 0; lane < SUM_LANES; ++lane) acc[0][0][lane] += square_of(h, v * SUM_LANES + lane);
    for (int k = 1; k < 4; ++k)
        for (int lane = 0; lane < SUM_LANES; ++lane) acc[0][0][lane] += acc[0][k][lane];
    float total = 0.0f;
    for (int64_t t = vectors * SUM_LANES; t < n; ++t) total += square_of(h, t);
    for (int lane = 0; lane < SUM_LANES; ++lane) total += acc[0][0][lane];
    return total;
}

/* RMSNorm as transformers computes it in a bf16 model: h = bf16(residual + x) written back to the residual
 * (or h = x without one), then in float32 variance = sum(h^2) / width and h * 1/sqrt(variance + eps),
 * rounded to bf16, times the bf16 weight, rounded again. Every array is dense, [rows, width]. */
void pagedllm_rms_norm_bf16(const uint16_t* x, uint16_t* residual, const uint16_t* weight, uint16_t* out,
                            int64_t rows, int64_t width, float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * width >= PARALLEL_MIN) schedule(static)
    for (int64_t row = 0; row < rows; ++row) {
        const uint16_t* h = x + row * width;
        if (residual) {
            uint16_t* skip = residual + row * width;
#pragma omp simd
            for (int64_t i = 0; i < width; ++i) skip[i] = float_to_bf16(bf16_to_float(skip[i]) + bf16_to_float(h[i]));
            h = skip;
        }
        const float variance = sum_of_squares_as_torch(h, width) / (float)width;
        const float inverse = 1.0f / sqrtf(variance + eps);
        uint16_t* o = out + row * width;
#pragma omp simd
        for (int64_t i = 0; i < width; ++i)
            o[i] = float_to_bf16(bf16_to_float(weight[i]) * round_bf16(bf16_to_float(h[i]) * inverse));
    }
}
