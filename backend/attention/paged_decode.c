/* Decode attention that reads the paged KV cache where it lies: one query token per sequence.
 *
 * Built on first use by pagedllm/worker/native_decode.py (cc -O3 -march=native) and called
 * through ctypes; the plain-torch path in cpu_attention.py is the fallback when no compiler is
 * found. Caches are head-major, [kv_heads, num_blocks, block_size, head_dim], so one KV head's
 * block is one contiguous [block_size, head_dim] matrix. A KV head's query heads (its "group")
 * attend together, so each K and V row is loaded once for all of them.
 *
 * float32 queries; the caches are float32, or 8-bit (fp8 e4m3fn or e5m2) dequantized one block at a time
 * (times the layer's scale) into a float scratch block, so that no full-precision copy of a context is
 * ever made, or bfloat16 widened the same way (exactly), with bf16 queries and outputs. Sums are float32
 * throughout. Over a bf16 cache the softmax weights are rounded to bf16 before they weigh V, and
 * normalized after, as torch's bf16 flash attention does (the forward the bf16 model is judged by):
 * exp(s - max) in float32, summed unrounded, rounded to bf16 for the product with V, the output times
 * 1/sum at the end. -ffast-math is avoided on purpose: on gcc < 13 it links crtfastmath.o, which
 * flips the whole process to flush-to-zero when the library is loaded. Its exp is therefore
 * spelled out (exp_nonpositive.h), so that the compiler can vectorize it without libmvec.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "../platform/exp_nonpositive.h"
#include "fp8_dequant.h"

static inline float dot(const float* restrict a, const float* restrict b, int64_t n) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
    return sum;
}

static inline void add_scaled(float* restrict y, float a, const float* restrict x, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

/* Sixteen K rows (or V rows) at a time, in 16-lane vectors, where the compiler is gcc (its vector
 * extensions and __builtin_shuffle) and the CPU has AVX-512; elsewhere every row takes the one-row path
 * below. Per row, a score is a dot product whose lanes must be summed: summing 16 rows' lanes together
 * in one shuffle tree costs 15 folds instead of 16 separate horizontal sums, and the V side keeps a
 * query head's output row in registers across the 16 rows instead of reloading and storing it per row.
 * Without AVX-512 a 16-lane vector is two 8-lane registers, the 16 partial rows no longer fit the 16
 * registers and spill: on an AVX2-only AMD EPYC (Zen 3) the one-row path was the faster one
 * (measured: docs/results/RESULTS.md, "Figures behind the code's choices"). */
#if defined(__GNUC__) && !defined(__clang__) && defined(__AVX512F__)
#define PAGEDLLM_ROWS16 1
#define ROWS16 16
#define MAX_CHUNKS 8 /* head_dim up to 128 */
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

