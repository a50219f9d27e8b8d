/* The routed experts of a mixture-of-experts block on the CPU, bfloat16, in one call per block.
 *
 * Built on first use by moe_bf16.py (cc -O3 -march=native) and called through ctypes; the plain-torch
 * reference (kernels/fused_moe_reference.py) is its oracle, and oneDNN-packed experts (moe_onednn.py) run
 * where this cannot: a CPU without avx512_bf16, or no compiler. Run through oneDNN, a step pays two small
 * GEMM calls per chosen expert plus torch's grouping, gather, SiLU, weighting and scatter around them; here
 * one call groups the (token, choice) pairs by expert (a stable counting sort), gathers each pair's input row
 * once, runs every expert's gate|up product with SiLU-and-multiply fused into it, and adds the down products,
 * weighted, into float32 sums per token in ascending expert order (the reference's order).
 *
 * Products run on AMX tiles where the process may use them (pagedllm_moe_bf16_kernels), else with
 * avx512_bf16's vdpbf16ps: both multiply bf16 pairs exactly and add in float32. The weights come packed once
 * (moe_bf16.py's pack_tiles) as AMX B tiles: for 16 output columns and 32 inputs, 16 rows of [16 columns x
 * 2 consecutive inputs], 1 KiB, the tiles of one 16-column block stored in input order, so a product streams
 * each block front to back. The same 64-byte tile row is one vdpbf16ps operand, so both kernels read one
 * packing. Products accumulate in float32 and round to bf16 twice: the activations (silu(gate) * up, as
 * vLLM's CPU experts do) and the block's output; the reference rounds after every op, so results agree
 * within bf16 rounding, not bit for bit (tests/test_moe_bf16.py states the tolerance).
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "../platform/amx_tiles.h"
#define HAVE_AMX 1
#endif
#include "moe_sort.h"

#define TILE_K 32      /* inputs per tile */
#define TILE_N 16      /* output columns per tile */
#define TILE_WORDS 512 /* bf16 values per tile */
#define ROWS 32        /* rows per product call: two AMX A tiles */
#define GATE_BLOCKS 8  /* 16-column blocks of activations per gate|up task */
#define DOWN_COLUMNS 256 /* output columns per down task (a multiple of 32) */

enum { KERNEL_VEC = 1, KERNEL_AMX = 2 };

static inline uint16_t float_to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16); /* round to nearest even; no NaNs here */
}

#if defined(__AVX512BF16__)
/* c[r][0..16) and c[r][16..32) = rows[r] . the two column blocks b0 and b1 (each `tiles` tiles), r < R; a
 * row of a is TILE_K * tiles bf16 wide, rows a_stride apart. Each tile row of b is 16 columns x one input pair,
 * so one broadcast pair of a row times it is one vdpbf16ps; R is constant once inlined, so the 2R accumulators
 * stay in registers. */
