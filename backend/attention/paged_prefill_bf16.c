/* bf16 prefill attention on AMX tiles, reading the paged bf16 KV cache where it lies.
 *
 * Built on first use by pagedllm/attention/native_prefill_bf16.py (cc -O3 -march=native) and called through
 * ctypes, beside paged_prefill.c (the float32 routine: same head-major caches, same work items, same causal
 * rule). Each sequence's chunk of query_len new tokens sits at the end of its seq_len tokens: query token i
 * sees every key at or before its own position.
 *
 * An item is (sequence, KV head, query tile): up to ROWS_PER_TILE query rows, the tile's tokens times the KV
 * head's group of query heads (GQA packed, every K and V row read once for the group). Both products run on
 * AMX tiles with float32 sums, in the transposed orientation that lets the cache be read in place:
 *   scores^T [keys][rows] = K [keys][head_dim] . Q^T: K rows are the A tile straight from the cache block, the
 *     queries are packed once per item into the B tile's pair-interleaved ("VNNI") layout;
 *   out^T [head_dim][rows] += V^T . P^T: V^T is packed once per (sequence, KV head) for all its query tiles,
 *     and P^T's VNNI layout is two consecutive key rows of the scores, interleaved, which the softmax writes.
 * The softmax is flash attention's online one, run on vectors of 16 rows (the columns of scores^T), in float32:
 * scores are scaled in float32, the probabilities summed in float32 and rounded to bf16 before they weigh V,
 * and each output rounded to bf16 once, as torch's bf16 SDPA does; and with SDPA's own exp, blocks of keys and
 * order of sums (sdpa_softmax_bf16.h), so that its outputs are SDPA's bits but for a few.
 *
 * Linux hands out AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM), which
 * pagedllm_prefill_bf16_ready makes once per process; a build without AMX (another CPU) reports 0 there and
 * the caller keeps torch's SDPA.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define HAVE_AMX 1
#include "../platform/amx_tiles.h"
#endif

#define ROWS_PER_TILE 128 /* query rows per item; a multiple of 32 (two 16-row tile columns) */
/* Keys per online-softmax step: torch's bf16 SDPA rescales once per 512 keys, and its probabilities round to bf16
 * relative to the running max of those blocks, so the same blocks give the same bits (sdpa_softmax_bf16.h). A
 * multiple of 32 (one bf16 tile's depth). */
#define KEYS_PER_TILE 512

static int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

#ifdef HAVE_AMX

#include "sdpa_softmax_bf16.h"

/* Tiles (amx_tiles.h's layout): 0-3 hold sums, 4-5 A operands, 6-7 B operands: a 2x2 block, each A and B tile
 * feeding two products. */

/* One thread's scratch for an item of rp (padded) rows: the queries as B tiles [head_dim / 2][rp] of bf16
 * pairs, the scores^T [KEYS_PER_TILE][rp], the probabilities^T as B tiles [KEYS_PER_TILE / 2][rp] of bf16
 * pairs, the sums out^T [head_dim][rp], per row the running max, sum and position. */
typedef struct {
    uint32_t *q_t, *p_t;
    float *s_t, *acc_t, *max, *sum;
    int32_t* positions;
} scratch_t;

/* scores^T for the key tile's groups of 16 keys (group g at keys[g], nk_groups of them) against all rp rows. */
static void tile_scores(const uint16_t* const* keys, int64_t groups, int64_t head_dim, const uint32_t* q_t,
                        int64_t rp, float* s_t) {
    const int64_t k_stride = head_dim * 2, q_stride = rp * 4, s_stride = rp * 4;
    for (int64_t g = 0; g < groups; g += 2) {
        const int second = g + 1 < groups;
        for (int64_t c = 0; c < rp; c += 32) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            _tile_zero(5);
            for (int64_t d = 0; d < head_dim; d += 32) {
                _tile_loadd(4, keys[g] + d, k_stride);
                if (second) _tile_loadd(5, keys[g + 1] + d, k_stride);
                _tile_loadd(6, q_t + (d / 2) * rp + c, q_stride);
                _tile_loadd(7, q_t + (d / 2) * rp + c + 16, q_stride);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
            _tile_stored(0, s_t + g * 16 * rp + c, s_stride);
            _tile_stored(1, s_t + g * 16 * rp + c + 16, s_stride);
            if (second) {
                _tile_stored(2, s_t + (g + 1) * 16 * rp + c, s_stride);
                _tile_stored(3, s_t + (g + 1) * 16 * rp + c + 16, s_stride);
            }
        }
    }
}

