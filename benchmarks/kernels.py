"""Attention kernels: Triton-lang paged attention vs the torch reference and SDPA.

``pagedllm bench kernels`` prints three markdown tables: correctness against
the plain-torch reference (bf16, head_dim 128, block 16, GQA 4 and 8); decode
bandwidth (K/V bytes read / time, against the GPU's peak) for batch
{1, 8, 64, 256} x context {512, 4k, 32k}; prefill TFLOP/s for 1k-8k chunks.
Each timed row also runs ``torch.nn.functional.scaled_dot_product_attention``
on contiguous K/V of the same shape (the side-by-side baseline). Timing uses
CUDA events through ``triton.testing.do_bench``. On CPU, or with ``--tiny``,
tiny shapes run (on CPU through triton's interpreter) so the suite keeps the
script from rotting; CPU timings of the Triton kernels mean nothing. On CPU it
then prints the production plain-torch attention next to the reference, per
layer and per decode step (:mod:`pagedllm_bench.cpu_attention`), and the compiled
prefill routine next to the SDPA path (:mod:`pagedllm_bench.cpu_prefill`). Triton is
imported only when the benchmark runs, so the ``pagedllm`` command starts without it.
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedllm_bench import cpu_attention, cpu_fused, cpu_linears, cpu_prefill
from pagedllm.kernels import unified_attention_ref
from pagedllm.kernels.attention_heuristics import plan_attention
from pagedllm.layers.cpu_fused_ops import cpu_fused_ops
from pagedllm.testing.paged_batch import PagedBatch, random_paged_batch

# Peak HBM bandwidth in bytes/s; first substring of the device name that matches wins.
PEAK_BANDWIDTH: tuple[tuple[str, float], ...] = (
    ("H200", 4.8e12),
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12),
    ("L40S", 0.864e12),
    ("L4", 0.3e12),
)


@dataclass(frozen=True, slots=True)
class Shapes:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    prefill_chunks: tuple[int, ...]
    # (num_heads, num_kv_heads, query lengths, context lengths) per correctness case
    correctness: tuple[tuple[int, int, tuple[int, ...], tuple[int, ...]], ...]


FULL = Shapes(
    num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16,
    decode_batches=(1, 8, 64, 256), decode_contexts=(512, 4096, 32768), prefill_chunks=(1024, 2048, 4096, 8192),
    correctness=(
        (32, 8, (1, 1, 1, 1, 512, 300), (1, 700, 2500, 4096, 1536, 300)),
        (64, 8, (1, 1, 1, 1, 512, 300), (1, 700, 2500, 4096, 1536, 300)),
        (32, 8, (1, 1), (8192, 5000)),
        (64, 8, (1,), (16384,)),
    ),
)
TINY = Shapes(
    num_heads=8, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.bfloat16,
    decode_batches=(1, 2), decode_contexts=(24, 40), prefill_chunks=(16, 32),
    correctness=((8, 2, (1, 5), (20, 9)), (8, 1, (1, 1), (33, 7))),
)
# bf16 rounding of the output, plus bf16 probabilities in the P @ V product on GPU.
BF16_ATOL, BF16_RTOL = 1e-2, 1.6e-2


@dataclass(frozen=True, slots=True)
class Row:
    section: str
    shape: str
    triton_ms: float | None = None
    sdpa_ms: float | None = None
    metric: float | None = None  # GB/s (decode) or TFLOP/s (prefill) of the Triton kernel
    sdpa_metric: float | None = None
    of_peak: float | None = None
    max_abs_error: float | None = None
    ok: bool | None = None
    splits: int | None = None


def peak_bandwidth(device_name: str) -> float | None:
    """Peak HBM bytes/s of a GPU by its CUDA name; ``None`` for GPUs not in the table."""
    return next((peak for key, peak in PEAK_BANDWIDTH if key in device_name), None)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (automatic on CPU, where the interpreter runs)")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--rep-ms", type=float, default=100.0, help="time budget per measurement on CUDA")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows to this JSON file")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own)")


def run(args: argparse.Namespace) -> None:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    shapes = TINY if args.tiny or device.type != "cuda" else FULL
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (triton interpreter)"
    peak = peak_bandwidth(name) if device.type == "cuda" else None
    generator = torch.Generator(device=device).manual_seed(0)
    timer = _Timer(device, args.rep_ms)
    import triton

    print(f"# pagedllm bench kernels: {name}, {time.strftime('%Y-%m-%d', time.gmtime())}, torch {torch.__version__}, "
          f"triton {triton.__version__}\n\n{str(shapes.dtype).removeprefix('torch.')}, heads {shapes.num_heads}/"
          f"{shapes.num_kv_heads} (q/kv) unless noted, head_dim {shapes.head_dim}, block {shapes.block_size}\n")
    rows = _correctness(shapes, device, generator)
    _print(rows, ("shape", "max_abs_error", "ok"))
    decode = _decode(shapes, device, generator, timer, peak)
    _print(decode, ("shape", "splits", "triton_ms", "metric", "of_peak", "sdpa_ms", "sdpa_metric", "ratio"),
           metric="GB/s")
    prefill = _prefill(shapes, device, generator, timer)
    _print(prefill, ("shape", "triton_ms", "metric", "sdpa_ms", "sdpa_metric", "ratio"), metric="TFLOP/s")
    cpu_rows = []
    prefill_rows: list[cpu_prefill.PrefillRow] = []
    linears = []
    fused = []
    if device.type == "cpu":
        cpu_rows = cpu_attention.run_cpu_tables(cpu_attention.TINY if args.tiny else cpu_attention.FULL)
        prefill_rows = (cpu_prefill.prefill_rows(("tiny",), (16,), (0, 40), 1) if args.tiny
                        else cpu_prefill.prefill_rows(("tiny", "small"), (16, 64, 256, 1024), (0, 256, 1024), 7))
        cpu_prefill.print_rows(prefill_rows)
        linears = (cpu_linears.linear_rows(("tiny",), (4,), 1) if args.tiny
                   else cpu_linears.linear_rows(("tiny", "small"), (1, 4, 8, 32, 2048), 7))
        ops = cpu_fused_ops(torch.float32, device)
        if ops is None:
            print("CPU elementwise steps: the fused routines did not build here (see the warning above)\n")
        else:
            fused = (cpu_fused.fused_rows(ops, ("tiny",), (4,), 1) if args.tiny
                     else cpu_fused.fused_rows(ops, ("tiny", "small"), (4, 32, 2048), 15))
    if args.json is not None:
        args.json.write_text(json.dumps({"device": name, "rows": [asdict(r) for r in rows + decode + prefill],
                                         "cpu_rows": [asdict(r) for r in cpu_rows],
                                         "cpu_prefill": [asdict(r) for r in prefill_rows],
                                         "cpu_linears": [asdict(r) for r in linears],
                                         "cpu_fused": [asdict(r) for r in fused]}, default=str, indent=1))
    if not all(row.ok for row in rows):
        raise SystemExit("unified_attention disagrees with the reference")
    if any(row.max_error is None or row.max_error > cpu_attention.MAX_ERROR
           for row in [*cpu_rows, *prefill_rows]):
        raise SystemExit("the production CPU attention disagrees with the reference")


def _paged(shapes: Shapes, num_heads: int, num_kv_heads: int, query_lens: Sequence[int], seq_lens: Sequence[int],
           device: torch.device, generator: torch.Generator) -> PagedBatch:
    return random_paged_batch(query_lens, seq_lens, num_heads, num_kv_heads, shapes.head_dim, shapes.block_size,
                              shapes.dtype, device, generator)


class _Timer:
    def __init__(self, device: torch.device, rep_ms: float) -> None:
        self.device = device
        self.rep_ms = rep_ms

    def __call__(self, fn: Callable[[], object]) -> float:
        """Mean milliseconds per call: CUDA events on GPU, one wall-clock run on CPU."""
        if self.device.type == "cuda":
            from triton.testing import do_bench

            return float(do_bench(fn, warmup=max(1, int(self.rep_ms / 4)), rep=max(1, int(self.rep_ms))))
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    def or_none(self, fn: Callable[[], object]) -> float | None:
        """For the baseline: no fused backend for a shape, or out of memory, leaves its cell empty."""
        try:
            return self(fn)
        except (torch.cuda.OutOfMemoryError, RuntimeError) as error:
            print(f"SDPA baseline skipped: {str(error).splitlines()[0]}")
            _release(self.device)
            return None


def _kernel() -> Callable[..., torch.Tensor]:
    from pagedllm.kernels import unified_attention

    return unified_attention


def _correctness(shapes: Shapes, device: torch.device, generator: torch.Generator) -> list[Row]:
    rows = []
    for num_heads, num_kv_heads, query_lens, seq_lens in shapes.correctness:
        batch = _paged(shapes, num_heads, num_kv_heads, query_lens, seq_lens, device, generator)
        expected = unified_attention_ref(*batch.args()).float()
        actual = _kernel()(*batch.args()).float()
        error = float((actual - expected).abs().max())
        ok = bool(torch.allclose(actual, expected, atol=BF16_ATOL, rtol=BF16_RTOL))
        shape = f"GQA {num_heads // num_kv_heads} ({num_heads}/{num_kv_heads}) q {list(query_lens)} ctx {list(seq_lens)}"
        rows.append(Row("correctness", shape, max_abs_error=error, ok=ok))
    return rows


def _decode(shapes: Shapes, device: torch.device, generator: torch.Generator, timer: _Timer,
            peak: float | None) -> list[Row]:
    rows = []
    attention = _kernel()
    heads, kv_heads, dim = shapes.num_heads, shapes.num_kv_heads, shapes.head_dim
    for context in shapes.decode_contexts:
        for batch_size in shapes.decode_batches:
            batch = _paged(shapes, heads, kv_heads, [1] * batch_size, [context] * batch_size, device, generator)
            out = torch.empty_like(batch.q)
            triton_ms = timer(lambda: attention(*batch.args(), out=out))
            kv_bytes = 2 * batch_size * context * kv_heads * dim * batch.k_cache.element_size()
            splits = plan_attention(batch_size, batch_size, heads, kv_heads, dim, batch.block_table.shape[1] *
                                    shapes.block_size, _num_sms(device)).num_splits
            del batch
            q = torch.randn(batch_size, heads, 1, dim, device=device, dtype=shapes.dtype, generator=generator)
            k = torch.randn(batch_size, kv_heads, context, dim, device=device, dtype=shapes.dtype, generator=generator)
            v = torch.randn_like(k)
            sdpa_ms = timer.or_none(lambda: _sdpa(q, k, v, causal=False))
            del q, k, v
            bandwidth = kv_bytes / (triton_ms * 1e-3) / 1e9
            rows.append(Row("decode", f"batch {batch_size} x ctx {context}", triton_ms, sdpa_ms, bandwidth,
                            None if sdpa_ms is None else kv_bytes / (sdpa_ms * 1e-3) / 1e9,
                            None if peak is None else bandwidth * 1e9 / peak, splits=splits))
            _release(device)
    return rows


def _prefill(shapes: Shapes, device: torch.device, generator: torch.Generator, timer: _Timer) -> list[Row]:
    rows = []
    attention = _kernel()
    heads, kv_heads, dim = shapes.num_heads, shapes.num_kv_heads, shapes.head_dim
    for chunk in shapes.prefill_chunks:
        # Causal: query i sees i + 1 keys; two matmuls of 2 flops per multiply-add.
        flops = 2 * 2 * heads * dim * chunk * (chunk + 1) / 2
        batch = _paged(shapes, heads, kv_heads, [chunk], [chunk], device, generator)
        out = torch.empty_like(batch.q)
        triton_ms = timer(lambda: attention(*batch.args(), out=out))
        del batch
        q = torch.randn(1, heads, chunk, dim, device=device, dtype=shapes.dtype, generator=generator)
        k = torch.randn(1, kv_heads, chunk, dim, device=device, dtype=shapes.dtype, generator=generator)
        v = torch.randn_like(k)
        sdpa_ms = timer.or_none(lambda: _sdpa(q, k, v, causal=True))
        del q, k, v
        rows.append(Row("prefill", f"chunk {chunk}", triton_ms, sdpa_ms, flops / (triton_ms * 1e-3) / 1e12,
                        None if sdpa_ms is None else flops / (sdpa_ms * 1e-3) / 1e12))
        _release(device)
    return rows


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """The baseline on contiguous K/V; on CUDA only fused backends, so it is never the
    unfused math path (which would also copy K/V once per query head)."""
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    with sdpa_kernel(fused):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _release(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _print(rows: list[Row], columns: tuple[str, ...], metric: str = "") -> None:
    titles = {"shape": f"{rows[0].section}", "max_abs_error": "max abs error vs reference", "ok": "ok",
              "splits": "KV splits", "triton_ms": "triton ms", "metric": f"triton {metric}", "of_peak": "of peak",
              "sdpa_ms": "SDPA ms", "sdpa_metric": f"SDPA {metric}", "ratio": "triton / SDPA speed"}
    print("| " + " | ".join(titles[c] for c in columns) + " |")
    print("|" + "|".join("---" for _ in columns) + "|")
    for row in rows:
        print("| " + " | ".join(_cell(row, c) for c in columns) + " |")
    print()


def _cell(row: Row, column: str) -> str:
    if column == "ratio":
        return "-" if row.triton_ms is None or row.sdpa_ms is None else f"{row.sdpa_ms / row.triton_ms:.2f}x"
    value = getattr(row, column)
    if value is None:
        return "-"
    if column == "of_peak":
        return f"{value:.0%}"
    if column == "ok":
        return "yes" if value else "NO"
    if column == "max_abs_error":
        return f"{value:.2e}"
    if isinstance(value, float):
        return f"{value:.0f}" if value >= 100 else f"{value:.3g}"
    return str(value)
