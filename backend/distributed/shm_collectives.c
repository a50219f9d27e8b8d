/* The flag handshake and the arithmetic of the shared-memory collectives for CPU ranks on one host.
 *
 * Built on first use by pagedllm/distributed/shm_group.py and called through ctypes; the segment
 * itself is created, mapped and laid out there. Python has no atomics, which is why the flags live
 * here: C11 release stores and acquire loads order a rank's data against its flag on every CPU.
 *
 * Layout of the segment (offsets computed by the Python side and passed in as pointers):
 *   one control block per rank, each on its own 128 bytes (no two ranks write one cache line pair):
 *     posted      the last round whose data this rank has put in its slot (release store)
 *     nbytes[2]   the bytes it posted in the rounds of each parity, to catch mismatched calls
 *     word        posted's low 32 bits, the futex a waiting rank sleeps on
 *     sleepers    how many ranks sleep on it (the poster wakes them only then: no system call otherwise)
 *   then two data slots per rank (double-buffered by round parity).
 *
 * A round g: every rank copies its data into its slot g%2, publishes posted = g, then waits until
 * every rank's posted >= g, then reads what it needs. Why two slots suffice: a rank writes slot
 * g%2 again only in round g+2, after it has seen every peer post g+1, and a peer posts g+1 only
 * after it has finished reading round g. Every rank sums the slots in rank order, so every rank
 * holds the same bits.
 *
 * A waiting rank spins briefly, then sleeps on the peer's futex. Spinning alone is what a machine
 * with a core per rank and nothing else wants; on a shared or oversubscribed host a spinning rank
 * burns the CPU share its peer (or anyone) needs, and the scheduler then preempts it mid-collective.
 */
#include <limits.h>
#include <linux/futex.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() __asm__ __volatile__("" ::: "memory")
#endif

/* Work below this many elements runs on one thread: waking a team costs more than it saves. */
#define PARALLEL_MIN 262144

typedef struct {
    _Atomic uint64_t posted;
    uint64_t nbytes[2];
    _Atomic uint32_t word;
    _Atomic uint32_t sleepers;
    char padding[128 - 4 * sizeof(uint64_t)];
} rank_control;

_Static_assert(sizeof(rank_control) == 128, "one control block is 128 bytes");

int64_t pagedllm_shm_control_bytes(void) { return (int64_t)sizeof(rank_control); }

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