/* out^T += V^T . P^T over the key tile's first `depth` keys (a multiple of 32); v_t holds V^T with row
 * stride ld, already offset to the tile's first key. */
static void tile_values(const uint16_t* v_t, int64_t ld, int64_t depth, int64_t head_dim, const uint32_t* p_t,
                        int64_t rp, float* acc_t) {
    const int64_t a_stride = rp * 4, v_stride = ld * 2, p_stride = rp * 4;
    for (int64_t c = 0; c < rp; c += 32)
        for (int64_t d = 0; d < head_dim; d += 32) {
            float* acc = acc_t + d * rp + c;
            _tile_loadd(0, acc, a_stride);
            _tile_loadd(1, acc + 16, a_stride);
            _tile_loadd(2, acc + 16 * rp, a_stride);
            _tile_loadd(3, acc + 16 * rp + 16, a_stride);
            for (int64_t t = 0; t < depth; t += 32) {
                _tile_loadd(4, v_t + d * ld + t, v_stride);
                _tile_loadd(5, v_t + (d + 16) * ld + t, v_stride);
                _tile_loadd(6, p_t + (t / 2) * rp + c, p_stride);
                _tile_loadd(7, p_t + (t / 2) * rp + c + 16, p_stride);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
            _tile_stored(0, acc, a_stride);
            _tile_stored(1, acc + 16, a_stride);
            _tile_stored(2, acc + 16 * rp, a_stride);
            _tile_stored(3, acc + 16 * rp + 16, a_stride);
        }
}

/* Probabilities of key row t for every vector of rows: exp of the scaled scores less each row's max, zero where
 * `seen` (one mask per vector, NULL when every row sees the key) says a row does not see it; added to the
 * running sums `sums` (one per vector). */
static inline __attribute__((always_inline)) void key_probabilities(const float* s, int64_t vectors,
                                                                     const __m512* maxes, __m512 scales,
                                                                     const __mmask16* seen, int library, __m512* sums,
                                                                     __m512* p) {
    for (int64_t v = 0; v < vectors; ++v) {
        const __mmask16 mask = seen ? seen[v] : 0xffff;
        const __m512 x = _mm512_sub_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(mask, s + v * 16), scales), maxes[v]);
        p[v] = _mm512_maskz_mov_ps(mask, library ? expf16(x) : exp16(x));
        sums[v] = _mm512_add_ps(sums[v], p[v]);
    }
}

/* The online softmax over a key tile of `keys` keys from position `start`: the probabilities^T written as bf16
 * pairs up to `depth` keys (zero where a row does not see the key), the sums and the output's running rescaled.
 * Keys from the tile's `library_from` on take expf (see expf16); the first `all_seen` keys are seen by every row,
 * so they skip the causal mask. Key rows are walked in order, each row of scores once per pass, with one
 * running max and sums per vector of 16 rows. */