static inline __attribute__((always_inline)) void vec_rows(const int R, const uint16_t* a, int64_t a_stride,
                                                           const uint16_t* b0, const uint16_t* b1, int64_t tiles,
                                                           float (*c)[2 * TILE_N]) {
    __m512 acc0[8], acc1[8];
    for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
    for (int64_t t = 0; t < tiles; ++t) {
        for (int pair = 0; pair < TILE_K / 2; ++pair) {
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(b0 + t * TILE_WORDS + pair * 2 * TILE_N);
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512(b1 + t * TILE_WORDS + pair * 2 * TILE_N);
            for (int r = 0; r < R; ++r) {
                int32_t both;
                memcpy(&both, a + r * a_stride + t * TILE_K + 2 * pair, sizeof both);
                const __m512bh x = (__m512bh)_mm512_set1_epi32(both);
                acc0[r] = _mm512_dpbf16_ps(acc0[r], x, w0);
                acc1[r] = _mm512_dpbf16_ps(acc1[r], x, w1);
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        _mm512_storeu_ps(c[r], acc0[r]);
        _mm512_storeu_ps(c[r] + TILE_N, acc1[r]);
    }
}

/* vec_rows over m <= ROWS rows, eight at a time. */
static void vec_product(const uint16_t* a, int64_t a_stride, int m, const uint16_t* b0, const uint16_t* b1,
                        int64_t tiles, float (*c)[2 * TILE_N]) {
    for (int first = 0; first < m; first += 8) {
        const uint16_t* rows = a + first * a_stride;
        float(*sums)[2 * TILE_N] = c + first;
        switch (m - first < 8 ? m - first : 8) {
            case 1: vec_rows(1, rows, a_stride, b0, b1, tiles, sums); break;
            case 2: vec_rows(2, rows, a_stride, b0, b1, tiles, sums); break;
            case 3: vec_rows(3, rows, a_stride, b0, b1, tiles, sums); break;
            case 4: vec_rows(4, rows, a_stride, b0, b1, tiles, sums); break;
            case 5: vec_rows(5, rows, a_stride, b0, b1, tiles, sums); break;
            case 6: vec_rows(6, rows, a_stride, b0, b1, tiles, sums); break;
            case 7: vec_rows(7, rows, a_stride, b0, b1, tiles, sums); break;
            default: vec_rows(8, rows, a_stride, b0, b1, tiles, sums); break;
        }
    }
}
#endif

#if defined(HAVE_AMX)
/* Tiles (amx_tiles.h's layout): C tiles 0-3 (rows 0-15 and 16-31, times columns 0-15 and 16-31), A tiles 4-5,
 * B tiles 6-7. */

/* As vec_product, on tiles: rows past m are computed from whatever a holds there (finite, see the caller) and
 * not read back. The weight tiles load with the streaming hint (tileloaddt1): each is read once per row tile, so
 * keeping them out of L1 leaves it to the A tiles, which every column block rereads (interleaved A/B in one
 * process: 1.07-1.13x at 512-2,048 tokens, level at 16). */
static void amx_product(const uint16_t* a, int64_t a_stride, int m, const uint16_t* b0, const uint16_t* b1,
                        int64_t tiles, float (*c)[2 * TILE_N]) {
    const int64_t stride = a_stride * 2;
    _tile_zero(0);
    _tile_zero(1);
    if (m > 16) {
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t t = 0; t < tiles; ++t) {
            _tile_stream_loadd(6, b0 + t * TILE_WORDS, 64);
            _tile_stream_loadd(7, b1 + t * TILE_WORDS, 64);
            _tile_loadd(4, a + t * TILE_K, stride);
            _tile_loadd(5, a + 16 * a_stride + t * TILE_K, stride);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(2, c[16], 2 * TILE_N * 4);
        _tile_stored(3, c[16] + TILE_N, 2 * TILE_N * 4);
    } else {
        for (int64_t t = 0; t < tiles; ++t) {
            _tile_stream_loadd(6, b0 + t * TILE_WORDS, 64);
            _tile_stream_loadd(7, b1 + t * TILE_WORDS, 64);
            _tile_loadd(4, a + t * TILE_K, stride);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
        }
    }
    _tile_stored(0, c[0], 2 * TILE_N * 4);
    _tile_stored(1, c[0] + TILE_N, 2 * TILE_N * 4);
}
#endif

/* Which kernels this build and process can run: KERNEL_VEC where compiled with avx512_bf16, plus KERNEL_AMX
 * where compiled for AMX and Linux lets this process use the tile data (it must ask once: arch_prctl
 * ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA; asking again is harmless). 0: the caller must not call. */
int pagedllm_moe_bf16_kernels(void) {
    int kernels = 0;
#if defined(__AVX512BF16__)
    kernels |= KERNEL_VEC;
#if defined(HAVE_AMX)
    if (amx_tile_data_granted())
        kernels |= KERNEL_AMX;
#endif
#endif
    return kernels;
}

#if defined(__AVX512BF16__)
typedef void (*product_fn)(const uint16_t*, int64_t, int, const uint16_t*, const uint16_t*, int64_t,
                           float (*)[2 * TILE_N]);

/* exp(x) for 16 floats, x clamped to [-87, 88] (where exp is a normal float): x = n ln2 + r, |r| <= ln2 / 2,
 * exp(r) by the polynomial of platform/exp_nonpositive.h, times 2^n by vscalefps. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
    const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f),
                                      _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x));
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* act[r][i] = bf16(silu(gate[r][i]) * up[r][i]) for the 16 columns of one block; gate and up are the halves of
 * each row of c. One 16-float vector per row, in intrinsics: written as a loop, gcc vectorized it 8 floats wide,
 * and this epilogue then cost a prefill's gate|up phase a fifth of its time. sigmoid(g) = 1 / (1 + exp(-g)) stays finite
 * at both ends (exp16 clamps), so no branch on the sign is needed; the bf16 rounding is vcvtneps2bf16's (to
 * nearest even; it flushes subnormal activations to zero). */
static void silu_mul_rows(const float (*c)[2 * TILE_N], int m, uint16_t* act, int64_t act_stride) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int r = 0; r < m; ++r) {
        const __m512 g = _mm512_loadu_ps(c[r]);
        const __m512 sigmoid = _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        const __m256bh out = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_mul_ps(g, sigmoid), _mm512_loadu_ps(c[r] + TILE_N)));
        _mm256_storeu_si256((__m256i*)(act + r * act_stride), (__m256i)out);
    }
}
#endif

