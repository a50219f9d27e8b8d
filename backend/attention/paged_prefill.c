/* Prefill attention that reads the paged KV cache where it lies: several query tokens per sequence.
 *
 * Built on first use by pagedllm/worker/native_prefill.py (cc -O3 -march=native) and called through
 * ctypes, beside paged_decode.c (same head-major caches, same fp8 handling, same reasons to avoid
 * -ffast-math). Each sequence's chunk of query_len new tokens sits at the end of its seq_len tokens:
 * query token i (position seq_len - query_len + i) sees every key at or before its own position, so
 * the cached context in full and the chunk causally.
 *
 * Work is split into items of (sequence, KV head, query tile): a tile is up to ROWS_PER_TILE query rows,
 * the tile's tokens times the KV head's group of query heads (GQA packed: every K and V row is read once
 * for the whole group). An item walks the context in key tiles of about KEYS_PER_TILE keys (flash
 * attention's online softmax), reading K and V rows where they lie (an 8-bit cache's blocks are
 * dequantized into scratch first). The item's rows are kept transposed, as columns: its queries
 * (scaled) [head_dim][rows], the tile's scores [keys][rows] and its output accumulators [head_dim][rows],
 * so that both products are register blocks of a few keys (or head dimensions) broadcast against vectors
 * of rows, the K and V rows are read in place without a transposed copy, and the softmax, the causal
 * mask and the rescaling run on vectors of rows. The output is transposed back once per item.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "../platform/exp_nonpositive.h"
#include "fp8_dequant.h"

/* 64 query rows and 64 keys per tile: 128 of either was no faster with the earlier row-major layout (A/B
 * in one process, 1 thread, small checkpoint's heads, 32-512 queries over 0-1024 cached tokens). */
#define ROWS_PER_TILE 64
#define KEYS_PER_TILE 64 /* about: a key tile holds whole cache blocks, at least one */

/* Vectors of VL floats, and register blocks of KEY_BLOCK keys (or head dimensions) x up to ROW_VECTORS
 * vectors of rows: with AVX-512 16 accumulators of the 32 registers, each broadcast value feeding 4 FMAs
 * of 16 lanes; elsewhere 8 of 16 in 8-lane vectors, which every x86-64 with AVX2 (and aarch64 through
 * NEON pairs) compiles well. On an AVX-512 Xeon this layout ran chunks with cached context, and long
 * ones without, in clearly less time than the row-major one it replaced (which staged a transposed copy
 * of every key tile and ran the softmax row by row); short chunks with no context ran level (measured:
 * docs/results/RESULTS.md, "Figures behind the code's choices"). */
#ifdef __AVX512F__
#define VL 16
#define ROW_VECTORS 4
#else
#define VL 8
#define ROW_VECTORS 2
#endif
#define KEY_BLOCK 4

typedef float vf __attribute__((vector_size(VL * 4)));
typedef int32_t vfi __attribute__((vector_size(VL * 4)));

