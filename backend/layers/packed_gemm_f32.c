/* A float32 GEMM on a weight packed once at load time, for CPUs with AVX2 and FMA: out = x W^T.
 *
 * Built and loaded by native_gemm.py through ctypes. It exists because, on an AVX2-only CPU, oneDNN's
 * float32 GEMM runs the few-row products of a decode step well below both the core's FMA rate and its
 * memory bandwidth; how it compares is in RESULTS.md, and cpu_linear.py says where it is the default.
 *
 * The packed weight is a sequence of panels of 16 output columns. Panel p holds W[16p + c][k] at
 * (p * K + k) * 16 + c, so the 16 columns of one k are one 64-byte line, and a panel's K lines follow each
 * other. Columns past N are zero, so every panel is whole.
 *
 * The inner kernel is the usual register tile: up to 6 rows by 16 columns in twelve 8-lane accumulators,
 * fed by a 6-wide packed copy of x's rows. Each sum runs over k in order, in 256-long chunks that are
 * added to the output in order.
 *
 * Two loop orders, by the number of rows:
 * - up to SMALL_ROWS (decode steps): x is packed whole, and each thread walks its own panels from first
 *   to last, so the weight streams from memory once, in order, and each 16-column chunk of it is
 *   reused from L1 by every 6-row block of x. Up to 5 rows, a tile runs several panels side by side
 *   (PANELS_AT_ONCE): with so few FMAs per weight line, one panel's stream leaves the core waiting on
 *   memory, and several streams in flight read the weight faster. From 6 rows, the first 6-row block of
 *   each chunk asks for the next chunk into L2 while it multiplies.
 * - more rows (prefill chunks): the GotoBLAS order. For each 256-long k chunk, each run of 64 of a
 *   thread's panels and each 96-row block of x, that block is packed (it then sits in L2) and run
 *   against those panels, whose chunks stay in cache across the row blocks.
 * Threads split the panels, so no two write the same output column.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define NR 16         /* columns per panel: two 8-lane vectors */
#define MR 6          /* rows per register tile: 12 accumulators, 2 weight vectors and 1 broadcast fit 16 registers */
#define KC 256        /* k per chunk: a panel's chunk is 16 KiB, so it stays in L1 while the row blocks reuse it */
#define MC 96         /* rows per packed block of x in the large-row order: 96 KiB per chunk, in L2 */
#define NC 64         /* panels run against one packed block before the next: 1 MiB of a weight chunk */
#define SMALL_ROWS 64 /* at most this many rows take the small-row order */

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* W [n, k] row-major into panels; columns past n are zero. */
void pagedllm_gemm_pack_f32(const float* weight, int64_t n, int64_t k, float* packed, int threads) {
    int64_t panels = (n + NR - 1) / NR;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int c = 0; c < NR; c++) {
                int64_t column = p * NR + c;
                packed[(p * k + kk) * NR + c] = column < n ? weight[column * k + kk] : 0.0f;
            }
}

/* x rows [first, first + rows) and k range [k0, k0 + kc) into 6-row blocks, each kc lines of 6 floats;
 * a last partial block is padded with zeros, which the kernel never reads. */
static void pack_rows(const float* x, int64_t k, int64_t first, int64_t rows, int64_t k0, int64_t kc, float* dst) {
    for (int64_t block = 0; block * MR < rows; block++) {
        int64_t valid = min64(MR, rows - block * MR);
        float* out = dst + block * MR * kc;
        for (int64_t kk = 0; kk < kc; kk++)
            for (int r = 0; r < MR; r++)
                out[kk * MR + r] = r < valid ? x[(first + block * MR + r) * k + k0 + kk] : 0.0f;
    }
}

/* R rows (a constant in each instance, so the accumulators stay in registers) of 16 columns over kc:
 * out (row stride ldo) = (add ? out : 0) + a . b, writing only the first `columns` columns. Where `ahead`
 * is not NULL, it also asks for kc lines from there into L2, one per k. */
