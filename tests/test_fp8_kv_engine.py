"""The engine with an 8-bit KV cache: four times the blocks of float32 at the same budget, the planner
agreeing, measured scales, and prefix caching, parallel sampling, beams and preemption behaving as blocks."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from pagedllm import LLM, SamplingParams
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.planning.kv_math import Deployment, capacity
from pagedllm.planning.model_catalog import resolve_model
from pagedllm.planning.gpu_catalog import this_cpu
from pagedllm.serving.triton.metrics import gauge_values

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# Longer than two blocks each, so that prefix caching has full blocks to share.
PROMPTS = [f"{head}\n" + "x = [i * i for i in range(100) if i % 3 == 0]\n" * 4
           for head in ("def main():", "import os\nimport sys", "for i in range(10):")]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_fp8_cache_holds_four_times_the_float32_blocks(tiny_model_dir, arch: str) -> None:
    model = str(tiny_model_dir(arch))
    budget_blocks = 64
    budget_gb = budget_blocks * float32_block_bytes(model) / (1 << 30)
    common = dict(dtype="float32", kv_cache_memory_gb=budget_gb, max_num_seqs=512, attention_backend="torch")
    fp32 = LLM(model, **common).stats().num_blocks_total
    fp8 = LLM(model, kv_cache_dtype="fp8_e4m3", **common)
    assert fp32 == budget_blocks
    assert fp8.stats().num_blocks_total == 4 * fp32
    assert fp8.engine.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    gauges = gauge_values(fp8.stats())  # what /metrics reports, with nothing running
    assert gauges["pagedllm:kv_blocks_free"] == 4 * fp32 and gauges["pagedllm:kv_blocks_used"] == 0


def float32_block_bytes(model: str, block_size: int = 16) -> int:
    """K and V of one 16-token block in every layer at float32, from the checkpoint's config by hand."""
    config = AutoConfig.from_pretrained(model)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * head_dim * 4


def test_plan_counts_the_engine_s_fp8_blocks(tiny_model_dir) -> None:
    model = str(tiny_model_dir("qwen2"))
    engine = LLM(model, dtype="float32", kv_cache_dtype="fp8_e5m2", kv_cache_memory_gb=0.01, max_num_seqs=512,
                 max_model_len=256, attention_backend="torch").engine
    planned = capacity(Deployment(resolve_model(model), this_cpu(), "float32", "fp8_e5m2", block_size=16,
                                  max_model_len=256, max_num_seqs=512, kv_cache_memory_gb=0.01))
    assert planned.engine_kv_blocks == engine.kv.num_blocks


def _tokens(llm: LLM, prompts: list[str], params: SamplingParams) -> list[list[tuple[int, ...]]]:
    return [[tuple(c.token_ids) for c in out.outputs] for out in llm.generate(prompts, params)]


def test_fp8_cache_sharing_and_preemption_leave_tokens_unchanged(tiny_model_dir) -> None:
    model = str(tiny_model_dir("llama"))
    common = dict(dtype="float32", kv_cache_dtype="fp8_e4m3", attention_backend="torch", max_num_seqs=8)
    roomy = LLM(model, num_kv_blocks=256, **common)
    expected = _tokens(roomy, PROMPTS, GREEDY)
    # prefix-cache hits: the same prompts again read the blocks the first run left
    assert _tokens(roomy, PROMPTS, GREEDY) == expected
    assert roomy.stats().prefix_cache_hit_tokens > 0
    uncached = LLM(model, num_kv_blocks=256, enable_prefix_caching=False, **common)
    assert _tokens(uncached, PROMPTS, GREEDY) == expected
    # too few blocks for all three at once: preempted and recomputed, same tokens
    tight = LLM(model, num_kv_blocks=12, **common)
    assert _tokens(tight, PROMPTS, GREEDY) == expected
    assert tight.stats().num_preemptions > 0
    # parallel samples share the prompt's blocks and copy the last one on write
    sampled = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=7)
    assert _tokens(roomy, PROMPTS[:1], sampled) == _tokens(uncached, PROMPTS[:1], sampled)
    beams = SamplingParams(n=2, beam_width=3, max_tokens=6, temperature=0.0)
    assert _tokens(roomy, PROMPTS[:1], beams) == _tokens(uncached, PROMPTS[:1], beams)
    assert roomy.stats().num_blocks_free == roomy.stats().num_blocks_total  # every finished request freed its blocks


