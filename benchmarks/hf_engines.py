"""The transformers baselines: ``generate`` on static padded batches, and its own continuous batching.

Both load the same checkpoint in the bench's dtype (float32 unless told) and replay the same token ids.
``generate`` runs FCFS batches of ``max_num_seqs`` requests, left-padded, each
for the longest ``max_tokens`` in the batch (it has no per-row budget), so
short requests ride along as wasted rows: that is what static batching costs.
``hf-continuous`` is transformers' ``ContinuousBatchingManager`` (paged cache,
per-request ``max_new_tokens``), sized like our engine: same block size, same
KV slots, same per-step token budget and batch size.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from pagedllm_bench.engines import EngineSettings, RunResult
from pagedllm.simulation.workloads import Workload, WorkloadRequest

PAD_ID = 0
STALL_TIMEOUT_S = 120.0  # no sample finished for this long: the manager is stuck


def load(model_dir: Path, dtype: str = "float32") -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()


def run_hf_generate(model_dir: Path, workload: Workload, settings: EngineSettings) -> RunResult:
    model = load(model_dir, settings.dtype)
    _generate_batch(model, [WorkloadRequest((1, 2, 3), 2)])
    requests = workload.requests
    batches = [requests[i : i + settings.max_num_seqs] for i in range(0, len(requests), settings.max_num_seqs)]
    outputs: list[list[int]] = []
    computed = 0
    start = time.perf_counter()
    for batch in tqdm(batches, desc="hf-generate batches"):
        rows, steps = _generate_batch(model, batch)
        outputs.extend(rows)
        computed += steps * sum(r.n for r in batch)
    seconds = time.perf_counter() - start
    samples = {i: outputs[i] for i in range(min(settings.sample_requests, len(outputs)))}
    return RunResult("hf-generate", seconds, workload.num_output_tokens, computed, samples)


def _generate_batch(model: Any, batch: Sequence[WorkloadRequest]) -> tuple[list[list[int]], int]:
    """Generate one left-padded batch; returns each request's first sample (cut to its max_tokens) and the steps run."""
    from transformers import GenerationConfig

    width = max(len(r.prompt_token_ids) for r in batch)
    ids = torch.full((len(batch), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, request in enumerate(batch):
        prompt = torch.tensor(request.prompt_token_ids)
        ids[row, width - len(prompt) :] = prompt
        mask[row, width - len(prompt) :] = 1
    steps = max(r.max_tokens for r in batch)
    first = batch[0]
    sampling = first.temperature > 0
    # EOS off: every row runs the full budget, as ignore_eos does in the other engines.
    config = GenerationConfig(
        do_sample=sampling, temperature=first.temperature if sampling else None, top_k=None, top_p=None,
        num_return_sequences=first.n, max_new_tokens=steps, eos_token_id=None, pad_token_id=PAD_ID,
    )
    if first.seed is not None:
        torch.manual_seed(first.seed)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    rows = [out[row * first.n, width : width + request.max_tokens].tolist() for row, request in enumerate(batch)]
    return rows, steps


def run_hf_continuous(model_dir: Path, workload: Workload, settings: EngineSettings) -> RunResult:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model = load(model_dir, settings.dtype)
    first = workload.requests[0]
    sampling = first.temperature > 0
    config = GenerationConfig(
        do_sample=sampling, temperature=first.temperature if sampling else None, top_k=None, top_p=None,
        num_return_sequences=first.n, eos_token_id=-1, pad_token_id=PAD_ID,
        max_new_tokens=max(r.max_tokens for r in workload.requests),
    )
    tokens_per_block = settings.block_size
    cb = ContinuousBatchingConfig(
        page_size=tokens_per_block,
        num_blocks=settings.max_num_seqs * -(-settings.max_model_len // tokens_per_block),
        max_batch_tokens=settings.max_num_batched_tokens,
        max_requests_per_batch=settings.max_num_seqs,
        use_cuda_graph=False,
        use_async_batching=False,
        seed=workload.seed,
    )
    results: dict[str, list[int]] = {}
    with model.continuous_batching_context_manager(
        generation_config=config, continuous_batching_config=cb, warmup=False
    ) as manager:
        _collect(manager, {"warmup": WorkloadRequest((1, 2, 3), 2, n=first.n)})
        start = time.perf_counter()
        results = _collect(manager, {f"r{i}": r for i, r in enumerate(workload.requests)})
        seconds = time.perf_counter() - start
    computed = sum(len(tokens) for tokens in results.values())
    if computed != workload.num_output_tokens:
        raise RuntimeError(f"hf-continuous produced {computed} tokens, the workload asks for {workload.num_output_tokens}")
    samples = {i: results[f"r{i}"] for i in range(min(settings.sample_requests, len(workload.requests)))}
    return RunResult("hf-continuous", seconds, workload.num_output_tokens, computed, samples)


def _collect(manager: Any, requests: dict[str, WorkloadRequest]) -> dict[str, list[int]]:
    """Submit every request, then wait until all their samples (children included) have finished."""
    expected = sum(r.n for r in requests.values())
    for request_id, request in requests.items():
        manager.add_request(list(request.prompt_token_ids), request_id=request_id,
                            max_new_tokens=request.max_tokens, eos_token_id=-1)
    results: dict[str, list[int]] = {}
    deadline = time.monotonic() + STALL_TIMEOUT_S
    with tqdm(total=expected, desc="hf-continuous", disable="warmup" in requests) as bar:
        while len(results) < expected:
            out = manager.get_result(timeout=1.0)
            if out is None:
                if not manager.is_running() or time.monotonic() > deadline:
                    raise RuntimeError(f"transformers continuous batching stopped after {len(results)}/{expected} samples")
                continue
            if out.is_finished() and out.request_id.split("__child#")[0] in requests:
                results[out.request_id] = list(out.generated_tokens)
                deadline = time.monotonic() + STALL_TIMEOUT_S
                bar.update(1)
    return results