/*
 * out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, j], bf16 in and out.
 * hidden [T, hidden_size] with row stride hidden_stride; sizes padded: k_padded = hidden_size up to a multiple of
 * 32, inter_padded and hidden_padded to multiples of 32. gate_up: per expert, inter_padded / 16 column blocks,
 * each the gate's tiles over k_padded inputs then the up's; down: per expert, hidden_padded / 16 blocks of
 * tiles over inter_padded inputs (moe_bf16.py's pack). topk_weights float32 and topk_ids int64, both [T, top_k]
 * contiguous; out [T, hidden_size] contiguous, overwritten. Scratch: grouped [T * top_k + 32, k_padded] and
 * act [T * top_k + 32, inter_padded] bf16, sums [T, hidden_padded] float32, order [T * top_k] and
 * starts [E + 1] int64. kernel: KERNEL_VEC or KERNEL_AMX, one pagedllm_moe_bf16_kernels reported.
 * Returns 0; -1 (out untouched) when an expert id is outside [0, E); -2 when the kernel is not available.
 */
int pagedllm_moe_experts_bf16(const uint16_t* hidden, int64_t num_tokens, int64_t hidden_size, int64_t hidden_stride,
                              const uint16_t* gate_up, const uint16_t* down, int64_t num_experts,
                              int64_t inter_padded, int64_t hidden_padded, int64_t k_padded,
                              const float* topk_weights, const int64_t* topk_ids, int64_t top_k, uint16_t* out,
                              uint16_t* grouped, uint16_t* act, float* sums, int64_t* order, int64_t* starts,
                              int kernel, int threads) {
#if !defined(__AVX512BF16__)
    (void)hidden, (void)num_tokens, (void)hidden_size, (void)hidden_stride, (void)gate_up, (void)down;
    (void)num_experts, (void)inter_padded, (void)hidden_padded, (void)k_padded, (void)topk_weights;
    (void)topk_ids, (void)top_k, (void)out, (void)grouped, (void)act, (void)sums, (void)order, (void)starts;
    (void)kernel, (void)threads;
    return -2;
#else
    product_fn product = vec_product;
#if defined(HAVE_AMX)
    if (kernel == KERNEL_AMX) product = amx_product;
#endif
    if (kernel != KERNEL_VEC && product == vec_product) return -2;
    const int amx = product != vec_product;
    const int64_t choices = num_tokens * top_k;
    if (sort_choices_by_expert(topk_ids, choices, num_experts, order, starts) != 0) return -1;
    /* The rows past the last choice feed only product rows that are never read back, but they must be finite
     * (and the inputs' padding zero): a NaN times a zero weight would still be NaN. */
    memset(grouped + choices * k_padded, 0, (size_t)ROWS * k_padded * 2);
    memset(act + choices * inter_padded, 0, (size_t)ROWS * inter_padded * 2);
    const int64_t k_tiles = k_padded / TILE_K, inter_tiles = inter_padded / TILE_K;
    const int64_t act_blocks = inter_padded / TILE_N, gate_tasks = (act_blocks + GATE_BLOCKS - 1) / GATE_BLOCKS;
    const int64_t down_tasks = (hidden_padded + DOWN_COLUMNS - 1) / DOWN_COLUMNS;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#if defined(HAVE_AMX)
        if (amx) amx_configure_tiles();
#endif
        /* Each choice's input row, once, in grouped order, so an expert's rows are one dense A matrix. */
#pragma omp for schedule(static)
        for (int64_t p = 0; p < choices; ++p) {
            uint16_t* row = grouped + p * k_padded;
            memcpy(row, hidden + (order[p] / top_k) * hidden_stride, (size_t)hidden_size * 2);
            memset(row + hidden_size, 0, (size_t)(k_padded - hidden_size) * 2);
        }
        /* Gate|up: a task is GATE_BLOCKS 16-column blocks of one expert's activations, for all of its rows, a
         * 32-row tile at a time: the tile's inputs stay in cache across the blocks, and the blocks' weights
         * (GATE_BLOCKS x 64 KiB at hidden 1024) across the tiles. Each block's gate and up tiles are the two B
         * operands, so SiLU-and-multiply runs on the product in place. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_experts * gate_tasks; ++task) {
            const int64_t e = task / gate_tasks, first_block = (task % gate_tasks) * GATE_BLOCKS;
            const int64_t stop_block = first_block + GATE_BLOCKS < act_blocks ? first_block + GATE_BLOCKS : act_blocks;
            float c[ROWS][2 * TILE_N];
            for (int64_t first = starts[e]; first < starts[e + 1]; first += ROWS) {
                const int m = (int)(starts[e + 1] - first < ROWS ? starts[e + 1] - first : ROWS);
                for (int64_t block = first_block; block < stop_block; ++block) {
                    const uint16_t* gate = gate_up + ((e * act_blocks + block) * 2) * k_tiles * TILE_WORDS;
                    product(grouped + first * k_padded, k_padded, m, gate, gate + k_tiles * TILE_WORDS, k_tiles, c);
                    silu_mul_rows((const float(*)[2 * TILE_N])c, m, act + first * inter_padded + block * TILE_N,
                                  inter_padded);
                }
            }
        }
        /* Down: a task is DOWN_COLUMNS output columns of every token, so no two tasks add into one sum, and
         * within a task the experts run in ascending order (the reference's order of summation). The activations
         * of all tokens are read once per task (a prefill's do not fit in cache), each 32-row tile once for all
         * of the task's columns. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < down_tasks; ++task) {
            const int64_t column = task * DOWN_COLUMNS;
            const int64_t stop_column = column + DOWN_COLUMNS < hidden_padded ? column + DOWN_COLUMNS : hidden_padded;
            float c[ROWS][2 * TILE_N];
            for (int64_t t = 0; t < num_tokens; ++t)
                memset(sums + t * hidden_padded + column, 0, (size_t)(stop_column - column) * sizeof(float));
            for (int64_t e = 0; e < num_experts; ++e) {
                for (int64_t first = starts[e]; first < starts[e + 1]; first += ROWS) {
                    const int m = (int)(starts[e + 1] - first < ROWS ? starts[e + 1] - first : ROWS);
                    for (int64_t at = column; at < stop_column; at += 2 * TILE_N) {
                        const uint16_t* weights = down + (e * hidden_padded + at) / TILE_N * inter_tiles * TILE_WORDS;
                        product(act + first * inter_padded, inter_padded, m, weights,
                                weights + inter_tiles * TILE_WORDS, inter_tiles, c);
                        for (int r = 0; r < m; ++r) {
                            const int64_t choice = order[first + r];
                            float* restrict row = sums + (choice / top_k) * hidden_padded + at;
                            const float weight = topk_weights[choice];
#pragma omp simd
                            for (int i = 0; i < 2 * TILE_N; ++i) row[i] += weight * c[r][i];
                        }
                    }
                }
            }
            const int64_t stop = stop_column < hidden_size ? stop_column : hidden_size;
            for (int64_t t = 0; t < num_tokens; ++t)
                for (int64_t i = column; i < stop; ++i) out[t * hidden_size + i] = float_to_bf16(sums[t * hidden_padded + i]);
        }
#if defined(HAVE_AMX)
        if (amx) _tile_release();
#endif
    }
    return 0;
#endif
}
