"""CPU attention, side by side: the production backend against the reference oracle.

Printed by ``pagedllm bench kernels`` on CPU. Two tables, each variant run
interleaved with the other in one process (the median of ``reps`` runs), at 1
thread unless the caller set otherwise:

* per layer: one decode step's attention for the tiny and small checkpoints'
  head layouts, 32 and 128 sequences, contexts ~300 and ~1000 (±25%, so the
  sequences differ in length as in a serving batch). The production backend's
  once-per-step plan is timed apart and shown per step, and so is its plain-torch
  path (the gather + SDPA that runs when the compiled decode routine cannot be built);
* per decode step: the checkpoint's whole forward plus logits (embedding, every
  layer's K/V write, attention and linears), with each backend planning once.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pagedllm_bench.models import bench_model
from pagedllm.models import CausalLM, load_model
from pagedllm.testing.paged_batch import PagedBatch, random_paged_batch
from pagedllm.attention.backends import REFERENCE_BACKEND, AttentionBackend, torch_backend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.cpu_attention_plan import CpuAttentionPlan, plan_cpu_attention
from pagedllm.attention.native_decode import load_native_decode

BLOCK_SIZE = 16
# The production backend must agree with the reference this closely (fp32), relative to
# the largest magnitude of the reference's output (attention output or logits).
MAX_ERROR = 1e-5
# (checkpoint size, num_heads, num_kv_heads, head_dim), as pagedllm.testing.tiny_model builds them
HEAD_LAYOUTS = (("tiny", 4, 2, 64), ("small", 8, 2, 64))


@dataclass(frozen=True, slots=True)
class Workload:
    sizes: tuple[str, ...]
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    reps: int


FULL = Workload(sizes=("tiny", "small"), batches=(32, 128), contexts=(300, 1000), reps=7)
TINY = Workload(sizes=("tiny",), batches=(4,), contexts=(40,), reps=1)


@dataclass(frozen=True, slots=True)
class CpuRow:
    section: str  # "cpu layer" or "cpu step"
    shape: str
    reference_ms: float
    production_ms: float
    plan_ms: float | None = None
    torch_path_ms: float | None = None  # the production backend without its compiled decode routine
    max_error: float | None = None  # max |production - reference| / max |reference|

    @property
    def speedup(self) -> float:
        return self.reference_ms / self.production_ms


def run_cpu_tables(workload: Workload) -> list[CpuRow]:
    layers = layer_rows(workload)
    _print(layers, "per layer: one decode step's attention")
    steps = step_rows(workload)
    _print(steps, "per decode step: forward + logits of the checkpoint")
    return layers + steps


def decode_batch(num_seqs: int, context: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 generator: torch.Generator) -> PagedBatch:
    """One decode token per sequence over contexts spread ±25% around ``context``."""
    low, high = max(1, context * 3 // 4), context * 5 // 4
    lens = torch.randint(low, high + 1, (num_seqs,), generator=generator).tolist()
    return random_paged_batch([1] * num_seqs, lens, num_heads, num_kv_heads, head_dim, BLOCK_SIZE,
                              generator=generator, spare_columns=1)


def metadata_of(batch: PagedBatch) -> AttentionMetadata:
    num_tokens = batch.q.shape[0]
    return AttentionMetadata(batch.query_start_loc, batch.seq_lens, batch.block_table,
                             torch.zeros(num_tokens, dtype=torch.int64), 1, int(batch.seq_lens.max()))


def layer_rows(workload: Workload) -> list[CpuRow]:
    rows = []
    generator = torch.Generator().manual_seed(0)
    for size, num_heads, num_kv_heads, head_dim in HEAD_LAYOUTS:
        if size not in workload.sizes:
            continue
        for context in workload.contexts:
            for num_seqs in workload.batches:
                batch = decode_batch(num_seqs, context, num_heads, num_kv_heads, head_dim, generator)
                production, torch_path = torch_backend(), torch_backend(native=False)
                planned = production.plan(metadata_of(batch))
                k_cache, v_cache = (_in_layout(production, cache) for cache in (batch.k_cache, batch.v_cache))
                variants = {
                    "plan": lambda: _plan_fully(batch),
                    "reference": lambda: REFERENCE_BACKEND.attend(batch.q, batch.k_cache, batch.v_cache,
                                                                  metadata_of(batch), batch.scale),
                    "production": lambda: production.attend(batch.q, k_cache, v_cache, planned, batch.scale),
                }
                if load_native_decode() is not None:
                    variants["torch path"] = lambda: torch_path.attend(batch.q, k_cache, v_cache,
                                                                       torch_path.plan(metadata_of(batch)),
                                                                       batch.scale)
                times = interleaved(variants, workload.reps)
                rows.append(CpuRow("cpu layer", f"{size} heads {num_heads}/{num_kv_heads} x {num_seqs} seqs x ctx "
                                   f"~{context}", times["reference"], times["production"], times["plan"],
                                   times.get("torch path"),
                                   relative_error(variants["production"](), variants["reference"]())))
    return rows


def _in_layout(backend: AttentionBackend, cache: torch.Tensor) -> torch.Tensor:
    """``cache``'s values in the memory layout ``backend`` allocates its caches in."""
    return backend.new_cache(tuple(cache.shape), cache.dtype, cache.device).copy_(cache)