#define TILE(R)                                                                                               \
    static void tile_##R(int64_t kc, const float* a, const float* b, float* out, int64_t ldo, int add,      \
                         int columns, const float* ahead) {                                                    \
        __m256 lo[R], hi[R];                                                                                  \
        /* A prefill's output is too big for the caches and is read back once per k chunk: asked for now,   \
         * its lines arrive while the k loop runs instead of stalling the adds and stores after it. */       \
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                                                 \
            _mm_prefetch((const char*)(out + r * ldo), _MM_HINT_T0);                                          \
            _mm_prefetch((const char*)(out + r * ldo + NR - 1), _MM_HINT_T0);                                 \
        }                                                                                                     \
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm256_setzero_ps();             \
        for (int64_t kk = 0; kk < kc; kk++) {                                                                 \
            if (ahead != NULL)                                                                                \
                _mm_prefetch((const char*)(ahead + kk * NR), _MM_HINT_T1);                                    \
            __m256 b0 = _mm256_loadu_ps(b + kk * NR), b1 = _mm256_loadu_ps(b + kk * NR + 8);                    \
            _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                                             \
                __m256 ar = _mm256_broadcast_ss(a + kk * MR + r);                                             \
                lo[r] = _mm256_fmadd_ps(ar, b0, lo[r]);                                                       \
                hi[r] = _mm256_fmadd_ps(ar, b1, hi[r]);                                                       \
            }                                                                                                 \
        }                                                                                                     \
        if (columns == NR) {                                                                                  \
            _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                                             \
                float* row = out + r * ldo;                                                                   \
                if (add) {                                                                                    \
                    lo[r] = _mm256_add_ps(_mm256_loadu_ps(row), lo[r]);                                       \
                    hi[r] = _mm256_add_ps(_mm256_loadu_ps(row + 8), hi[r]);                                   \
                }                                                                                             \
                _mm256_storeu_ps(row, lo[r]);                                                                 \
                _mm256_storeu_ps(row + 8, hi[r]);                                                             \
            }                                                                                                 \
            return;                                                                                           \
        }                                                                                                     \
        /* Unrolled too, or indexing lo[r] with a variable r makes gcc keep them in memory. */               \
        float spill[NR] __attribute__((aligned(32)));                                                         \
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                                                 \
            _mm256_store_ps(spill, lo[r]);                                                                    \
            _mm256_store_ps(spill + 8, hi[r]);                                                                \
            float* row = out + r * ldo;                                                                       \
            for (int c = 0; c < columns; c++) row[c] = add ? row[c] + spill[c] : spill[c];                    \
        }                                                                                                     \
    }
TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6)

static void tile(int rows, int64_t kc, const float* a, const float* b, float* out, int64_t ldo, int add,
                 int columns, const float* ahead) {
    switch (rows) {
    case 1: tile_1(kc, a, b, out, ldo, add, columns, ahead); break;
    case 2: tile_2(kc, a, b, out, ldo, add, columns, ahead); break;
    case 3: tile_3(kc, a, b, out, ldo, add, columns, ahead); break;
    case 4: tile_4(kc, a, b, out, ldo, add, columns, ahead); break;
    case 5: tile_5(kc, a, b, out, ldo, add, columns, ahead); break;
    default: tile_6(kc, a, b, out, ldo, add, columns, ahead); break;
    }
}

/* R rows (1 to 5) against P whole panels side by side over kc, panel j at b + j * panel_stride:
 * out (row stride ldo) = (add ? out : 0) + a . b. The same sums in the same order as tile(), so a row's
 * output does not depend on the loop that computed it. From 3 rows on, the 2 * R * P accumulators
 * outnumber the registers and some live in L1; while the weight comes from memory that costs less than
 * the streams gain. */
#define PANELS_TILE(R, P)                                                                                     \
    static void panels_##R(int64_t kc, const float* a, const float* b, int64_t panel_stride, float* out,     \
                           int64_t ldo, int add) {                                                            \
        __m256 lo[P][R], hi[P][R];                                                                            \
        _Pragma("GCC unroll 6") for (int j = 0; j < P; j++)                                                   \
            _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) lo[j][r] = hi[j][r] = _mm256_setzero_ps();   \
        for (int64_t kk = 0; kk < kc; kk++) {                                                                 \
            _Pragma("GCC unroll 6") for (int j = 0; j < P; j++) {                                             \
                __m256 b0 = _mm256_loadu_ps(b + j * panel_stride + kk * NR);                                  \
                __m256 b1 = _mm256_loadu_ps(b + j * panel_stride + kk * NR + 8);                              \
                _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                                         \
                    __m256 ar = _mm256_broadcast_ss(a + kk * MR + r);                                         \
                    lo[j][r] = _mm256_fmadd_ps(ar, b0, lo[j][r]);                                             \
                    hi[j][r] = _mm256_fmadd_ps(ar, b1, hi[j][r]);                                             \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
        _Pragma("GCC unroll 6") for (int j = 0; j < P; j++)                                                   \
            _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                                             \
                float* row = out + r * ldo + j * NR;                                                          \
                if (add) {                                                                                    \
                    lo[j][r] = _mm256_add_ps(_mm256_loadu_ps(row), lo[j][r]);                                 \
                    hi[j][r] = _mm256_add_ps(_mm256_loadu_ps(row + 8), hi[j][r]);                             \
                }                                                                                             \
                _mm256_storeu_ps(row, lo[j][r]);                                                              \
                _mm256_storeu_ps(row + 8, hi[j][r]);                                                          \
            }                                                                                                 \
    }
PANELS_TILE(1, 6) PANELS_TILE(2, 3) PANELS_TILE(3, 3) PANELS_TILE(4, 3) PANELS_TILE(5, 2)

/* Panels a small-row tile runs side by side, by the number of rows: the P of each PANELS_TILE above, and 1
 * (the register tile alone) at 6 rows and for blocks of a larger x, where more accumulators cost more
 * than the streams gain (RESULTS.md says what was measured). */
static const int PANELS_AT_ONCE[MR + 1] = {1, 6, 3, 3, 3, 2, 1};