static inline v16 load16(const float* p) {
    v16 v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16(float* p, v16 v) { __builtin_memcpy(p, &v, sizeof v); }

/* Halves the row segments of a and b: each output lane sums two lanes of one row's segment; a's
 * rows fill lanes 0-7, b's lanes 8-15, in order. */
#define FOLD(a, b, lo, hi) (__builtin_shuffle((a), (b), (lo)) + __builtin_shuffle((a), (b), (hi)))

/* sums[r] = the sum of the 16 lanes of p[r]. */
static inline v16 row_sums16(const v16 p[ROWS16]) {
    const v16i lo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const v16i hi1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const v16i lo2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const v16i hi2 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const v16i lo3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const v16i hi3 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    const v16i lo4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const v16i hi4 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    v16 eight[8], four[4], two[2];
    for (int i = 0; i < 8; ++i) eight[i] = FOLD(p[2 * i], p[2 * i + 1], lo1, hi1);
    for (int i = 0; i < 4; ++i) four[i] = FOLD(eight[2 * i], eight[2 * i + 1], lo2, hi2);
    for (int i = 0; i < 2; ++i) two[i] = FOLD(four[2 * i], four[2 * i + 1], lo3, hi3);
    return FOLD(two[0], two[1], lo4, hi4);
}

/* scores[g * len + r] = scale * q[g] . keys[r] for 16 rows r. */
static inline __attribute__((always_inline)) void scores16(const float* q, int64_t group, int64_t head_dim,
                                                           const float* keys, float scale, float* scores,
                                                           int64_t len) {
    const int64_t chunks = head_dim / 16;
    for (int64_t g = 0; g < group; ++g) {
        v16 query[MAX_CHUNKS], partial[ROWS16];
        for (int64_t c = 0; c < chunks; ++c) query[c] = load16(q + g * head_dim + 16 * c);
        for (int r = 0; r < ROWS16; ++r) {
            v16 sum = query[0] * load16(keys + r * head_dim);
            for (int64_t c = 1; c < chunks; ++c) sum += query[c] * load16(keys + r * head_dim + 16 * c);
            partial[r] = sum;
        }
        store16(scores + g * len, row_sums16(partial) * scale);
    }
}

/* out[g] += weights[g * len + r] * values[r] over 16 rows r. */
static inline __attribute__((always_inline)) void values16(const float* weights, int64_t group, int64_t head_dim,
                                                           const float* values, float* out, int64_t len) {
    const int64_t chunks = head_dim / 16;
    for (int64_t g = 0; g < group; ++g) {
        v16 acc[MAX_CHUNKS];
        for (int64_t c = 0; c < chunks; ++c) acc[c] = load16(out + g * head_dim + 16 * c);
        for (int r = 0; r < ROWS16; ++r) {
            const float weight = weights[g * len + r];
            for (int64_t c = 0; c < chunks; ++c) acc[c] += load16(values + r * head_dim + 16 * c) * weight;
        }
        for (int64_t c = 0; c < chunks; ++c) store16(out + g * head_dim + 16 * c, acc[c]);
    }
}
#endif

/* Whether 16-row chunks apply to this head size. */
static inline int rows16(int64_t head_dim) {
#ifdef PAGEDLLM_ROWS16
    return head_dim % 16 == 0 && head_dim <= 16 * MAX_CHUNKS;
#else
    (void)head_dim;
    return 0;
#endif
}

/* Hardware prefetchers stop at page edges and blocks are scattered, so ask for the block
 * PREFETCH_DISTANCE ahead while this one is read, one row of it per row read, into L2
 * (prefetcht1). Into L1 it gained nothing at any distance; into L2 at distance 2 it closed much of
 * the gap to reading the same blocks in order (measured: docs/results/RESULTS.md, "Figures behind the
 * code's choices"). */
#define PREFETCH_DISTANCE 2

static inline void prefetch_rows(const char* block, int64_t row, int64_t row_bytes) {
    if (!block) return;
    const char* start = block + row * row_bytes;
    for (int64_t offset = 0; offset < row_bytes; offset += 64) __builtin_prefetch(start + offset, 0, 2);
}

/* The blocks a pass starts with, which the in-pass prefetch never covers. */
static inline void prefetch_first_blocks(const char* head, const int64_t* blocks, int64_t len, int64_t block_size,
                                         int64_t row_bytes) {
    if (!head) return;
    for (int64_t j = 0; j < PREFETCH_DISTANCE && j * block_size < len; ++j)
        for (int64_t row = 0; row < block_size; ++row)
            prefetch_rows(head + blocks[j] * block_size * row_bytes, row, row_bytes);
}

/* Where a KV head's blocks start, as bytes to prefetch: a float32 or bf16 cache's; NULL for an 8-bit one. */
static inline const char* prefetched_head(const float* head, fp8_head narrow) {
    if (!narrow.head) return (const char*)head;
    return narrow.format == KV_BF16 ? (const char*)narrow.head : NULL;
}

/* Block j's rows: in place for a float32 cache, dequantized into scratch for an 8-bit one (k8.head set). */
static inline __attribute__((always_inline)) const float* block_rows(const float* head, fp8_head k8,
                                                                     const int64_t* blocks, int64_t j, int64_t rows,
                                                                     int64_t block_numel, int64_t head_dim,
                                                                     float* scratch) {
    if (k8.head)
        return dequantize_block(k8.head + blocks[j] * block_numel * kv_element_bytes(k8.format), rows * head_dim, k8,
                                scratch);
    return head + blocks[j] * block_numel;
}

/* One sequence, one KV head: out[g] = softmax(scale * q[g] K^T) V and lse[g] its log-sum-exp.
 * Inlined into each call site so that a constant head_dim unrolls the row loops, and a float32 cache
 * (k8.head and v8.head NULL) loses the 8-bit branches. An 8-bit cache is not prefetched: its blocks
 * are a quarter of the size, and the dequantizing pass reads them in order. A bf16 cache is, as a
 * float32 one is. */
static inline __attribute__((always_inline)) void attend_head(const float* q, int64_t group, int64_t head_dim, const float* k_head, const float* v_head,
                        const int64_t* blocks, int64_t len, int64_t block_size, float scale,
                        float* out, float* lse, float* scores /* [group, len] */,
                        fp8_head k8, fp8_head v8, float* scratch /* [block_size, head_dim] when 8-bit */) {
    const int64_t block_numel = block_size * head_dim;
    const int64_t ahead = PREFETCH_DISTANCE * block_size;
    const int chunked = rows16(head_dim);
    const int bf16_weights = v8.head && v8.format == KV_BF16;
    const char *k_prefetch = prefetched_head(k_head, k8), *v_prefetch = prefetched_head(v_head, v8);
    const int64_t k_row_bytes = head_dim * (k8.head ? kv_element_bytes(k8.format) : (int64_t)sizeof(float));
    const int64_t v_row_bytes = head_dim * (v8.head ? kv_element_bytes(v8.format) : (int64_t)sizeof(float));
    (void)chunked;
    prefetch_first_blocks(k_prefetch, blocks, len, block_size, k_row_bytes);
    for (int64_t start = 0, j = 0; start < len; start += block_size, ++j) {
        const int64_t rows = len - start < block_size ? len - start : block_size;
        const float* keys = block_rows(k_head, k8, blocks, j, rows, block_numel, head_dim, scratch);
        const char* next = k_prefetch && start + ahead < len
                               ? k_prefetch + blocks[j + PREFETCH_DISTANCE] * block_size * k_row_bytes : NULL;
        int64_t t = 0;
#ifdef PAGEDLLM_ROWS16
        for (; chunked && t + ROWS16 <= rows; t += ROWS16) {
            for (int r = 0; r < ROWS16; ++r) prefetch_rows(next, t + r, k_row_bytes);
            scores16(q, group, head_dim, keys + t * head_dim, scale, scores + start + t, len);
        }
#endif
        for (; t < rows; ++t) {
            prefetch_rows(next, t, k_row_bytes);
            for (int64_t g = 0; g < group; ++g)
                scores[g * len + start + t] = dot(q + g * head_dim, keys + t * head_dim, head_dim) * scale;
        }
    }
    prefetch_first_blocks(v_prefetch, blocks, len, block_size, v_row_bytes);
    float inverses[group];
    for (int64_t g = 0; g < group; ++g) {
        float* s = scores + g * len;
        float max = -FLT_MAX;
#pragma omp simd reduction(max : max)
        for (int64_t t = 0; t < len; ++t) max = s[t] > max ? s[t] : max;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) {
            s[t] = exp_nonpositive(s[t] - max);
            sum += s[t];
        }
        const float inverse = 1.0f / sum;
        if (bf16_weights) {
#pragma omp simd
            for (int64_t t = 0; t < len; ++t) s[t] = round_to_bf16(s[t]);
        } else {
#pragma omp simd
            for (int64_t t = 0; t < len; ++t) s[t] *= inverse;
        }
        inverses[g] = inverse;
        lse[g] = max + logf(sum);
        for (int64_t d = 0; d < head_dim; ++d) out[g * head_dim + d] = 0.0f;
    }
    for (int64_t start = 0, j = 0; start < len; start += block_size, ++j) {
        const int64_t rows = len - start < block_size ? len - start : block_size;
        const float* values = block_rows(v_head, v8, blocks, j, rows, block_numel, head_dim, scratch);
        const char* next = v_prefetch && start + ahead < len
                               ? v_prefetch + blocks[j + PREFETCH_DISTANCE] * block_size * v_row_bytes : NULL;
        int64_t t = 0;
#ifdef PAGEDLLM_ROWS16
        for (; chunked && t + ROWS16 <= rows; t += ROWS16) {
            for (int r = 0; r < ROWS16; ++r) prefetch_rows(next, t + r, v_row_bytes);
            values16(scores + start + t, group, head_dim, values + t * head_dim, out, len);
        }
#endif
        for (; t < rows; ++t) {
            prefetch_rows(next, t, v_row_bytes);
            for (int64_t g = 0; g < group; ++g)
                add_scaled(out + g * head_dim, scores[g * len + start + t], values + t * head_dim, head_dim);
        }
    }
    if (bf16_weights)
        for (int64_t g = 0; g < group; ++g) {
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) out[g * head_dim + d] *= inverses[g];
        }
}

