/* The arithmetic of torch's bf16 SDPA softmax (ATen's CPU flash attention, torch 2.13) on 16 lanes, for
 * paged_prefill_bf16.c, which needs its probabilities bit for bit: bf16 is judged against transformers' bf16 forward,
 * which runs that SDPA (tests/test_bf16_accuracy.py), and on its tiny random checkpoints the top-1 logits nearly
 * tie, so probabilities that round to other bf16 values flipped 1-5% of the prefill positions where these flip
 * none. Written from what that code computes (RESULTS.md, "bf16 prefill attention on AMX tiles"); a torch that
 * computes otherwise shows as differing outputs in tests/test_native_prefill_bf16.py, not as wrong attention.
 * Needs AVX-512F. */
#ifndef PAGEDLLM_SDPA_SOFTMAX_BF16_H
#define PAGEDLLM_SDPA_SOFTMAX_BF16_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

/* exp(x) on 16 lanes as SDPA computes its bf16-stored probabilities (Vectorized::fexp_u20): 2^(x log2 e), the
 * fraction's correction a cubic in the fraction, assembled directly as float bits by a truncating conversion. */
static inline __m512 exp16(__m512 x) {
    const __mmask16 underflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3365478515625f), _CMP_LT_OS);
    const __mmask16 overflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(88.72283935546875f), _CMP_GT_OS);
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269502162933349609375f));
    const __m512 f = _mm512_sub_ps(t, _mm512_floor_ps(t));
    __m512 c = _mm512_fmadd_ps(f, _mm512_set1_ps(-0.079204240219773236f), _mm512_set1_ps(-0.22433836478672356f));
    c = _mm512_fmadd_ps(f, c, _mm512_set1_ps(0.30354260500649682f));
    c = _mm512_fmadd_ps(f, c, _mm512_set1_ps(0.00010703434948458272f));
    const __m512 bits = _mm512_fmadd_ps(_mm512_set1_ps(8388608.0f), _mm512_sub_ps(t, c),
                                        _mm512_set1_ps(8388608.0f * 127.0f));
    __m512i result = _mm512_cvttps_epi32(bits);
    result = _mm512_mask_mov_epi32(result, underflow, _mm512_setzero_si512());
    result = _mm512_mask_mov_epi32(result, overflow, _mm512_set1_epi32(0x7f800000));
    return _mm512_castsi512_ps(result);
}

/* expf on 16 lanes: torch's SDPA takes the library exp for the keys past the last whole 16 of a key block. */
static inline __m512 expf16(__m512 x) {
    float lanes[16];
    _mm512_storeu_ps(lanes, x);
    for (int i = 0; i < 16; ++i) lanes[i] = expf(lanes[i]);
    return _mm512_loadu_ps(lanes);
}

/* The probabilities' row sums, added as torch's SDPA adds them (its order, so that the same probabilities sum
 * to the same float): per row, 32 running sums of the keys congruent mod 32 up to the block's last whole 16, the
 * pairs j and j + 16 added, those 16 folded by halves (8, 4, 2, 1 apart), then the library-exp keys one by one.
 * partial[j * stride] holds running sum j for 16 rows, tail[t * stride] library-exp key t's probabilities. */
static inline __m512 torch_order_sum(const __m512* partial, const __m512* tail, int64_t tail_keys, int64_t stride) {
    __m512 v[16];
    for (int j = 0; j < 16; ++j) v[j] = _mm512_add_ps(partial[j * stride], partial[(j + 16) * stride]);
    for (int half = 8; half >= 1; half /= 2)
        for (int j = 0; j < half; ++j) v[j] = _mm512_add_ps(v[j], v[j + half]);
    __m512 sum = v[0];
    for (int64_t t = 0; t < tail_keys; ++t) sum = _mm512_add_ps(sum, tail[t * stride]);
    return sum;
}

#endif
