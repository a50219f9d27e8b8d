/* The routed experts of a mixture-of-experts block on the CPU, float32, in one call.
 *
 * Built on first use by pagedllm/models/moe_cpu.py (cc -O3 -march=native) and called through
 * ctypes; kernels/fused_moe_reference.py is its oracle and the fallback when no compiler is found.
 * A decode step of a few dozen tokens calls nearly every expert with a handful of rows each, so a
 * torch op per expert (a GEMM, a slice, SiLU, a product, a scatter) costs more than its
 * arithmetic. Here the whole block is one call: a counting sort groups the (token, choice) pairs
 * by expert (stable, so each expert sees its tokens in order), each expert's gate|up products and
 * SiLU-and-multiply fill a row of scratch, and the down products are added into each token's
 * output row, weighted by its routing weight, in ascending expert order (the reference's and
 * transformers' order of summation).
 *
 * The weights come packed once per block (moe_cpu.py's pack_experts) in panels of 8 output
 * columns, each stored [in, 8]: a product broadcasts one input element against one vector of each of
 * three panels, for up to four input rows at once, so its 12 accumulators stay in registers, it
 * needs no horizontal sums, and the panels stream through memory in order, every cache line used
 * whole. (Dot products over the checkpoint's [out, in] rows, or a plain transpose read with a
 * stride, ran slower at a decode step's shapes: docs/results/RESULTS.md, "Figures behind the code's
 * choices".) -ffast-math is not used (see
 * native_build.py); the exp of SiLU is exp_nonpositive.h's.
 */
#include <stdint.h>
#include <string.h>

#include "../platform/exp_nonpositive.h"
#include "moe_sort.h"

#define ROWS 4 /* input rows per tile */
#define VECTORS 3 /* 8-float vectors of output columns per tile: ROWS x VECTORS accumulators */
#define COLUMN_BLOCK 48 /* output columns per task; tasks own disjoint columns */

typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float* p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float* p, v8 v) { memcpy(p, &v, sizeof v); }

/* sums[r][column + 8v ...] = rows[r] · panels[v] for r < R, v < V, over k: a panel is 8 output columns of a
 * weight, stored [k, 8], so every step broadcasts one input element per row against one vector of each
 * panel, the panels stream through memory in order, and the R x V accumulators are locals that stay in
 * registers (R and V constant once inlined). */
static inline __attribute__((always_inline)) void tile(const int R, const int V, const float* const rows[ROWS],
                                                       const float* restrict panels, int64_t k,
                                                       float (*restrict sums)[COLUMN_BLOCK], int64_t column) {
    v8 acc[ROWS][VECTORS];
    for (int r = 0; r < R; ++r)
        for (int v = 0; v < V; ++v) acc[r][v] = (v8){0};
    for (int64_t i = 0; i < k; ++i) {
        v8 b[VECTORS];
        for (int v = 0; v < V; ++v) b[v] = load8(panels + v * k * 8 + i * 8);
        for (int r = 0; r < R; ++r) {
            const float e = rows[r][i];
            v8 x = {e, e, e, e, e, e, e, e};
            for (int v = 0; v < V; ++v) acc[r][v] += x * b[v];
        }
    }
    for (int r = 0; r < R; ++r)
        for (int v = 0; v < V; ++v) store8(&sums[r][column + 8 * v], acc[r][v]);
}

/* sums[r][c - first] = rows[r] · (column c of the weight) for first <= c < stop (first a multiple of 8), r < n;
 * packed: the weight's panels, [ceil(N / 8), k, 8], zero past its last column. Columns up to the next
 * multiple of 8 past stop are written too. */
static void products(int n, const float* const rows[ROWS], const float* packed, int64_t k, int64_t first,
                     int64_t stop, float sums[ROWS][COLUMN_BLOCK]) {
#define TILE_V(R)                                                                        \
    switch (V) {                                                                         \
        case 3: tile(R, 3, rows, panels, k, sums, c - first); break;                     \
        case 2: tile(R, 2, rows, panels, k, sums, c - first); break;                     \
        default: tile(R, 1, rows, panels, k, sums, c - first); break;                    \
    }
    for (int64_t c = first; c < stop;) {
        const int64_t remaining = (stop - c + 7) / 8;
        const int V = (int)(remaining < VECTORS ? remaining : VECTORS);
        const float* panels = packed + (c / 8) * k * 8;
        switch (n) {
            case 4: TILE_V(4) break;
            case 3: TILE_V(3) break;
            case 2: TILE_V(2) break;
            default: TILE_V(1) break;
        }
        c += 8 * V;
    }
#undef TILE_V
}

/* gate[j] = silu(gate[j]) * up[j], with exp taken of -|g| only (exp_nonpositive's domain). */
static void silu_and_mul(float* gate, const float* restrict up, int64_t n) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
        float g = gate[j];
        float e = exp_nonpositive(g < 0.0f ? g : -g);
        float sigmoid = g < 0.0f ? e / (1.0f + e) : 1.0f / (1.0f + e);
        gate[j] = g * sigmoid * up[j];
    }
}