static void tile_softmax(const scratch_t* w, int64_t rp, int64_t head_dim, int64_t start, int64_t keys,
                         int64_t depth, int64_t library_from, int64_t all_seen, float scale) {
    enum { MAX_VECTORS = ROWS_PER_TILE / 16 };
    /* interleaves two converted rows [a0..a15, b0..b15] into [a0, b0, a1, b1, ...] */
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                           22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512 scales = _mm512_set1_ps(scale);
    const int64_t vectors = rp / 16;
    __m512i row_pos[MAX_VECTORS];
    __m512 old_max[MAX_VECTORS], new_max[MAX_VECTORS];
    for (int64_t v = 0; v < vectors; ++v) {
        row_pos[v] = _mm512_loadu_si512(w->positions + v * 16);
        old_max[v] = _mm512_loadu_ps(w->max + v * 16);
        new_max[v] = _mm512_set1_ps(-INFINITY);
    }
    for (int64_t t = 0; t < keys; ++t) {
        const float* s = w->s_t + t * rp;
        for (int64_t v = 0; v < vectors; ++v) {
            const __mmask16 seen =
                t < all_seen ? 0xffff : _mm512_cmpge_epi32_mask(row_pos[v], _mm512_set1_epi32((int32_t)(start + t)));
            new_max[v] = _mm512_mask_max_ps(new_max[v], seen, new_max[v], _mm512_loadu_ps(s + v * 16));
        }
    }
    for (int64_t v = 0; v < vectors; ++v) new_max[v] = _mm512_max_ps(old_max[v], _mm512_mul_ps(new_max[v], scales));
    /* running sums j (keys congruent to j mod 32) of vector v at partial[j * vectors + v] */
    __m512 partial[32 * MAX_VECTORS], tail[16 * MAX_VECTORS];
    for (int64_t j = 0; j < 32 * vectors; ++j) partial[j] = _mm512_setzero_ps();
    for (int64_t j = 0; j < 16 * vectors; ++j) tail[j] = _mm512_setzero_ps();
    int64_t tail_keys = 0;
    for (int64_t t = 0; t < depth; t += 2) {
        __m512 p[2][MAX_VECTORS];
        for (int i = 0; i < 2; ++i) {
            const int64_t key = t + i;
            __mmask16 seen[MAX_VECTORS];
            const int masked = key >= all_seen;
            for (int64_t v = 0; masked && v < vectors; ++v)
                seen[v] = key < keys ? _mm512_cmpge_epi32_mask(row_pos[v], _mm512_set1_epi32((int32_t)(start + key)))
                                     : 0;
            const int library = key >= library_from;
            /* keys past `keys` (up to depth) and library-exp keys that no row reads are zero and summed nowhere */
            __m512* sums = !library ? partial + (key & 31) * vectors : key < keys ? tail + tail_keys++ * vectors
                                                                                 : tail + 15 * vectors;
            /* spelled out per case so that the common one (every row sees the key, fast exp) inlines unmasked */
            if (!masked && !library)
                key_probabilities(w->s_t + key * rp, vectors, new_max, scales, NULL, 0, sums, p[i]);
            else
                key_probabilities(w->s_t + key * rp, vectors, new_max, scales, masked ? seen : NULL, library, sums,
                                  p[i]);
        }
        for (int64_t v = 0; v < vectors; ++v) {
            const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p[1][v], p[0][v]);
            _mm512_storeu_si512(w->p_t + (t / 2) * rp + v * 16, _mm512_permutexvar_epi16(pairs, both));
        }
    }
    for (int64_t v = 0; v < vectors; ++v) {
        const __m512 sum = torch_order_sum(partial + v, tail + v, tail_keys, vectors);
        /* every row sees key 0 in the first tile, so old_max is -inf only there, where nothing is to rescale */
        float olds[16], news[16], factors[16];
        _mm512_storeu_ps(olds, old_max[v]);
        _mm512_storeu_ps(news, new_max[v]);
        for (int i = 0; i < 16; ++i) factors[i] = olds[i] == -INFINITY ? 0.0f : expf(olds[i] - news[i]);
        const __m512 correction = _mm512_loadu_ps(factors);
        _mm512_storeu_ps(w->sum + v * 16, _mm512_fmadd_ps(_mm512_loadu_ps(w->sum + v * 16), correction, sum));
        _mm512_storeu_ps(w->max + v * 16, new_max[v]);
        for (int64_t d = 0; d < head_dim; ++d) {
            float* a = w->acc_t + d * rp + v * 16;
            _mm512_storeu_ps(a, _mm512_mul_ps(_mm512_loadu_ps(a), correction));
        }
    }
}

/* Transposes 16 rows of 16 32-bit lanes in place (r[i] lane j becomes r[j] lane i): pairs of lanes, then pairs
 * of pairs within each 128-bit quarter, then the quarters. The packing of queries and the output go through it:
 * scattering or gathering lanes rp floats apart instead ran several times slower. */
