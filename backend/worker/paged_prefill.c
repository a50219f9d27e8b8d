/* Prefill attention that reads the paged KV cache where it lies: several query tokens per sequence.
 *
 * Built on first use by pagedllm/worker/native_prefill.py (cc -O3 -march=native) and called through
 * ctypes, beside paged_decode.c (same head-major caches, same fp8 handling, same reasons to avoid
 * -ffast-math). Each sequence's chunk of query_len new tokens sits at the end of its seq_len tokens:
 * query token i (position seq_len - query_len + i) sees every key at or before its own position, so
 * the cached context in full and the chunk causally.
 *
 * Work is split into items of (sequence, KV head, query tile): a tile is up to ROWS_PER_TILE query rows,
 * the tile's tokens times the KV head's group of query heads (GQA packed: every K and V row is loaded
 * once for the whole group). An item walks the context in key tiles of about KEYS_PER_TILE keys: the
 * tile's K is transposed (dequantized first for an 8-bit cache) into a small scratch matrix and its V
 * rows are read in place (or dequantized into scratch), and every query row of the item reads them
 * there, from L1, before the next key tile (flash attention's online softmax). Both products are register
 * blocks of broadcast-FMAs in gcc vector extensions (see VL below).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "exp_nonpositive.h"
#include "fp8_dequant.h"

/* 64 query rows and 64 keys per tile: 128 of either was no faster (A/B in one process, 1 thread, small
 * checkpoint's heads, 32-512 queries over 0-1024 cached tokens); the tile's K^T and V are 32 KB, L1's size. */
#define ROWS_PER_TILE 64
#define KEYS_PER_TILE 64 /* about: a key tile holds whole cache blocks, at least one */

/* Vectors of VL floats. The two matrix products run in register blocks of ROW_BLOCK query rows x 2 vectors
 * (of keys for the scores, of head dimensions for P.V). With AVX-512 that is 8 rows x 32 columns: 16 of the
 * 32 registers accumulate and each broadcast value feeds 2 FMAs of 16 lanes; elsewhere 4 rows x 16 columns
 * in 8-lane vectors, which every x86-64 with AVX2 (and aarch64 through NEON pairs) compiles well. On an
 * AVX-512 Xeon, chunks of 64-384 tokens over 0-512 cached ones took 0.83-0.94x the 8-lane build's time
 * (tiny and small checkpoints' heads, 1 thread, both builds interleaved in one process); a 16-token chunk
 * with no context took 1.3x (its keys pad to 32), a few microseconds. */
#ifdef __AVX512F__
#define VL 16
#define ROW_BLOCK 8
#else
#define VL 8
#define ROW_BLOCK 4
#endif
#define COLUMN_BLOCK (2 * VL)

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