/* x's bf16 bits, rounded to nearest even; x finite. */
static inline uint16_t bf16_bits(float x) {
    x = round_to_bf16(x);
    uint32_t bits;
    __builtin_memcpy(&bits, &x, sizeof bits);
    return (uint16_t)(bits >> 16);
}

/* q: [tokens, kv_heads * group, head_dim] with token rows q_stride elements apart (a fused q|k|v output's q columns
 * are read in place); out: the same, dense; both float32, or bf16 with bf16_rows; lse: [tokens, kv_heads * group].
 * Sequence i's query is token rows[i]; it attends to the first lens[i] cache slots its block-table row lists.
 * A float32 cache passes k_cache/v_cache and NULL k8/v8; an 8-bit or bf16 one passes k8/v8 as bytes and its format.
 * bf16 rows are widened into float32 (exactly) before and rounded to bf16 (to nearest even, as torch's cast rounds)
 * after each (sequence, KV head), in the thread's scratch: the caller needs no float32 copies of them.
 * Returns 0, or 1 when the scratch buffer could not be allocated (out and lse are then undefined). */
static int paged_decode(const void* q, int64_t q_stride, const float* k_cache, const float* v_cache, const uint8_t* k8,
                        const uint8_t* v8, int format, float k_scale, float v_scale, const int64_t* rows,
                        const int64_t* block_table, int64_t table_width, const int64_t* lens, int64_t num_seqs,
                        int64_t kv_heads, int64_t group, int64_t head_dim, int64_t num_blocks, int64_t block_size,
                        float scale, int64_t max_len, int threads, void* out, float* lse, int bf16_rows) {
    int failed = 0;
    const int64_t heads = kv_heads * group;
    const int64_t head_numel = num_blocks * block_size * head_dim;
    const int64_t rows_numel = bf16_rows ? 2 * group * head_dim : 0; /* a query and an output, as float32 */
    const int64_t scratch_numel = (k8 ? block_size * head_dim : 0) + rows_numel;
    /* Threads take 4 (sequence, KV head) items at a time, so with 4 or fewer one thread does all the work:
     * then no team is formed, since joining one costs a wake-up of threads the serving side may be
     * holding the other CPUs with (a lone stream on a small host). */
#pragma omp parallel num_threads(threads) if (threads > 1 && num_seqs * kv_heads > 4) reduction(| : failed)
    {
        float* scores = malloc(sizeof(float) * (size_t)(group * (max_len > 0 ? max_len : 1) + scratch_numel));
        float* wide_rows = scores ? scores + group * (max_len > 0 ? max_len : 1) : NULL;
        float* scratch = wide_rows ? wide_rows + rows_numel : NULL;
        failed = scores == NULL;
#pragma omp for schedule(dynamic, 4)
        for (int64_t i = 0; i < num_seqs * kv_heads; ++i) {
            if (scores == NULL) continue;
            const int64_t seq = i / kv_heads, head = i % kv_heads;
            const int64_t offset = rows[seq] * heads + head * group;
            const int64_t q_offset = rows[seq] * q_stride + head * group * head_dim;
            const float* q_head = bf16_rows
                                      ? widen_bf16_block((const uint16_t*)q + q_offset, group * head_dim, wide_rows)
                                      : (const float*)q + q_offset;
            const float *k_head = k8 ? NULL : k_cache + head * head_numel, *v_head = v8 ? NULL : v_cache + head * head_numel;
            const int64_t head_bytes = head_numel * kv_element_bytes(format);
            const fp8_head k_bytes = {k8 ? k8 + head * head_bytes : NULL, format, k_scale};
            const fp8_head v_bytes = {v8 ? v8 + head * head_bytes : NULL, format, v_scale};
            const int64_t* blocks = block_table + seq * table_width;
            float *out_head = bf16_rows ? wide_rows + group * head_dim : (float*)out + offset * head_dim;
            float* lse_head = lse + offset;
            if (head_dim == 64)
                attend_head(q_head, group, 64, k_head, v_head, blocks, lens[seq], block_size, scale, out_head, lse_head,
                            scores, k_bytes, v_bytes, scratch);
            else if (head_dim == 128)
                attend_head(q_head, group, 128, k_head, v_head, blocks, lens[seq], block_size, scale, out_head, lse_head,
                            scores, k_bytes, v_bytes, scratch);
            else
                attend_head(q_head, group, head_dim, k_head, v_head, blocks, lens[seq], block_size, scale, out_head,
                            lse_head, scores, k_bytes, v_bytes, scratch);
            if (bf16_rows) {
                uint16_t* out_bf16 = (uint16_t*)out + offset * head_dim;
                for (int64_t d = 0; d < group * head_dim; ++d) out_bf16[d] = bf16_bits(out_head[d]);
            }
        }
        free(scores);
    }
    return failed;
}