static inline void transpose16(__m512i r[16]) {
    __m512i a[16], b[16], c[4][4];
    for (int k = 0; k < 16; k += 2) {
        a[k] = _mm512_unpacklo_epi32(r[k], r[k + 1]);
        a[k + 1] = _mm512_unpackhi_epi32(r[k], r[k + 1]);
    }
    /* b[4k + e], quarter L: rows 4k..4k+3, lane 4L + e */
    for (int k = 0; k < 16; k += 4) {
        b[k] = _mm512_unpacklo_epi64(a[k], a[k + 2]);
        b[k + 1] = _mm512_unpackhi_epi64(a[k], a[k + 2]);
        b[k + 2] = _mm512_unpacklo_epi64(a[k + 1], a[k + 3]);
        b[k + 3] = _mm512_unpackhi_epi64(a[k + 1], a[k + 3]);
    }
    for (int e = 0; e < 4; ++e) {
        c[e][0] = _mm512_shuffle_i32x4(b[e], b[4 + e], 0x44);
        c[e][1] = _mm512_shuffle_i32x4(b[e], b[4 + e], 0xEE);
        c[e][2] = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], 0x44);
        c[e][3] = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], 0xEE);
    }
    for (int e = 0; e < 4; ++e) {
        r[e] = _mm512_shuffle_i32x4(c[e][0], c[e][2], 0x88);
        r[4 + e] = _mm512_shuffle_i32x4(c[e][0], c[e][2], 0xDD);
        r[8 + e] = _mm512_shuffle_i32x4(c[e][1], c[e][3], 0x88);
        r[12 + e] = _mm512_shuffle_i32x4(c[e][1], c[e][3], 0xDD);
    }
}

/* One item: query tokens [first, first + tokens) of a sequence (rows of q / out, positions first_pos..), one KV
 * head's group, reading K from k_head's blocks and V^T from v_t (row stride ld). */
static void prefill_item(const uint16_t* q, int64_t q_stride, uint16_t* out, int64_t heads, int64_t group,
                         int64_t head_dim, int64_t head, const uint16_t* k_head, const uint16_t* v_t, int64_t ld,
                         const int64_t* blocks, int64_t block_size, int64_t first, int64_t tokens, int64_t first_pos,
                         int64_t seq_len, float scale, scratch_t* w) {
    const int64_t rows = tokens * group, rp = round_up(rows, 32), words = head_dim / 2;
    const int64_t last_pos = first_pos + tokens - 1;
    /* word i of row r goes to q_t[i * rp + r], 16 rows by 16 words at a time */
    for (int64_t r0 = 0; r0 < rp; r0 += 16)
        for (int64_t i0 = 0; i0 < words; i0 += 16) {
            __m512i block[16];
            for (int j = 0; j < 16; ++j) {
                /* padding rows are zero queries at the last row's position; their results are dropped */
                const int64_t r = r0 + j;
                const uint16_t* row = q + (first + r / group) * q_stride + (head * group + r % group) * head_dim;
                block[j] = r < rows ? _mm512_loadu_si512(row + 2 * i0) : _mm512_setzero_si512();
            }
            transpose16(block);
            for (int j = 0; j < 16; ++j) _mm512_storeu_si512(w->q_t + (i0 + j) * rp + r0, block[j]);
        }
    for (int64_t r = 0; r < rp; ++r) {
        w->positions[r] = (int32_t)(first_pos + (r < rows ? r : rows - 1) / group);
        w->max[r] = -INFINITY;
        w->sum[r] = 0.0f;
    }
    memset(w->acc_t, 0, sizeof(float) * (size_t)(head_dim * rp));
    const uint16_t* keys[KEYS_PER_TILE / 16];
    for (int64_t start = 0; start <= last_pos; start += KEYS_PER_TILE) {
        /* keys past the item's last position are seen by no row: neither read nor scored */
        const int64_t n = last_pos + 1 - start < KEYS_PER_TILE ? last_pos + 1 - start : KEYS_PER_TILE;
        const int64_t groups = (n + 15) / 16, depth = round_up(n, 32);
        for (int64_t g = 0; g < groups; ++g) {
            const int64_t key = start + g * 16; /* a group of 16 keys never straddles blocks (block_size % 16 == 0) */
            keys[g] = k_head + (blocks[key / block_size] * block_size + key % block_size) * head_dim;
        }
        tile_scores(keys, groups, head_dim, w->q_t, rp, w->s_t);
        /* torch's SDPA splits the sequence's seq_len keys into blocks of KEYS_PER_TILE and takes expf past the
         * last whole 16 of each block */
        const int64_t block_keys = seq_len - start < KEYS_PER_TILE ? seq_len - start : KEYS_PER_TILE;
        const int64_t all_seen = first_pos + 1 - start < n ? first_pos + 1 - start : n; /* rows start at first_pos */
        tile_softmax(w, rp, head_dim, start, n, depth, block_keys / 16 * 16, all_seen, scale);
        tile_values(v_t + start, ld, depth, head_dim, w->p_t, rp, w->acc_t);
    }
    /* out^T's column r is row r of the output: 16 dimensions by 16 rows at a time, scaled by each row's 1 / sum
     * (as torch's SDPA does, a product by the reciprocal), transposed, rounded to bf16 */
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const __m512 inverse = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_loadu_ps(w->sum + r0));
        for (int64_t d0 = 0; d0 < head_dim; d0 += 16) {
            __m512i block[16];
            for (int j = 0; j < 16; ++j)
                block[j] = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(w->acc_t + (d0 + j) * rp + r0), inverse));
            transpose16(block);
            for (int j = 0; j < 16 && r0 + j < rows; ++j) {
                const int64_t r = r0 + j;
                uint16_t* out_row = out + ((first + r / group) * heads + head * group + r % group) * head_dim;
                const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_castsi512_ps(block[j]));
                _mm256_storeu_si256((__m256i*)(out_row + d0), (__m256i)rounded);
            }
        }
    }
}