static inline vfi lane_indices(void) {
    vfi v;
    for (int i = 0; i < VL; ++i) v[i] = i;
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

static inline float maxv(vf v) {
    float m = v[0];
    for (int i = 1; i < VL; ++i) m = v[i] > m ? v[i] : m;
    return m;
}

static inline float sumv(vf v) {
    float sum = 0.0f;
    for (int i = 0; i < VL; ++i) sum += v[i];
    return sum;
}

/* One item's scratch: transposed keys [head_dim][key_tile], dequantized V [key_tile][head_dim] and one
 * dequantized K block, scores/probabilities [rows][key_tile], accumulators [rows][head_dim], and the
 * online softmax's running max and sum per row; rows padded to a multiple of ROW_BLOCK. */
typedef struct {
    float *keys_t, *values, *block, *scores, *acc, *max, *sum;
    const float** q_rows;
} scratch_t;

static int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* S[r][c..c+COLUMN_BLOCK) = scale * q_r . K[c..c+COLUMN_BLOCK) for ROW_BLOCK rows r0.., from the transposed
 * keys. */
static inline __attribute__((always_inline)) void scores_block(const float* const* q, int64_t head_dim,
                                                               const float* keys_t, int64_t key_tile, int64_t c,
                                                               float scale, float* s) {
    vf a[ROW_BLOCK][2] = {{{0}}};
    for (int64_t d = 0; d < head_dim; ++d) {
        const vf k0 = loadv(keys_t + d * key_tile + c), k1 = loadv(keys_t + d * key_tile + c + VL);
        for (int r = 0; r < ROW_BLOCK; ++r) {
            const float x = q[r][d];
            a[r][0] += k0 * x;
            a[r][1] += k1 * x;
        }
    }
    for (int r = 0; r < ROW_BLOCK; ++r) {
        storev(s + r * key_tile + c, a[r][0] * scale);
        storev(s + r * key_tile + c + VL, a[r][1] * scale);
    }
}

/* acc[r][d0..d0 + vectors * VL) += sum_t P[r][t] V[t][d0..) for ROW_BLOCK rows, over keys [0, keys) of a
 * tile whose V rows lie in segments of block_size rows (segment j at values[j]); vectors is 1 or 2. */
static inline __attribute__((always_inline)) void values_block(const float* p, int64_t key_tile,
                                                               const float* const* values, int64_t block_size,
                                                               int64_t keys, int64_t head_dim, int64_t d0,
                                                               int vectors, float* acc) {
    vf a[ROW_BLOCK][2];
    for (int r = 0; r < ROW_BLOCK; ++r)
        for (int i = 0; i < vectors; ++i) a[r][i] = loadv(acc + r * head_dim + d0 + i * VL);
    for (int64_t j = 0, t0 = 0; t0 < keys; ++j, t0 += block_size) {
        const int64_t n = keys - t0 < block_size ? keys - t0 : block_size;
        for (int64_t t = 0; t < n; ++t) {
            const float* v = values[j] + t * head_dim + d0;
            vf row[2];
            for (int i = 0; i < vectors; ++i) row[i] = loadv(v + i * VL);
            for (int r = 0; r < ROW_BLOCK; ++r) {
                const float w = p[r * key_tile + t0 + t];
                for (int i = 0; i < vectors; ++i) a[r][i] += row[i] * w;
            }
        }
    }
    for (int r = 0; r < ROW_BLOCK; ++r)
        for (int i = 0; i < vectors; ++i) storev(acc + r * head_dim + d0 + i * VL, a[r][i]);
}

/* One item: query tokens [first, first + tokens) of a sequence (rows first.. of q/out, positions
 * first_pos..), one KV head's group. The float32 cache passes k_head/v_head and NULL byte heads; an 8-bit
 * one the reverse. Inlined per call site so that a constant head_dim unrolls the inner loops. */
static inline __attribute__((always_inline)) void prefill_item(
    const float* q, float* out, int64_t heads, int64_t group, int64_t head_dim, int64_t head,
    const float* k_head, const float* v_head, fp8_head k_bytes, fp8_head v_bytes, const int64_t* blocks, int64_t block_size,
    int64_t first, int64_t tokens, int64_t first_pos, int64_t tile_keys, int64_t key_tile, float scale,
    scratch_t* w) {
    const int64_t rows = tokens * group, padded = round_up(rows, ROW_BLOCK);
    const int64_t block_numel = block_size * head_dim, last_pos = first_pos + tokens - 1;
    for (int64_t r = 0; r < padded; ++r) {
        const int64_t row = r < rows ? r : rows - 1; /* padding rows repeat the last one; their results are dropped */
        w->q_rows[r] = q + ((first + row / group) * heads + head * group + row % group) * head_dim;
        w->max[r] = -INFINITY;
        w->sum[r] = 0.0f;
        for (int64_t d = 0; d < head_dim; ++d) w->acc[r * head_dim + d] = 0.0f;
    }
    const float* segments[KEYS_PER_TILE];
    for (int64_t start = 0; start <= last_pos; start += tile_keys) {
        /* Keys past the tile's last query position are seen by no row: they are neither staged nor scored. */
        const int64_t keys = last_pos + 1 - start < tile_keys ? last_pos + 1 - start : tile_keys;
        const int64_t width = round_up(keys, COLUMN_BLOCK);
        for (int64_t j = 0, t0 = 0; t0 < keys; ++j, t0 += block_size) {
            const int64_t n = keys - t0 < block_size ? keys - t0 : block_size;
            const int64_t block = blocks[(start + t0) / block_size];
            const float* k_rows = k_bytes.head ? dequantize_block(k_bytes.head + block * block_numel, n * head_dim, k_bytes, w->block)
                                          : k_head + block * block_numel;
            for (int64_t t = 0; t < n; ++t)
                for (int64_t d = 0; d < head_dim; ++d) w->keys_t[d * key_tile + t0 + t] = k_rows[t * head_dim + d];
            segments[j] = v_bytes.head ? dequantize_block(v_bytes.head + block * block_numel, n * head_dim, v_bytes,
                                                     w->values + t0 * head_dim)
                                  : v_head + block * block_numel;
        }
        for (int64_t t = keys; t < width; ++t)
            for (int64_t d = 0; d < head_dim; ++d) w->keys_t[d * key_tile + t] = 0.0f;
        for (int64_t r0 = 0; r0 < padded; r0 += ROW_BLOCK)
            for (int64_t c = 0; c < width; c += COLUMN_BLOCK)
                scores_block(w->q_rows + r0, head_dim, w->keys_t, key_tile, c, scale, w->scores + r0 * key_tile);
        /* Online softmax: row r sees this tile's first `seen` keys (a prefix, as the mask is causal). */
        const vfi lane = lane_indices();
        const vf zero = splat(0.0f);
        for (int64_t r = 0; r < padded; ++r) {
            float* s = w->scores + r * key_tile;
            const int64_t limit = first_pos + (r < rows ? r : rows - 1) / group - start + 1;
            const int64_t seen = r >= rows || limit <= 0 ? 0 : limit < keys ? limit : keys;
            vf vmax = splat(-INFINITY);
            for (int64_t t = 0; t < seen; t += VL)
                vmax = selectv(lane + (int32_t)t < (int32_t)seen, max_lanes(vmax, loadv(s + t)), vmax);
            const float tile_max = maxv(vmax);
            const float new_max = tile_max > w->max[r] ? tile_max : w->max[r];
            vf vsum = zero;
            int64_t t = 0;
            for (; t < seen; t += VL) {
                const vf weights = selectv(lane + (int32_t)t < (int32_t)seen, expv(loadv(s + t) - new_max), zero);
                storev(s + t, weights);
                vsum += weights;
            }
            for (; t < keys; t += VL) storev(s + t, zero);
            const float sum = sumv(vsum);
            if (seen == 0 || new_max == w->max[r]) {
                w->sum[r] += sum;
                continue;
            }
            const float correction = w->max[r] == -INFINITY ? 0.0f : exp_nonpositive(w->max[r] - new_max);
            w->max[r] = new_max;
            w->sum[r] = w->sum[r] * correction + sum;
            float* a = w->acc + r * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) a[d] *= correction;
        }
        for (int64_t r0 = 0; r0 < padded; r0 += ROW_BLOCK)
        {
            int64_t d0 = 0;
            for (; d0 + COLUMN_BLOCK <= head_dim; d0 += COLUMN_BLOCK)
                values_block(w->scores + r0 * key_tile, key_tile, segments, block_size, keys, head_dim, d0, 2,
                             w->acc + r0 * head_dim);
            for (; d0 < head_dim; d0 += VL) /* head_dim is a multiple of 16: at most one 16-lane vector is left */
                values_block(w->scores + r0 * key_tile, key_tile, segments, block_size, keys, head_dim, d0, 1,
                             w->acc + r0 * head_dim);
        }
    }
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t offset = (first + r / group) * heads + head * group + r % group;
        const float inverse = 1.0f / w->sum[r];
        for (int64_t d = 0; d < head_dim; ++d) out[offset * head_dim + d] = w->acc[r * head_dim + d] * inverse;
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
    /* A key tile is a whole number of blocks (tile_keys keys), stored key_tile floats apart. */
    const int64_t tile_keys = block_size < KEYS_PER_TILE ? KEYS_PER_TILE / block_size * block_size : block_size;
    const int64_t key_tile = round_up(tile_keys, COLUMN_BLOCK);
    const int64_t padded_rows = round_up(tile_tokens * group, ROW_BLOCK);
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
    const size_t floats = (size_t)(2 * key_tile * head_dim + block_size * head_dim + padded_rows * key_tile
                                   + padded_rows * head_dim + 2 * padded_rows);
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(| : failed)
    {
        float* memory = malloc(sizeof(float) * floats);
        const float** q_rows = malloc(sizeof(float*) * (size_t)padded_rows);
        scratch_t w = {0};
        if (memory && q_rows) {
            w.keys_t = memory;
            w.values = w.keys_t + key_tile * head_dim;
            w.block = w.values + key_tile * head_dim;
            w.scores = w.block + block_size * head_dim;
            w.acc = w.scores + padded_rows * key_tile;
            w.max = w.acc + padded_rows * head_dim;
            w.sum = w.max + padded_rows;
            w.q_rows = q_rows;
        }
        failed = !(memory && q_rows);
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
                             row, tokens, first_pos, tile_keys, key_tile, scale, &w);
            else if (head_dim == 128)
                prefill_item(q, out, heads, group, 128, head, k_head, v_head, k_bytes, v_bytes, blocks,
                             block_size, row, tokens, first_pos, tile_keys, key_tile, scale, &w);
            else
                prefill_item(q, out, heads, group, head_dim, head, k_head, v_head, k_bytes, v_bytes, blocks,
                             block_size, row, tokens, first_pos, tile_keys, key_tile, scale, &w);
        }
        free(memory);
        free(q_rows);
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