def test_calculated_scales_are_set_by_the_first_prefill(tiny_model_dir) -> None:
    llm = LLM(str(tiny_model_dir("qwen3")), dtype="float32", kv_cache_dtype="fp8_e4m3", calculate_kv_scales=True,
              num_kv_blocks=64, attention_backend="torch")
    layers = llm.engine.model.model.layers
    assert all(layer.self_attn.kv_scales.pending for layer in layers)
    llm.generate(PROMPTS[:1], GREEDY)
    scales = [float(layer.self_attn.kv_scales.k) for layer in layers]
    assert not any(layer.self_attn.kv_scales.pending for layer in layers)
    assert all(scale != 1.0 and scale > 0 for scale in scales)
    llm.generate(PROMPTS[1:2], GREEDY)  # measured once: later prefills keep them
    assert [float(layer.self_attn.kv_scales.k) for layer in layers] == scales


def test_auto_keeps_the_model_dtype_and_no_scales(tiny_model_dir) -> None:
    engine: LLMEngine = LLM(str(tiny_model_dir("llama")), dtype="float32", num_kv_blocks=16,
                            attention_backend="torch").engine
    assert engine.kv_cache_dtype == torch.float32
    assert all(layer.self_attn.kv_scales is None for layer in engine.model.model.layers)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(str(tiny_model_dir("llama")), kv_cache_dtype="int8")


def test_tensor_parallel_ranks_share_the_fp8_cache_layout(tiny_model_dir) -> None:
    """Every rank holds the same 8-bit blocks (its own heads): TP=2 decodes TP=1's tokens."""
    model = str(tiny_model_dir("llama"))
    common = dict(dtype="float32", kv_cache_dtype="fp8_e4m3", num_kv_blocks=64, attention_backend="torch")
    expected = _tokens(LLM(model, **common), PROMPTS[:2], GREEDY)
    split = LLM(model, tensor_parallel_size=2, **common)
    try:
        assert _tokens(split, PROMPTS[:2], GREEDY) == expected
    finally:
        split.close()


def test_model_json_takes_kv_cache_dtype_and_names_a_bad_one(tmp_path) -> None:
    from pagedllm.serving.engine_args import load_engine_config

    (tmp_path / "model.json").write_text('{"kv_cache_dtype": "fp8_e5m2", "calculate_kv_scales": true}')
    config = load_engine_config(tmp_path)
    assert (config.kv_cache_dtype, config.calculate_kv_scales) == ("fp8_e5m2", True)
    (tmp_path / "model.json").write_text('{"kv_cache_dtype": "fp8"}')
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' is invalid: expected one of auto, fp8_e4m3, fp8_e5m2"):
        load_engine_config(tmp_path)


def test_memory_bench_fp8_row_holds_what_a_bf16_cache_must_queue_for() -> None:
    """`pagedllm bench memory`'s KV rows at a budget that binds for bfloat16's blocks (here the float32 cache
    given them): the 8-bit cache holds twice the blocks and runs every request at once, without waiting."""
    from pagedllm_bench import memory
    from pagedllm.simulation.workloads import make_workload

    bf16, fp8 = memory.measure_kv_dtypes(make_workload("long-tail", "tiny"), ["bf16-sized", "fp8_e4m3"], 128, 16,
                                         64, 128)
    assert bf16["cache_dtype"] == "float32" and bf16["bytes_per_block"] == 2 * bf16["bfloat16_bytes_per_block"]
    assert fp8["bytes_per_block"] * 2 == fp8["bfloat16_bytes_per_block"]
    assert fp8["num_blocks"] == 2 * bf16["num_blocks"] == 32
    assert bf16["request_steps_waiting"] > 0 and bf16["preemptions"] > 0
    assert fp8["request_steps_waiting"] == 0 and fp8["preemptions"] == 0
    assert fp8["peak_sequences"] == 12 > bf16["peak_sequences"]  # all 12 requests of the tiny workload
    assert fp8["output_tokens"] == bf16["output_tokens"]
