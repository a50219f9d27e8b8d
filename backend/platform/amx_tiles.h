/* AMX tiles as the compiled bf16 routines use them (attention/paged_prefill_bf16.c, layers/moe_experts_bf16.c).
 *
 * Include only where the compiler targets AMX (__AMX_TILE__ and __AMX_BF16__) on Linux. Linux hands a process the
 * tile data state only on request, so a routine asks (amx_tile_data_granted) before its first tile instruction;
 * asking again is harmless. Both routines use one layout: palette 1, tiles 0-7 each 16 rows of 64 bytes (16
 * float32 or 32 bf16 a row). The configuration is a thread's state and oneDNN loads its own, so every parallel
 * region loads this one (amx_configure_tiles) on each thread before it touches a tile.
 */
#ifndef PAGEDLLM_AMX_TILES_H
#define PAGEDLLM_AMX_TILES_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define PAGEDLLM_ARCH_REQ_XCOMP_PERM 0x1023
#define PAGEDLLM_XFEATURE_XTILEDATA 18

static inline int amx_tile_data_granted(void) {
    return syscall(SYS_arch_prctl, PAGEDLLM_ARCH_REQ_XCOMP_PERM, PAGEDLLM_XFEATURE_XTILEDATA) == 0;
}

struct amx_tile_config {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64)));

static inline void amx_configure_tiles(void) {
    struct amx_tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; ++t) {
        config.bytes_per_row[t] = 64;
        config.rows[t] = 16;
    }
    _tile_loadconfig(&config);
}

#endif
