"""Where one decode step and one prefill step spend their time, by part, at a real size and dtype.

    OMP_NUM_THREADS=1 python scripts/profile_step_split.py --model qwen2.5-0.5b --dtype bfloat16 --batch 16

Wraps the parts of the step in exclusive timers (a part's time excludes the parts called inside
it): linears, a MoE block's router (softmax and top-k; its gate is a linear) and routed experts
(their grouping, GEMMs unless those run as packed linears, weighting and sums), attention (write + attend), norms/rotary/SiLU, the LM head (its linear and the
float32 cast), the sampler, the rest of the forward (embedding, residual adds, views, Python),
and the host (everything in ``LLMEngine.step`` outside the forward and the sampler). Calls are
synchronous on a CPU, so wall clocks are exact; the wrappers add about a microsecond per call.
Prints the median of ``--steps`` decode steps at ``--batch`` rows and of ``--prefills`` prefill
steps of ``--prompt-len`` tokens.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pagedllm import LLM, SamplingParams
from pagedllm_bench.models import bench_model
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.attention import cpu_attention
from pagedllm.layers import cpu_fused_ops, cpu_linear, moe, norm_rotary
from pagedllm.models import llama
from pagedllm.worker import sampler

PARTS = ("linears", "MoE router", "MoE experts", "attention", "norms+rotary+silu", "LM head", "sampler", "forward, rest",
         "host")
_totals: dict[str, float] = defaultdict(float)
_stack: list[list[float]] = []  # [start, time spent in timed children]


def _timed(part: str, function: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        frame = [time.perf_counter(), 0.0]
        _stack.append(frame)
        try:
            return function(*args, **kwargs)
        finally:
            _stack.pop()
            elapsed = time.perf_counter() - frame[0]
            _totals[part] += elapsed - frame[1]
            if _stack:
                _stack[-1][1] += elapsed
    return wrapper


def _patch(owner: Any, name: str, part: str) -> None:
    setattr(owner, name, _timed(part, getattr(owner, name)))


def install() -> None:
    _patch(LLMEngine, "step", "host")
    _patch(llama.CausalLM, "forward", "forward, rest")
    _patch(llama.CausalLM, "compute_logits", "LM head")
    _patch(nn.Linear, "forward", "linears")
    _patch(cpu_linear.PackedLinear, "forward", "linears")
    _patch(cpu_linear.OneDnnLinear, "forward", "linears")  # its own forward: the bias inside the GEMM
    _patch(cpu_attention.CpuPagedAttention, "attend", "attention")
    _patch(cpu_attention.CpuPagedAttention, "write_kv", "attention")
    _patch(cpu_attention.CpuPagedAttention, "attend_qkv", "attention")
    _patch(norm_rotary.RMSNorm, "forward", "norms+rotary+silu")
    _patch(norm_rotary.RMSNorm, "add_and_norm", "norms+rotary+silu")
    _patch(llama, "apply_rotary", "norms+rotary+silu")
    _patch(cpu_fused_ops.CpuFusedOps, "rotate_", "norms+rotary+silu")
    _patch(cpu_fused_ops.CpuFusedOps, "silu_mul", "norms+rotary+silu")
    _patch(sampler.Sampler, "__call__", "sampler")
    _patch(moe.SparseMoeBlock, "route", "MoE router")  # its gate linear counts as a linear
    _patch(moe.SparseMoeBlock, "_cpu_experts", "MoE experts")  # grouping, both GEMMs, weighting, scatter


def measure(engine: Any) -> dict[str, float]:
    """ms per part of the next step."""
    _totals.clear()
    engine.step()
    return {part: _totals.get(part, 0.0) * 1e3 for part in PARTS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=160, help="prompt tokens of each decoding request")
    parser.add_argument("--prompt-len", type=int, default=512, help="tokens of the prefill step")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prefills", type=int, default=3)
    args = parser.parse_args()
    install()
    generator = torch.Generator().manual_seed(0)

    def prompt(length: int) -> list[int]:
        return torch.randint(3, 2000, (length,), generator=generator).tolist()

    with LLM(str(bench_model(args.model)), dtype=args.dtype, max_num_seqs=args.batch, max_num_batched_tokens=2048,
             max_model_len=max(args.context, args.prompt_len) + args.steps + 16,
             enable_prefix_caching=False) as llm:
        engine = llm.engine
        for i in range(args.batch):
            engine.add_request(f"d{i}", prompt(args.context), SamplingParams(max_tokens=args.steps + 3,
                                                                            temperature=0.0, ignore_eos=True))
        engine.step()
        engine.step()
        decode = [measure(engine) for _ in range(args.steps)]
        while engine.has_unfinished_requests():
            engine.step()
        prefill = []
        for i in range(args.prefills + 1):
            engine.add_request(f"p{i}", prompt(args.prompt_len), SamplingParams(max_tokens=1, temperature=0.0))
            prefill.append(measure(engine))
        prefill = prefill[1:]  # the first one warms the prefill path
    print(f"{args.model} {args.dtype}, {torch.get_num_threads()} thread(s): median ms per part\n")
    print(f"| part | decode, batch {args.batch}, context {args.context} | prefill, {args.prompt_len} tokens |")
    print("|---|---|---|")
    for part in PARTS:
        print(f"| {part} | {statistics.median(s[part] for s in decode):.1f} | "
              f"{statistics.median(s[part] for s in prefill):.1f} |")
    print(f"| **step** | {statistics.median(sum(s.values()) for s in decode):.1f} | "
          f"{statistics.median(sum(s.values()) for s in prefill):.1f} |")


if __name__ == "__main__":
    main()