/* V^T of one sequence's first seq_len keys of one KV head: [head_dim][ld] bf16, zero past seq_len. ld is seq_len
 * rounded up to 32, the depth of the products' last key group (a tile's keys start at multiples of 32). */
static void pack_values(const uint16_t* v_head, const int64_t* blocks, int64_t block_size, int64_t seq_len,
                        int64_t head_dim, int64_t ld, uint16_t* v_t) {
    for (int64_t d = 0; d < head_dim; ++d) memset(v_t + d * ld + seq_len, 0, (size_t)(ld - seq_len) * 2);
    /* 16 keys at a time (a group never straddles blocks): dimensions d and d + 1 of the 16 rows gathered as one
     * 32-bit word each, split into the two bf16 rows of V^T */
    const __m512i row_offsets = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2,
                                                                    1, 0), _mm512_set1_epi32((int32_t)head_dim * 2));
    for (int64_t t = 0; t < seq_len; t += 16) {
        const uint16_t* rows = v_head + (blocks[t / block_size] * block_size + t % block_size) * head_dim;
        const __mmask16 real = seq_len - t >= 16 ? 0xffff : (__mmask16)((1u << (seq_len - t)) - 1);
        for (int64_t d = 0; d < head_dim; d += 2) {
            const __m512i pairs = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), real, row_offsets, rows + d, 1);
            _mm256_mask_storeu_epi16(v_t + d * ld + t, real, _mm512_cvtepi32_epi16(pairs));
            _mm256_mask_storeu_epi16(v_t + (d + 1) * ld + t, real, _mm512_cvtepi32_epi16(_mm512_srli_epi32(pairs, 16)));
        }
    }
}

int pagedllm_prefill_bf16_ready(void) {
    static int ready = -1;
    if (ready < 0) ready = amx_tile_data_granted();
    return ready;
}

/* q: bf16 rows [tokens][kv_heads * group][head_dim] at a row stride of q_stride elements (heads dense);
 * out: bf16 [tokens][kv_heads * group][head_dim], contiguous; caches: bf16 head-major
 * [kv_heads][num_blocks][block_size][head_dim]. Sequence i's query_lens[i] tokens are rows starts[i].. and the
 * last of its seq_lens[i] positions; it reads the first seq_lens[i] slots its block-table row lists.
 * head_dim must be a multiple of 32 and at most 512, block_size a multiple of 16, and pagedllm_prefill_bf16_ready
 * must have returned 1. Returns 0, or 1 when scratch could not be allocated (out is then undefined). */