/* Put this rank's ``nbytes`` for round ``round`` in its slot, then publish the round. */
void pagedllm_shm_post(rank_control* controls, int rank, uint64_t round, void* slot, const void* src,
                       int64_t nbytes) {
    if (nbytes > 0) memcpy(slot, src, (size_t)nbytes);
    rank_control* mine = &controls[rank];
    mine->nbytes[round & 1] = (uint64_t)nbytes;
    atomic_store_explicit(&mine->posted, round, memory_order_release);
    /* Sequentially consistent, as the waiter's sleepers increment and its look at the word: of the two,
     * at least one sees the other, so a waiter never sleeps through this round. */
    atomic_store(&mine->word, (uint32_t)round);
    if (atomic_load(&mine->sleepers) != 0)
        syscall(SYS_futex, &mine->word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* Sleep until rank r's word leaves ``seen`` or ``nanoseconds`` pass. */
static void sleep_on(rank_control* control, uint32_t seen, uint64_t nanoseconds) {
    atomic_fetch_add(&control->sleepers, 1);
    if (atomic_load(&control->word) == seen) {
        const struct timespec timeout = {(time_t)(nanoseconds / 1000000000ull), (long)(nanoseconds % 1000000000ull)};
        syscall(SYS_futex, &control->word, FUTEX_WAIT, seen, &timeout, NULL, 0);
    }
    atomic_fetch_sub(&control->sleepers, 1);
}

/* Wait until every rank has posted round ``round``. Returns 0 when all have; -1 - r when rank r posted
 * a size other than ``nbytes`` (the ranks called different collectives: a bug, never waited out; a
 * negative ``nbytes`` checks nothing, as in a broadcast, where only rank 0 sends); 1 - the
 * caller's slice ended first - when ``slice_ns`` passed (the caller checks its peers are alive and
 * calls again). The first ``spin_ns`` spin on the flag, then the rank sleeps on the peer's futex. */
int pagedllm_shm_wait(rank_control* controls, int world, uint64_t round, int64_t nbytes, int64_t spin_ns,
                      int64_t slice_ns) {
    const uint64_t start = now_ns();
    for (int r = 0; r < world; ++r) {
        unsigned looks = 0;
        uint64_t posted;
        while ((posted = atomic_load_explicit(&controls[r].posted, memory_order_acquire)) < round) {
            if ((++looks & 63) != 0) {
                CPU_RELAX();
                continue;
            }
            const uint64_t waited = now_ns() - start;
            if (waited >= (uint64_t)slice_ns) return 1;
            if (waited >= (uint64_t)spin_ns) sleep_on(&controls[r], (uint32_t)posted, (uint64_t)slice_ns - waited);
        }
        if (nbytes >= 0 && controls[r].nbytes[round & 1] != (uint64_t)nbytes) return -1 - r;
    }
    return 0;
}

/* The bytes rank ``rank`` posted in round ``round`` (after a wait that saw it post). */
int64_t pagedllm_shm_posted_bytes(const rank_control* controls, int rank, uint64_t round) {
    return (int64_t)controls[rank].nbytes[round & 1];
}

static inline float bf16_to_f32(uint16_t value) {
    uint32_t bits = (uint32_t)value << 16;
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

/* Round to nearest even, as torch rounds float32 to bfloat16 (NaN stays a quiet NaN). */
static inline uint16_t f32_to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* The sums run over blocks of BLOCK elements with a float32 accumulator on the stack: one pass over each
 * slot per block, and loops the compiler vectorises (no pointer in them can alias another). */
#define BLOCK 512

/* dst[i] = slots[0][i] + slots[1][i] + ... in rank order, float32. */
void pagedllm_shm_sum_f32(float* dst, const float* const* slots, int world, int64_t count, int threads) {
#pragma omp parallel for num_threads(threads) if (count >= PARALLEL_MIN) schedule(static)
    for (int64_t first = 0; first < count; first += BLOCK) {
        const int64_t n = count - first < BLOCK ? count - first : BLOCK;
        float sum[BLOCK];
        const float* restrict own = slots[0] + first;
        for (int64_t i = 0; i < n; ++i) sum[i] = own[i];
        for (int r = 1; r < world; ++r) {
            const float* restrict part = slots[r] + first;
            for (int64_t i = 0; i < n; ++i) sum[i] += part[i];
        }
        memcpy(dst + first, sum, (size_t)n * sizeof(float));
    }
}

/* The same for bfloat16, summed in float32 and rounded once. */
void pagedllm_shm_sum_bf16(uint16_t* dst, const uint16_t* const* slots, int world, int64_t count, int threads) {
#pragma omp parallel for num_threads(threads) if (count >= PARALLEL_MIN) schedule(static)
    for (int64_t first = 0; first < count; first += BLOCK) {
        const int64_t n = count - first < BLOCK ? count - first : BLOCK;
        float sum[BLOCK];
        const uint16_t* restrict own = slots[0] + first;
        for (int64_t i = 0; i < n; ++i) sum[i] = bf16_to_f32(own[i]);
        for (int r = 1; r < world; ++r) {
            const uint16_t* restrict part = slots[r] + first;
            for (int64_t i = 0; i < n; ++i) sum[i] += bf16_to_f32(part[i]);
        }
        uint16_t* restrict out = dst + first;
        for (int64_t i = 0; i < n; ++i) out[i] = f32_to_bf16(sum[i]);
    }
}

/* Rows ``rows`` of ``row_bytes`` from each rank's slot, side by side: rank r's row i goes to
 * dst + i * world * row_bytes + r * row_bytes (a concatenation along the last dimension). */
void pagedllm_shm_gather_rows(char* dst, const char* const* slots, int world, int64_t rows, int64_t row_bytes) {
    for (int64_t i = 0; i < rows; ++i)
        for (int r = 0; r < world; ++r)
            memcpy(dst + (i * world + r) * row_bytes, slots[r] + i * row_bytes, (size_t)row_bytes);
}