/* The (at most ROWS) grouped rows from first of one expert whose rows end at stop: their count, their choices. */
static inline int tile_rows(const int64_t* order, int64_t first, int64_t stop, int64_t choices[ROWS]) {
    int n = (int)(stop - first < ROWS ? stop - first : ROWS);
    for (int r = 0; r < n; ++r) choices[r] = order[first + r];
    return n;
}

/*
 * out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, j], for
 * hidden rows x_t (row stride hidden_stride); the weights packed in panels of 8 output columns,
 * gate|up (gate columns, then up) as [E, ceil(2I / 8), H, 8] and down as [E, ceil(H / 8), I, 8],
 * zero-padded, contiguous (moe_cpu.py's pack_experts); topk_weights and topk_ids [T, top_k]
 * contiguous; out [T, H] contiguous (overwritten). Scratch: gate_up [T * top_k, 2I] floats, order [T * top_k] and
 * starts [E + 1] int64. Returns 0, or -1 (out untouched) when an expert id is outside [0, E).
 */
int pagedllm_moe_experts_f32(const float* hidden, int64_t num_tokens, int64_t hidden_size, int64_t hidden_stride,
                             const float* w_gate_up_packed, const float* w_down_packed, int64_t num_experts,
                             int64_t inter, const float* topk_weights, const int64_t* topk_ids, int64_t top_k,
                             float* out, float* gate_up, int64_t* order, int64_t* starts, int threads) {
    const int64_t choices = num_tokens * top_k, width = 2 * inter;
    if (sort_choices_by_expert(topk_ids, choices, num_experts, order, starts) != 0) return -1;
    const int64_t panels_gate_up = (width + 7) / 8, panels_down = (hidden_size + 7) / 8;
    const int64_t gate_blocks = (width + COLUMN_BLOCK - 1) / COLUMN_BLOCK;
    const int64_t down_blocks = (hidden_size + COLUMN_BLOCK - 1) / COLUMN_BLOCK;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        /* Gate|up: a task is COLUMN_BLOCK columns of one expert's gate|up, for all of its rows. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_experts * gate_blocks; ++task) {
            const int64_t e = task / gate_blocks, first_column = (task % gate_blocks) * COLUMN_BLOCK;
            const int64_t stop_column = first_column + COLUMN_BLOCK < width ? first_column + COLUMN_BLOCK : width;
            for (int64_t first = starts[e]; first < starts[e + 1]; first += ROWS) {
                int64_t picks[ROWS];
                const float* rows[ROWS];
                float sums[ROWS][COLUMN_BLOCK];
                int n = tile_rows(order, first, starts[e + 1], picks);
                for (int r = 0; r < n; ++r) rows[r] = hidden + (picks[r] / top_k) * hidden_stride;
                products(n, rows, w_gate_up_packed + e * panels_gate_up * hidden_size * 8, hidden_size,
                         first_column, stop_column, sums);
                for (int r = 0; r < n; ++r)
                    memcpy(gate_up + (first + r) * width + first_column, sums[r],
                           (size_t)(stop_column - first_column) * sizeof(float));
            }
        }
#pragma omp for schedule(static)
        for (int64_t p = 0; p < choices; ++p) silu_and_mul(gate_up + p * width, gate_up + p * width + inter, inter);
        /* Down: a task is COLUMN_BLOCK output columns of every token, so no two tasks add into one element,
         * and within a task the experts run in ascending order (the reference's order of summation). */
#pragma omp for schedule(dynamic, 1)
        for (int64_t block = 0; block < down_blocks; ++block) {
            const int64_t first_column = block * COLUMN_BLOCK;
            const int64_t stop_column = first_column + COLUMN_BLOCK < hidden_size ? first_column + COLUMN_BLOCK
                                                                                  : hidden_size;
            const size_t columns = (size_t)(stop_column - first_column);
            for (int64_t t = 0; t < num_tokens; ++t) memset(out + t * hidden_size + first_column, 0, columns * 4);
            for (int64_t e = 0; e < num_experts; ++e) {
                for (int64_t first = starts[e]; first < starts[e + 1]; first += ROWS) {
                    int64_t picks[ROWS];
                    const float* rows[ROWS];
                    float sums[ROWS][COLUMN_BLOCK];
                    int n = tile_rows(order, first, starts[e + 1], picks);
                    for (int r = 0; r < n; ++r) rows[r] = gate_up + (first + r) * width;  /* the activations */
                    products(n, rows, w_down_packed + e * panels_down * inter * 8, inter, first_column,
                             stop_column, sums);
                    for (int r = 0; r < n; ++r) {
                        float* restrict row = out + (picks[r] / top_k) * hidden_size + first_column;
                        const float weight = topk_weights[picks[r]];
#pragma omp simd
                        for (size_t c = 0; c < columns; ++c) row[c] += weight * sums[r][c];
                    }
                }
            }
        }
    }
    return 0;
}