/* All `rows` (at most 5) rows of x, packed for k range [k0, k0 + kc) at a, against PANELS_AT_ONCE[rows]
 * whole panels from panel p. */
static void panel_group(int rows, int64_t kc, const float* a, const float* packed, int64_t k, int64_t k0,
                        int64_t n, int64_t p, float* out) {
    const float* b = packed + (p * k + k0) * NR;
    out += p * NR;
    switch (rows) {
    case 1: panels_1(kc, a, b, k * NR, out, n, k0 > 0); break;
    case 2: panels_2(kc, a, b, k * NR, out, n, k0 > 0); break;
    case 3: panels_3(kc, a, b, k * NR, out, n, k0 > 0); break;
    case 4: panels_4(kc, a, b, k * NR, out, n, k0 > 0); break;
    default: panels_5(kc, a, b, k * NR, out, n, k0 > 0); break;
    }
}

/* Rows [first, first + rows) of x, packed for k range [k0, k0 + kc) at a, against panels [p0, p1).
 * With fetch_next, the first 6-row block asks for the weight's next kc lines (the panel's next chunk, or the
 * next panel's first) while it multiplies: in the small-row order a chunk is used only a few times, and the
 * first block would otherwise stall on the memory after the one stream the hardware prefetches. */
static void row_block(const float* a, int64_t first, int64_t rows, int64_t k, int64_t k0, int64_t kc,
                      const float* packed, int64_t n, int64_t p0, int64_t p1, float* out, int fetch_next) {
    for (int64_t p = p0; p < p1; p++) {
        int columns = (int)min64(NR, n - p * NR);
        const float* b = packed + (p * k + k0) * NR;
        const float* next = fetch_next && (k0 + kc < k || (p + 1) * NR < n) ? b + kc * NR : NULL;
        for (int64_t r = 0; r < rows; r += MR)
            tile((int)min64(MR, rows - r), kc, a + r * kc, b, out + (first + r) * n + p * NR, n, k0 > 0, columns,
                 r == 0 ? next : NULL);
    }
}

/* out [m, n] = x [m, k] W^T, W packed by pagedllm_gemm_pack_f32; every array contiguous.
 * Returns 0, or -1 when scratch memory cannot be had (out is then undefined). */
int pagedllm_gemm_f32(const float* x, int64_t m, int64_t k, const float* packed, int64_t n, float* out, int threads) {
    int64_t panels = (n + NR - 1) / NR, chunks = (k + KC - 1) / KC;
    if (m <= 0 || n <= 0)
        return 0;
    if (m <= SMALL_ROWS) {
        /* Packed as 6-row blocks of each k chunk in turn, so chunk c of block b starts at (c * blocks + b). */
        int64_t blocks = (m + MR - 1) / MR;
        float* a = aligned_alloc(64, (size_t)(blocks * MR * chunks * KC) * sizeof(float));
        if (a == NULL)
            return -1;
#pragma omp parallel num_threads(threads) if (threads > 1)
        {
#pragma omp for schedule(static)
            for (int64_t c = 0; c < chunks; c++)
                pack_rows(x, k, 0, m, c * KC, min64(KC, k - c * KC), a + c * blocks * MR * KC);
            int64_t group = m <= MR ? PANELS_AT_ONCE[m] : 1, groups = (panels + group - 1) / group;
#pragma omp for schedule(static)
            for (int64_t g = 0; g < groups; g++) {
                int64_t p = g * group, q = min64(p + group, panels);
                for (int64_t c = 0; c < chunks; c++) {
                    int64_t k0 = c * KC, kc = min64(KC, k - k0);
                    /* A last group short of panels, or with a partial panel, takes the register tile; only
                     * where it runs alone does it ask for the next chunk (the groups keep streams in flight). */
                    if (group > 1 && q - p == group && q * NR <= n)
                        panel_group((int)m, kc, a + c * blocks * MR * KC, packed, k, k0, n, p, out);
                    else
                        row_block(a + c * blocks * MR * KC, 0, m, k, k0, kc, packed, n, p, q, out, group == 1);
                }
            }
        }
        free(a);
        return 0;
    }
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(| : failed)
    {
        int thread = 0, team = 1;
#ifdef _OPENMP
        thread = omp_get_thread_num();
        team = omp_get_num_threads();
#endif
        int64_t p0 = panels * thread / team, p1 = panels * (thread + 1) / team;
        float* a = aligned_alloc(64, (size_t)MC * KC * sizeof(float));
        if (a == NULL)
            failed = 1;
        for (int64_t c = 0; a != NULL && c < chunks && p0 < p1; c++) {
            int64_t k0 = c * KC, kc = min64(KC, k - k0);
            for (int64_t j0 = p0; j0 < p1; j0 += NC)
                for (int64_t first = 0; first < m; first += MC) {
                    int64_t rows = min64(MC, m - first);
                    pack_rows(x, k, first, rows, k0, kc, a);
                    row_block(a, first, rows, k, k0, kc, packed, n, j0, min64(j0 + NC, p1), out, 0);
                }
        }
        free(a);
    }
    return failed ? -1 : 0;
}