static inline vf loadv(const float* p) {
    vf v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

static inline void storev(float* p, vf v) { __builtin_memcpy(p, &v, sizeof v); }

static inline vf splat(float x) {
    vf v;
    for (int i = 0; i < VL; ++i) v[i] = x;
    return v;
}

/* Lanes of a where mask is set (all ones), of b elsewhere. */
static inline vf selectv(vfi mask, vf a, vf b) { return (vf)(((vfi)a & mask) | ((vfi)b & ~mask)); }

/* exp_nonpositive (exp_nonpositive.h) on VL lanes, spelled in vector extensions: gcc leaves the scalar one
 * unvectorized in this routine's softmax loop, where it then costs as much as the two matrix products. */
static inline vf expv(vf x) {
    x = selectv(x < -87.0f, splat(-87.0f), x);
    /* round to nearest through the float mantissa: |x * log2(e)| < 2^22 */
    const vf n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;
    const vf r = x - n * 0.693145752f - n * 1.42860677e-6f;
    vf p = r * (1.0f / 720.0f) + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const vfi scale = (__builtin_convertvector(n, vfi) + 127) << 23;
    return p * (vf)scale;
}

static inline vf max_lanes(vf a, vf b) { return selectv(a > b, a, b); }


/* One item's scratch, rows padded to a multiple of VL and stored as columns: the scaled queries
 * transposed [head_dim][rows], scores and then probabilities transposed [key_tile][rows], the output
 * accumulators transposed [head_dim][rows], per row the online softmax's running max and sum and its
 * position; a dequantized K block and the tile's dequantized V rows for an 8-bit cache. */
typedef struct {
    float *q_t, *s_t, *acc_t, *max, *sum, *block, *values;
    int32_t* positions;
} scratch_t;

static int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* s_t[t][rows of vectors v0..v0+nv) = sum_d K[t][d] q_t[d][..] for keys t0..t0+nk of one cache block. */
static inline __attribute__((always_inline)) void scores_block(const float* q_t, int64_t stride, int64_t head_dim,
                                                               const float* keys, int nk, int nv, float* s_t) {
    vf a[KEY_BLOCK][ROW_VECTORS];
    for (int k = 0; k < nk; ++k)
        for (int v = 0; v < nv; ++v) a[k][v] = splat(0.0f);
    for (int64_t d = 0; d < head_dim; ++d) {
        vf q[ROW_VECTORS];
        for (int v = 0; v < nv; ++v) q[v] = loadv(q_t + d * stride + v * VL);
        for (int k = 0; k < nk; ++k) {
            const float x = keys[k * head_dim + d];
            for (int v = 0; v < nv; ++v) a[k][v] += q[v] * x;
        }
    }
    for (int k = 0; k < nk; ++k)
        for (int v = 0; v < nv; ++v) storev(s_t + k * stride + v * VL, a[k][v]);
}

/* acc_t[d0..d0+KEY_BLOCK][rows of nv vectors] += sum_t V[t][d] P_t[t][..] over the tile's keys, whose V rows
 * lie in segments of block_size rows (segment j at values[j]). */
static inline __attribute__((always_inline)) void values_block(const float* p_t, int64_t stride,
                                                               const float* const* values, int64_t block_size,
                                                               int64_t keys, int64_t head_dim, int64_t d0, int nv,
                                                               float* acc_t) {
    vf a[KEY_BLOCK][ROW_VECTORS];
    for (int i = 0; i < KEY_BLOCK; ++i)
        for (int v = 0; v < nv; ++v) a[i][v] = loadv(acc_t + (d0 + i) * stride + v * VL);
    for (int64_t j = 0, t0 = 0; t0 < keys; ++j, t0 += block_size) {
        const int64_t n = keys - t0 < block_size ? keys - t0 : block_size;
        for (int64_t t = 0; t < n; ++t) {
            const float* row = values[j] + t * head_dim + d0;
            vf p[ROW_VECTORS];
            for (int v = 0; v < nv; ++v) p[v] = loadv(p_t + (t0 + t) * stride + v * VL);
            for (int i = 0; i < KEY_BLOCK; ++i) {
                const float x = row[i];
                for (int v = 0; v < nv; ++v) a[i][v] += p[v] * x;
            }
        }
    }
    for (int i = 0; i < KEY_BLOCK; ++i)
        for (int v = 0; v < nv; ++v) storev(acc_t + (d0 + i) * stride + v * VL, a[i][v]);
}

/* The blocks above with a constant vector count nv (1..ROW_VECTORS), so that their accumulators stay in
 * registers. */
#if ROW_VECTORS == 4
#define BY_VECTORS(nv, call) \
    do {                      \
        switch (nv) {         \
        case 1: call(1); break; \
        case 2: call(2); break; \
        case 3: call(3); break; \
        default: call(4); break; \
        }                     \
    } while (0)
#else
#define BY_VECTORS(nv, call) \
    do {                      \
        if ((nv) == 1)        \
            call(1);          \
        else                  \
            call(2);          \
    } while (0)
#endif

/* One item: query tokens [first, first + tokens) of a sequence (rows first.. of q/out, positions
 * first_pos..), one KV head's group. The float32 cache passes k_head/v_head and NULL byte heads; an 8-bit
 * one the reverse. Inlined per call site so that a constant head_dim unrolls the inner loops. */
static inline __attribute__((always_inline)) void prefill_item(
    const float* q, float* out, int64_t heads, int64_t group, int64_t head_dim, int64_t head,
    const float* k_head, const float* v_head, fp8_head k_bytes, fp8_head v_bytes, const int64_t* blocks, int64_t block_size,
    int64_t first, int64_t tokens, int64_t first_pos, int64_t tile_keys, float scale, scratch_t* w) {
    const int64_t rows = tokens * group, stride = round_up(rows, VL), vectors = stride / VL;
    const int64_t block_numel = block_size * head_dim, last_pos = first_pos + tokens - 1;
    for (int64_t r = 0; r < stride; ++r) {
        /* padding rows are zero queries at the last row's position; their results are dropped */
        const float* q_row = r < rows ? q + ((first + r / group) * heads + head * group + r % group) * head_dim : NULL;
        for (int64_t d = 0; d < head_dim; ++d) w->q_t[d * stride + r] = q_row ? q_row[d] * scale : 0.0f;
        for (int64_t d = 0; d < head_dim; ++d) w->acc_t[d * stride + r] = 0.0f;
        w->positions[r] = (int32_t)(first_pos + (r < rows ? r : rows - 1) / group);
        w->max[r] = -INFINITY;
        w->sum[r] = 0.0f;
    }
    const float* segments[KEYS_PER_TILE];
    for (int64_t start = 0; start <= last_pos; start += tile_keys) {
        /* Keys past the tile's last query position are seen by no row: they are neither read nor scored. */
        const int64_t keys = last_pos + 1 - start < tile_keys ? last_pos + 1 - start : tile_keys;
        for (int64_t j = 0, t0 = 0; t0 < keys; ++j, t0 += block_size) {
            const int64_t n = keys - t0 < block_size ? keys - t0 : block_size;
            const int64_t block = blocks[(start + t0) / block_size];
            const float* k_rows = k_bytes.head ? dequantize_block(k_bytes.head + block * block_numel, n * head_dim,
                                                                  k_bytes, w->block)
                                               : k_head + block * block_numel;
            for (int64_t v0 = 0; v0 < vectors; v0 += ROW_VECTORS) {
                const int nv = vectors - v0 < ROW_VECTORS ? (int)(vectors - v0) : ROW_VECTORS;
                int64_t t = 0;
#define SCORES(count, keys_now) \
    scores_block(w->q_t + v0 * VL, stride, head_dim, k_rows + t * head_dim, keys_now, count, \
                 w->s_t + (t0 + t) * stride + v0 * VL)
#define SCORES4(count) SCORES(count, KEY_BLOCK)
#define SCORES1(count) SCORES(count, 1)
                for (; t + KEY_BLOCK <= n; t += KEY_BLOCK) BY_VECTORS(nv, SCORES4);
                for (; t < n; ++t) BY_VECTORS(nv, SCORES1);
#undef SCORES1
#undef SCORES4
#undef SCORES
            }
            segments[j] = v_bytes.head ? dequantize_block(v_bytes.head + block * block_numel, n * head_dim, v_bytes,
                                                          w->values + t0 * head_dim)
                                       : v_head + block * block_numel;
        }
        /* Online softmax, a vector of rows at a time: row r sees key t when t's position is at most r's. */
        for (int64_t v = 0; v < vectors; ++v) {
            vfi row_pos;
            __builtin_memcpy(&row_pos, w->positions + v * VL, sizeof row_pos);
            const vf old_max = loadv(w->max + v * VL);
            vf tile_max = splat(-INFINITY);
            for (int64_t t = 0; t < keys; ++t) {
                const vfi seen = row_pos >= (int32_t)(start + t);
                tile_max = selectv(seen, max_lanes(tile_max, loadv(w->s_t + t * stride + v * VL)), tile_max);
            }
            const vf new_max = max_lanes(old_max, tile_max);
            vf sum = splat(0.0f);
            for (int64_t t = 0; t < keys; ++t) {
                float* s = w->s_t + t * stride + v * VL;
                const vfi seen = row_pos >= (int32_t)(start + t);
                const vf p = selectv(seen, expv(loadv(s) - new_max), splat(0.0f));
                storev(s, p);
                sum += p;
            }
            /* rows that saw nothing before have nothing to rescale (and -inf - -inf is no number) */
            const vf correction = selectv(old_max == -INFINITY, splat(0.0f), expv(old_max - new_max));
            storev(w->sum + v * VL, loadv(w->sum + v * VL) * correction + sum);
            storev(w->max + v * VL, new_max);
            for (int64_t d = 0; d < head_dim; ++d) {
                float* a = w->acc_t + d * stride + v * VL;
                storev(a, loadv(a) * correction);
            }
        }
        for (int64_t v0 = 0; v0 < vectors; v0 += ROW_VECTORS) {
            const int nv = vectors - v0 < ROW_VECTORS ? (int)(vectors - v0) : ROW_VECTORS;
            for (int64_t d0 = 0; d0 < head_dim; d0 += KEY_BLOCK) {
#define VALUES(count) \
    values_block(w->s_t + v0 * VL, stride, segments, block_size, keys, head_dim, d0, count, w->acc_t + v0 * VL)
                BY_VECTORS(nv, VALUES);
#undef VALUES
            }
        }
    }
    for (int64_t r = 0; r < rows; ++r) {
        float* out_row = out + ((first + r / group) * heads + head * group + r % group) * head_dim;
        const float inverse = 1.0f / w->sum[r];
        for (int64_t d = 0; d < head_dim; ++d) out_row[d] = w->acc_t[d * stride + r] * inverse;
    }
}

/* q, out: [tokens, kv_heads * group, head_dim].
 * Sequence i's query_lens[i] tokens are rows starts[i].. and the last of its seq_lens[i] positions; it reads
 * the first seq_lens[i] slots its block-table row lists. head_dim must be a multiple of 16. Returns 0, or 1 when scratch could not be allocated
 * (out is then undefined). */
static int paged_prefill(const float* q, const float* k_cache, const float* v_cache, const uint8_t* k8,
                         const uint8_t* v8, int format, float k_scale, float v_scale, const int64_t* starts,
                         const int64_t* query_lens, const int64_t* seq_lens, const int64_t* block_table,
                         int64_t table_width, int64_t num_seqs, int64_t kv_heads, int64_t group, int64_t head_dim,
                         int64_t num_blocks, int64_t block_size, float scale, int threads, float* out) {
    const int64_t heads = kv_heads * group, head_numel = num_blocks * block_size * head_dim;
    const int64_t tile_tokens = ROWS_PER_TILE / group > 0 ? ROWS_PER_TILE / group : 1;
    /* A key tile is a whole number of blocks (tile_keys keys). */
    const int64_t tile_keys = block_size < KEYS_PER_TILE ? KEYS_PER_TILE / block_size * block_size : block_size;
    const int64_t padded_rows = round_up(tile_tokens * group, VL);
    int64_t tiles = 0;
    for (int64_t s = 0; s < num_seqs; ++s) tiles += (query_lens[s] + tile_tokens - 1) / tile_tokens;
    int64_t* tile_first = malloc(sizeof(int64_t) * (size_t)(2 * (tiles > 0 ? tiles : 1)));
    if (!tile_first) return 1;
    int64_t* tile_seq = tile_first + tiles;
    for (int64_t s = 0, t = 0; s < num_seqs; ++s)
        for (int64_t first = 0; first < query_lens[s]; first += tile_tokens, ++t) {
            tile_first[t] = first;
            tile_seq[t] = s;
        }
    int failed = 0;
    const size_t floats = (size_t)(2 * head_dim * padded_rows + tile_keys * padded_rows + 2 * padded_rows
                                   + block_size * head_dim + tile_keys * head_dim);
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(| : failed)
    {
        float* memory = malloc(sizeof(float) * floats);
        int32_t* positions = malloc(sizeof(int32_t) * (size_t)padded_rows);
        scratch_t w = {0};
        if (memory && positions) {
            w.q_t = memory;
            w.acc_t = w.q_t + head_dim * padded_rows;
            w.s_t = w.acc_t + head_dim * padded_rows;
            w.max = w.s_t + tile_keys * padded_rows;
            w.sum = w.max + padded_rows;
            w.block = w.sum + padded_rows;
            w.values = w.block + block_size * head_dim;
            w.positions = positions;
        }
        failed = !(memory && positions);
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < tiles * kv_heads; ++i) {
            if (failed) continue;
            /* Last tiles first: they see the most context, so the dynamic schedule balances better. */
            const int64_t tile = tiles - 1 - i / kv_heads, head = i % kv_heads, seq = tile_seq[tile];
            const int64_t first = tile_first[tile];
            const int64_t tokens = query_lens[seq] - first < tile_tokens ? query_lens[seq] - first : tile_tokens;
            const int64_t first_pos = seq_lens[seq] - query_lens[seq] + first;
            const float *k_head = k8 ? NULL : k_cache + head * head_numel, *v_head = v8 ? NULL : v_cache + head * head_numel;
            const fp8_head k_bytes = {k8 ? k8 + head * head_numel : NULL, format, k_scale};
            const fp8_head v_bytes = {v8 ? v8 + head * head_numel : NULL, format, v_scale};
            const int64_t* blocks = block_table + seq * table_width;
            const int64_t row = starts[seq] + first;
            if (head_dim == 64)
                prefill_item(q, out, heads, group, 64, head, k_head, v_head, k_bytes, v_bytes, blocks, block_size,
                             row, tokens, first_pos, tile_keys, scale, &w);
            else if (head_dim == 128)
                prefill_item(q, out, heads, group, 128, head, k_head, v_head, k_bytes, v_bytes, blocks,
                             block_size, row, tokens, first_pos, tile_keys, scale, &w);
            else
                prefill_item(q, out, heads, group, head_dim, head, k_head, v_head, k_bytes, v_bytes, blocks,
                             block_size, row, tokens, first_pos, tile_keys, scale, &w);
        }
        free(memory);
        free(positions);
    }
    free(tile_first);
    return failed;
}