int pagedllm_paged_decode_f32(const float* q, int64_t q_stride, const float* k_cache, const float* v_cache,
                              const int64_t* rows, const int64_t* block_table, int64_t table_width,
                              const int64_t* lens, int64_t num_seqs,
                              int64_t kv_heads, int64_t group, int64_t head_dim, int64_t num_blocks,
                              int64_t block_size, float scale, int64_t max_len, int threads,
                              float* out, float* lse) {
    return paged_decode(q, q_stride, k_cache, v_cache, NULL, NULL, 0, 1.0f, 1.0f, rows, block_table, table_width, lens,
                        num_seqs, kv_heads, group, head_dim, num_blocks, block_size, scale, max_len, threads, out, lse,
                        0);
}

/* pagedllm_paged_decode_f32 over 8-bit caches of one format (0: e4m3fn, 1: e5m2): a K byte stands for its
 * value in the format times k_scale, a V byte times v_scale. */
int pagedllm_paged_decode_fp8(const float* q, int64_t q_stride, const uint8_t* k_cache, const uint8_t* v_cache,
                              int format, float k_scale, float v_scale, const int64_t* rows, const int64_t* block_table,
                              int64_t table_width, const int64_t* lens, int64_t num_seqs, int64_t kv_heads,
                              int64_t group, int64_t head_dim, int64_t num_blocks, int64_t block_size, float scale,
                              int64_t max_len, int threads, float* out, float* lse) {
    return paged_decode(q, q_stride, NULL, NULL, k_cache, v_cache, format, k_scale, v_scale, rows, block_table,
                        table_width, lens, num_seqs, kv_heads, group, head_dim, num_blocks, block_size, scale, max_len,
                        threads, out, lse, 0);
}