int pagedllm_paged_prefill_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* k_cache,
                                const uint16_t* v_cache, const int64_t* starts, const int64_t* query_lens,
                                const int64_t* seq_lens, const int64_t* block_table, int64_t table_width,
                                int64_t num_seqs, int64_t kv_heads, int64_t group, int64_t head_dim, int64_t num_blocks,
                                int64_t block_size, float scale, int threads, uint16_t* out) {
    const int64_t heads = kv_heads * group, head_numel = num_blocks * block_size * head_dim;
    const int64_t tile_tokens = ROWS_PER_TILE / group > 0 ? ROWS_PER_TILE / group : 1;
    const int64_t rp_max = round_up(tile_tokens * group, 32);
    int64_t tiles = 0, packed = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
        tiles += (query_lens[s] + tile_tokens - 1) / tile_tokens;
        packed += round_up(seq_lens[s], 32);
    }
    int64_t* index = malloc(sizeof(int64_t) * (size_t)(2 * tiles + num_seqs + 1));
    uint16_t* v_t = malloc(sizeof(uint16_t) * (size_t)(kv_heads * packed * head_dim + 1));
    if (!index || !v_t) {
        free(index);
        free(v_t);
        return 1;
    }
    int64_t *tile_first = index, *tile_seq = index + tiles, *v_offset = index + 2 * tiles;
    for (int64_t s = 0, t = 0, offset = 0; s < num_seqs; ++s) {
        v_offset[s] = offset;
        offset += round_up(seq_lens[s], 32) * head_dim;
        for (int64_t first = 0; first < query_lens[s]; first += tile_tokens, ++t) {
            tile_first[t] = first;
            tile_seq[t] = s;
        }
    }
    const int64_t head_packed = packed * head_dim;
    int failed = 0;
    const size_t bytes = sizeof(float) * (size_t)(rp_max * (head_dim / 2 + KEYS_PER_TILE / 2 + KEYS_PER_TILE
                                                            + head_dim + 3));
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(| : failed)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_seqs * kv_heads; ++i) {
            const int64_t s = i / kv_heads, head = i % kv_heads, ld = round_up(seq_lens[s], 32);
            pack_values(v_cache + head * head_numel, block_table + s * table_width, block_size, seq_lens[s], head_dim,
                        ld, v_t + head * head_packed + v_offset[s]);
        }
        char* memory = malloc(bytes);
        scratch_t w = {0};
        if (memory) {
            w.q_t = (uint32_t*)memory;
            w.p_t = w.q_t + rp_max * head_dim / 2;
            w.s_t = (float*)(w.p_t + rp_max * KEYS_PER_TILE / 2);
            w.acc_t = w.s_t + rp_max * KEYS_PER_TILE;
            w.max = w.acc_t + rp_max * head_dim;
            w.sum = w.max + rp_max;
            w.positions = (int32_t*)(w.sum + rp_max);
            amx_configure_tiles();
        }
        failed = !memory;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < tiles * kv_heads; ++i) {
            if (failed) continue;
            /* last tiles first: they see the most context, so the dynamic schedule balances better */
            const int64_t tile = tiles - 1 - i / kv_heads, head = i % kv_heads, seq = tile_seq[tile];
            const int64_t first = tile_first[tile];
            const int64_t tokens = query_lens[seq] - first < tile_tokens ? query_lens[seq] - first : tile_tokens;
            const int64_t first_pos = seq_lens[seq] - query_lens[seq] + first;
            prefill_item(q, q_stride, out, heads, group, head_dim, head, k_cache + head * head_numel,
                         v_t + head * head_packed + v_offset[seq], round_up(seq_lens[seq], 32),
                         block_table + seq * table_width, block_size, starts[seq] + first, tokens, first_pos,
                         seq_lens[seq], scale, &w);
        }
        if (memory) _tile_release();
        free(memory);
    }
    free(index);
    free(v_t);
    return failed;
}

#else /* no AMX in this build: the caller keeps torch's SDPA */

int pagedllm_prefill_bf16_ready(void) { return 0; }

int pagedllm_paged_prefill_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* k_cache,
                                const uint16_t* v_cache, const int64_t* starts, const int64_t* query_lens,
                                const int64_t* seq_lens, const int64_t* block_table, int64_t table_width,
                                int64_t num_seqs, int64_t kv_heads, int64_t group, int64_t head_dim, int64_t num_blocks,
                                int64_t block_size, float scale, int threads, uint16_t* out) {
    (void)q, (void)q_stride, (void)k_cache, (void)v_cache, (void)starts, (void)query_lens, (void)seq_lens;
    (void)block_table, (void)table_width, (void)num_seqs, (void)kv_heads, (void)group, (void)head_dim;
    (void)num_blocks, (void)block_size, (void)scale, (void)threads, (void)out;
    return 1;
}

#endif
