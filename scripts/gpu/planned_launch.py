"""The planned Triton launch against the reference, and its host time per layer against an unplanned launch."""
import time, torch
from pagedllm.kernels import unified_attention_ref
from pagedllm.kernels.attention_launch import plan_unified_attention, unified_attention, unified_attention_planned
from pagedllm.testing.paged_batch import random_paged_batch

generator = torch.Generator(device="cuda").manual_seed(0)
layouts = {"decode 64 x ctx 2k": ([1] * 64, [2048] * 64), "decode 2 x ctx 16k (split-KV)": ([1, 1], [16384, 9000]),
           "mixed": ([1, 1, 300, 1], [700, 2500, 1536, 40])}
for name, (query_lens, seq_lens) in layouts.items():
    for dtype in (torch.bfloat16, torch.float32):
        batch = random_paged_batch(query_lens, seq_lens, 32, 8, 128, 16, dtype, "cuda", generator, spare_columns=1)
        step = plan_unified_attention(batch.query_start_loc, batch.seq_lens, batch.block_table)
        errors = []
        for _ in range(4):  # four "layers": new queries and cache contents, one plan
            q, k, v = (torch.randn_like(t) for t in (batch.q, batch.k_cache, batch.v_cache))
            out = unified_attention_planned(q, k, v, step, batch.scale)
            ref = unified_attention_ref(q, k, v, *batch.args()[3:])
            errors.append(float((out.float() - ref.float()).abs().max()))
        (launch,) = step.launches.values()
        def host_us(fn, reps=50):
            torch.cuda.synchronize(); start = time.perf_counter()
            for _ in range(reps): fn()
            elapsed = time.perf_counter() - start; torch.cuda.synchronize()
            return elapsed / reps * 1e6
        planned = host_us(lambda: unified_attention_planned(batch.q, batch.k_cache, batch.v_cache, step, batch.scale))
        unplanned = host_us(lambda: unified_attention(*batch.args()))
        print(f"{name} {str(dtype).removeprefix('torch.')}: max error over 4 layers {max(errors):.2e}, "
              f"splits {launch.tiles.num_splits}, launch plans {len(step.launches)}, "
              f"enqueue per layer planned {planned:.0f} us vs unplanned {unplanned:.0f} us")
