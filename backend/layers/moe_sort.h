/* A MoE block's (token, choice) pairs grouped by expert, as both compiled expert routines take them
 * (moe_experts.c, float32; moe_experts_bf16.c, bf16).
 *
 * A stable counting sort: order[starts[e] + i] is the i-th choice of expert e, tokens ascending, so each
 * expert's rows are one dense run and its sums keep the reference's order. topk_ids has `choices` entries;
 * starts has num_experts + 1. Returns 0, or -1 when an id is outside [0, num_experts) (order then unset).
 */
#ifndef PAGEDLLM_MOE_SORT_H
#define PAGEDLLM_MOE_SORT_H

#include <stdint.h>
#include <string.h>

static inline int sort_choices_by_expert(const int64_t* topk_ids, int64_t choices, int64_t num_experts,
                                         int64_t* order, int64_t* starts) {
    memset(starts, 0, (size_t)(num_experts + 1) * sizeof *starts);
    for (int64_t c = 0; c < choices; ++c) {
        if (topk_ids[c] < 0 || topk_ids[c] >= num_experts) return -1;
        ++starts[topk_ids[c] + 1];
    }
    for (int64_t e = 0; e < num_experts; ++e) starts[e + 1] += starts[e];
    for (int64_t c = 0; c < choices; ++c) order[starts[topk_ids[c]]++] = c;
    for (int64_t e = num_experts; e > 0; --e) starts[e] = starts[e - 1]; /* each start was moved to its end */
    starts[0] = 0;
    return 0;
}

#endif