/* pagedllm_paged_decode_f32 over bfloat16 caches (their bits as uint16), widened a block at a time, for bf16 queries
 * and outputs (bits as uint16 too); lse stays float32. */
int pagedllm_paged_decode_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* k_cache, const uint16_t* v_cache,
                               const int64_t* rows, const int64_t* block_table, int64_t table_width,
                               const int64_t* lens, int64_t num_seqs, int64_t kv_heads, int64_t group,
                               int64_t head_dim, int64_t num_blocks, int64_t block_size, float scale, int64_t max_len,
                               int threads, uint16_t* out, float* lse) {
    return paged_decode(q, q_stride, NULL, NULL, (const uint8_t*)k_cache, (const uint8_t*)v_cache, KV_BF16, 1.0f, 1.0f,
                        rows, block_table, table_width, lens, num_seqs, kv_heads, group, head_dim, num_blocks,
                        block_size, scale, max_len, threads, out, lse, 1);
}

/* The cache's write side: token t's key and value rows (kv_heads x head_dim, rows row_stride floats
 * apart, as in a fused qkv output) go to slot slots[t] of every head of the head-major caches;
 * a negative slot is a padded token and is skipped. Returns how many tokens were handled: num_tokens,
 * or the first token whose slot is past the caches (nothing of it or later is written). */