int pagedllm_paged_prefill_f32(const float* q, const float* k_cache, const float* v_cache, const int64_t* starts,
                               const int64_t* query_lens, const int64_t* seq_lens, const int64_t* block_table,
                               int64_t table_width, int64_t num_seqs, int64_t kv_heads, int64_t group,
                               int64_t head_dim, int64_t num_blocks, int64_t block_size, float scale, int threads,
                               float* out) {
    return paged_prefill(q, k_cache, v_cache, NULL, NULL, 0, 1.0f, 1.0f, starts, query_lens, seq_lens, block_table,
                         table_width, num_seqs, kv_heads, group, head_dim, num_blocks, block_size, scale, threads,
                         out);
}

/* pagedllm_paged_prefill_f32 over 8-bit caches of one format (0: e4m3fn, 1: e5m2): a K byte stands for its
 * value in the format times k_scale, a V byte times v_scale. */
int pagedllm_paged_prefill_fp8(const float* q, const uint8_t* k_cache, const uint8_t* v_cache, int format,
                               float k_scale, float v_scale, const int64_t* starts, const int64_t* query_lens,
                               const int64_t* seq_lens, const int64_t* block_table, int64_t table_width,
                               int64_t num_seqs, int64_t kv_heads, int64_t group, int64_t head_dim, int64_t num_blocks,
                               int64_t block_size, float scale, int threads, float* out) {
    return paged_prefill(q, NULL, NULL, k_cache, v_cache, format, k_scale, v_scale, starts, query_lens, seq_lens,
                         block_table, table_width, num_seqs, kv_heads, group, head_dim, num_blocks, block_size, scale,
                         threads, out);
}

/* The vector width this build computes in (16 with AVX-512, else 8): the plan's crossover rule depends on it. */
int pagedllm_paged_prefill_lanes(void) { return VL; }
