"""Fit the step-time model on this machine by timing real engine steps on a few batches of requests.

The real ``LLMEngine`` and a ``NullEngine`` with the same KV blocks and limits
take the same requests in lockstep: the null engine's ``SchedulerOutput``
gives each step's shape (same scheduler, same schedule), the real engine's
``step()`` its duration. Each batch runs ``repeats`` times with fresh prompts
and every timing is kept: on a shared machine a step takes what the other
processes leave it, and the prediction should carry that average share (the
fastest of the repeats would predict an idle machine). ``step_time.fit``
turns the timings into the model's coefficients.

Catalog models have no weights here: ``random_checkpoint`` writes a
random-weight Llama with the catalog model's layer shapes (and the embedded
model's tokenizer and vocabulary), which is all a timing needs.
"""
from __future__ import annotations

import json
import shutil
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedllm.simulation.null_engine import NullEngine
from pagedllm.core.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.core.model_source import DEFAULT_MODEL_DIR
from pagedllm.planning.model_catalog import ModelSpec, spec_from_config
from pagedllm.planning.step_time import ModelCost, StepShape, StepTimeModel, fit
from pagedllm.core.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class Batch:
    """Requests submitted together, their lengths drawn uniformly from the ranges.

    Mixed lengths make the steps serving makes: prefill chunks beside decodes,
    decode batches of unequal contexts (which the CPU attention splits into
    groups), rows finishing one by one. Uniform batches time faster than that.
    """

    requests: int
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]


# Decodes at 1-32 rows with contexts up to ~1000 tokens, and full 2048-token prefill chunks.
BATCHES = (Batch(1, (16, 16), (16, 16)), Batch(8, (16, 128), (8, 16)), Batch(32, (16, 960), (4, 16)),
           Batch(4, (512, 512), (3, 3)))
WARM_UP = Batch(2, (8, 8), (4, 4))  # first-call allocations and lazy initialisation, not timed
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


@dataclass(frozen=True, slots=True)
class TimedStep:
    shape: StepShape
    seconds: float  # wall clock
    cpu_seconds: float  # this process's CPU time: what the step costs whatever else the machine runs


@dataclass(frozen=True, slots=True)
class Calibration:
    model: StepTimeModel  # fitted to wall-clock times: what plans use
    cpu_model: StepTimeModel  # fitted to CPU times: separates the model's error from a shared machine's load
    cost: ModelCost  # of the checkpoint that was timed
    steps: tuple[TimedStep, ...]

    def fitted(self, step: TimedStep) -> float:
        return self.model.seconds(self.cost, step.shape)


def calibrate(model_dir: Path, device: str = "cpu", dtype: str = "auto", block_size: int = 16,
              max_num_batched_tokens: int = 2048, repeats: int = 2,
              batches: Seq[Batch] = BATCHES, cuda_graphs: bool = False) -> Calibration:
    """Time ``model_dir``'s engine steps on ``batches`` and fit the step-time model to them.

    ``cuda_graphs``: time the engine as it will serve, decode steps replayed as graphs (CUDA only)."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} is invalid: expected >= 1")
    runs = (WARM_UP, *batches)
    longest = max(b.prompt_len[1] + b.output_len[1] for b in runs)
    widest = max(b.requests for b in runs)
    num_blocks = widest * -(-longest // block_size) + 1
    config = EngineConfig(model=str(model_dir), dtype=dtype, device=device, block_size=block_size,
                          num_kv_blocks=num_blocks, max_num_seqs=widest,
                          max_num_batched_tokens=max_num_batched_tokens, max_model_len=longest,
                          enable_prefix_caching=False,  # repeated passes must not hit cached prompts
                          cuda_graphs=cuda_graphs)
    engine = LLMEngine(config)
    null = NullEngine(num_blocks, block_size, config.max_num_seqs, max_num_batched_tokens, enable_prefix_caching=False)
    generator = torch.Generator().manual_seed(0)
    vocab = engine.model.vocab_size

    def draw(bounds: tuple[int, int]) -> int:
        return int(torch.randint(bounds[0], bounds[1] + 1, (), generator=generator))

    def run(batch: Batch) -> list[TimedStep]:
        for _ in range(batch.requests):
            ids = torch.randint(1, vocab, (draw(batch.prompt_len),), generator=generator).tolist()
            params = SamplingParams(max_tokens=draw(batch.output_len), temperature=0.0, ignore_eos=True)
            engine.add_request(f"calibrate-{time.monotonic_ns()}", ids, params)
            null.add_request(ids, params)
        timed = []
        while null.has_unfinished_requests():
            shape = StepShape.of(null.step())
            start, cpu_start = time.perf_counter(), time.process_time()
            engine.step()
            timed.append(TimedStep(shape, time.perf_counter() - start, time.process_time() - cpu_start))
        if engine.has_unfinished_requests():
            raise RuntimeError("the engine and its null replay diverged: the engine still has requests")
        return timed

    def timed_passes() -> list[TimedStep]:
        generator.manual_seed(0)  # the same draws, so the same step shapes, every time
        return [step for _ in range(repeats) for batch in batches for step in run(batch)]

    run(WARM_UP)
    if engine.device.type == "cuda":
        # The first step of each launch shape compiles Triton kernels (up to a second each): an identical
        # untimed pass first, so the fit sees steady-state steps.
        timed_passes()
    steps = timed_passes()
    spec = spec_from_config(model_dir.name, json.loads((model_dir / "config.json").read_text()))
    name = _DTYPE_NAMES[engine.dtype]
    cost = ModelCost.of(spec, name, name)
    graphs = ", CUDA graphs" if cuda_graphs else ""
    source = (f"calibrated on {engine.device.type} with {model_dir.name} ({name}, {torch.get_num_threads()} threads"
              f"{graphs})")
    return Calibration(fit([(s.shape, cost, s.seconds) for s in steps], source),
                       fit([(s.shape, cost, s.cpu_seconds) for s in steps], f"{source}, CPU time"), cost, tuple(steps))


def random_checkpoint(spec: ModelSpec, out_dir: Path, num_layers: int | None = None) -> Path:
    """A random-weight Llama checkpoint with ``spec``'s layer shapes, for timing (not for text)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    vocab = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())["vocab_size"]
    layers = num_layers or spec.num_layers
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=layers, num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim, max_position_embeddings=8192, tie_word_embeddings=False, eos_token_id=0,
        bos_token_id=0, architectures=["LlamaForCausalLM"],
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL_DIR / name, out_dir / name)
    h, i = spec.hidden_size, spec.intermediate_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,), "lm_head.weight": (vocab, h)}
    for n in range(layers):
        prefix = f"model.layers.{n}."
        shapes |= {prefix + "self_attn.q_proj.weight": (q, h), prefix + "self_attn.k_proj.weight": (kv, h),
                   prefix + "self_attn.v_proj.weight": (kv, h), prefix + "self_attn.o_proj.weight": (h, q),
                   prefix + "mlp.gate_proj.weight": (i, h), prefix + "mlp.up_proj.weight": (i, h),
                   prefix + "mlp.down_proj.weight": (h, i), prefix + "input_layernorm.weight": (h,),
                   prefix + "post_attention_layernorm.weight": (h,)}
    generator = torch.Generator().manual_seed(0)
    tensors = {name: (torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=generator) * 0.02)
               .to(torch.bfloat16) for name, shape in shapes.items()}
    save_file(tensors, str(out_dir / "model.safetensors"))
    return out_dir