int64_t pagedllm_write_kv_f32(const float* key, const float* value, int64_t row_stride, const int64_t* slots,
                              int64_t num_tokens, int64_t kv_heads, int64_t head_dim, int64_t num_slots,
                              float* k_cache, float* v_cache) {
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        if (slot >= num_slots) return t;
        for (int64_t h = 0; h < kv_heads; ++h) {
            float* k_row = k_cache + (h * num_slots + slot) * head_dim;
            float* v_row = v_cache + (h * num_slots + slot) * head_dim;
            const float* k_new = key + t * row_stride + h * head_dim;
            const float* v_new = value + t * row_stride + h * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) {
                k_row[d] = k_new[d];
                v_row[d] = v_new[d];
            }
        }
    }
    return num_tokens;
}

/* pagedllm_write_kv_f32 for bf16 rows into bf16 caches (their bits as uint16): a copy. */
int64_t pagedllm_write_kv_bf16(const uint16_t* key, const uint16_t* value, int64_t row_stride, const int64_t* slots,
                               int64_t num_tokens, int64_t kv_heads, int64_t head_dim, int64_t num_slots,
                               uint16_t* k_cache, uint16_t* v_cache) {
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        if (slot >= num_slots) return t;
        for (int64_t h = 0; h < kv_heads; ++h) {
            __builtin_memcpy(k_cache + (h * num_slots + slot) * head_dim, key + t * row_stride + h * head_dim,
                             sizeof(uint16_t) * (size_t)head_dim);
            __builtin_memcpy(v_cache + (h * num_slots + slot) * head_dim, value + t * row_stride + h * head_dim,
                             sizeof(uint16_t) * (size_t)head_dim);
        }
    }
    return num_tokens;
}

/* x / scale in an 8-bit format (0: e4m3fn, 1: e5m2), as torch's cast does it: saturated at the format's
 * largest value, rounded to nearest, ties to even. A normal value rounds its float32 mantissa on the
 * integer bits (a carry moves the exponent); a subnormal one is a whole number of the smallest step. */
static inline uint8_t float_to_fp8(float x, int format) {
    const int e4m3 = format == FP8_E4M3FN;
    const float largest = e4m3 ? 448.0f : 57344.0f;
    const uint32_t mantissa_bits = e4m3 ? 3u : 2u, drop = 23u - mantissa_bits;
    x = x > largest ? largest : x < -largest ? -largest : x;
    uint32_t bits;
    __builtin_memcpy(&bits, &x, sizeof bits);
    const uint8_t sign = (uint8_t)((bits >> 24) & 0x80u);
    const float magnitude = fabsf(x);
    if (magnitude < (e4m3 ? 0x1p-6f : 0x1p-14f)) /* 2^(1 - bias): below it, steps of 2^(1 - bias - mantissa) */
        return sign | (uint8_t)nearbyintf(magnitude * (e4m3 ? 0x1p9f : 0x1p16f));
    uint32_t rounded = bits & 0x7FFFFFFFu;
    rounded = (rounded + ((1u << (drop - 1)) - 1u) + ((rounded >> drop) & 1u)) >> drop;
    const uint32_t exponent = (rounded >> mantissa_bits) - 127u + (e4m3 ? 7u : 15u);
    return sign | (uint8_t)((exponent << mantissa_bits) | (rounded & ((1u << mantissa_bits) - 1u)));
}

/* pagedllm_write_kv_f32 into 8-bit caches: each value divided by the layer's scale and quantized. */
int64_t pagedllm_write_kv_fp8(const float* key, const float* value, int64_t row_stride, const int64_t* slots,
                              int64_t num_tokens, int64_t kv_heads, int64_t head_dim, int64_t num_slots, int format,
                              float k_scale, float v_scale, uint8_t* k_cache, uint8_t* v_cache) {
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        if (slot >= num_slots) return t;
        for (int64_t h = 0; h < kv_heads; ++h) {
            uint8_t* k_row = k_cache + (h * num_slots + slot) * head_dim;
            uint8_t* v_row = v_cache + (h * num_slots + slot) * head_dim;
            const float* k_new = key + t * row_stride + h * head_dim;
            const float* v_new = value + t * row_stride + h * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) {
                k_row[d] = float_to_fp8(k_new[d] / k_scale, format);
                v_row[d] = float_to_fp8(v_new[d] / v_scale, format);
            }
        }
    }
    return num_tokens;
}