def _plan_fully(batch: PagedBatch) -> None:
    """The production plan including the layout its first layer derives (block size and dtype known)."""
    plan = plan_cpu_attention(metadata_of(batch)).plan
    if isinstance(plan, CpuAttentionPlan):
        plan.layout(batch.k_cache.shape[1], batch.q.dtype, load_native_decode() is not None)


def step_rows(workload: Workload) -> list[CpuRow]:
    rows = []
    generator = torch.Generator().manual_seed(1)
    for size in workload.sizes:
        model_dir = bench_model(size)
        production = torch_backend()
        models = {name: load_model(model_dir, torch.float32, torch.device("cpu"), backend)
                  for name, backend in (("reference", REFERENCE_BACKEND), ("production", production))}
        head = models["reference"]
        for context in workload.contexts:
            for num_seqs in workload.batches:
                batch = decode_batch(num_seqs, context, head.num_heads, head.num_kv_heads, head.head_dim, generator)
                step = _DecodeStep(batch, head, generator)
                variants = {name: (lambda model=model: step.run(model)) for name, model in models.items()}
                times = interleaved(variants, workload.reps)
                rows.append(CpuRow("cpu step", f"{size} x {num_seqs} seqs x ctx ~{context}", times["reference"],
                                   times["production"],
                                   max_error=relative_error(variants["production"](), variants["reference"]())))
    return rows


class _DecodeStep:
    """A decode step over random caches: token ids, positions and per-layer K/V of the batch's layout."""

    def __init__(self, batch: PagedBatch, model: CausalLM, generator: torch.Generator) -> None:
        positions = batch.seq_lens.long() - 1
        block_size = batch.k_cache.shape[1]
        rows = torch.arange(positions.numel())
        slots = batch.block_table[rows, positions // block_size].long() * block_size + positions % block_size
        self.metadata = AttentionMetadata(batch.query_start_loc, batch.seq_lens, batch.block_table, slots, 1,
                                          int(batch.seq_lens.max()))
        self.input_ids = torch.randint(1, model.vocab_size, (positions.numel(),), generator=generator)
        self.positions = positions
        shape = batch.k_cache.shape
        self.kv_caches = [(torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
                          for _ in range(model.num_layers)]
        self._laid_out: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    @torch.inference_mode()
    def run(self, model: CausalLM) -> torch.Tensor:
        backend = model.attention
        if backend.name not in self._laid_out:
            self._laid_out[backend.name] = [(_in_layout(backend, k), _in_layout(backend, v)) for k, v in self.kv_caches]
        planned = backend.plan(self.metadata)
        hidden = model(self.input_ids, self.positions, self._laid_out[backend.name], planned)
        return model.compute_logits(hidden)


def relative_error(actual: object, expected: object) -> float:
    if not isinstance(actual, torch.Tensor) or not isinstance(expected, torch.Tensor):
        raise TypeError("both variants must return tensors")
    return float((actual - expected).abs().max() / expected.abs().max())


def interleaved(variants: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median milliseconds per call; the variants take turns so that machine noise hits them alike."""
    for fn in variants.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(reps):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


def _print(rows: Sequence[CpuRow], title: str) -> None:
    print(f"CPU attention, {title} ({torch.get_num_threads()} thread(s)); production = "
          f"pagedllm.attention.cpu_attention (compiled decode routine: {'not built' if load_native_decode() is None else 'yes'}), "
          f"torch path = the same without it, reference = pagedllm.kernels.reference\n")
    print("| shape | reference ms | torch path ms | production ms | production speed-up | plan ms (once per step) "
          "| max rel. diff |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        plan = "-" if row.plan_ms is None else f"{row.plan_ms:.3f}"
        torch_path = "-" if row.torch_path_ms is None else f"{row.torch_path_ms:.3f}"
        print(f"| {row.shape} | {row.reference_ms:.3f} | {torch_path} | {row.production_ms:.3f} | {row.speedup:.2f}x "
              f"| {plan} | {row.max_error:.1e} |")
    print()
