"""Tensor parallelism on the CPU: greedy tokens at TP=2 equal transformers' and TP=1's, token for token.

Each engine here is rank 0 of a two-process group; its worker is a real child
process that loads its own half of the checkpoint. The forward's all-reduces and
logits gather go through the ranks' shared-memory segment (gloo carries the step
broadcasts); ``test_tensor_parallel_shm.py`` tests the collectives themselves. The matrix covers the four
architectures under a tight pool (preemption and chunked prefill asserted),
prefix-cache hits and beam search, and a checkpoint built to stress the
sharding rules: one KV head for two ranks (replicated), a vocabulary that does
not divide by two, tied embeddings, and biases on the row-parallel o_proj and
down_proj (added once, after the all-reduce).

The default run takes llama through the whole matrix (each architecture costs
~40 s on two cores); ``pytest --full`` runs mistral, qwen2 and
qwen3 through it too.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import full_run

from pagedllm import LLM, SamplingParams
from pagedllm.executor.workers import WorkerDied
from pagedllm.planning.kv_math import kv_bytes_per_token
from pagedllm.planning.model_catalog import resolve_model
from pagedllm.testing.tiny_model import make_tiny_model
from pagedllm.worker.model_runner import ModelRunner

from test_engine_exactness import (ARCHS, NEW_TOKENS, assert_matches_reference, generate,  # noqa: E402
                                   random_prompts, shared_prefix_prompts)

FULL_MATRIX = full_run.full()
MATRIX_ARCHS = ARCHS if FULL_MATRIX else ("llama",)
BEAM = SamplingParams(beam_width=3, n=2, max_tokens=12, temperature=0.0, ignore_eos=True)


def _beams(llm: LLM, prompt: list[int]) -> list[tuple[list[int], float]]:
    out = llm.generate({"prompt_token_ids": prompt}, BEAM)[0]
    return [(o.token_ids, round(o.cumulative_logprob, 3)) for o in out.outputs]


@pytest.mark.slow
@pytest.mark.parametrize("arch", MATRIX_ARCHS)
def test_tp2_matches_transformers_under_preemption_prefix_hits_and_beams(
        arch: str, tiny_model_dir: Callable[[str], Path]) -> None:
    model_dir = tiny_model_dir(arch)
    prompts = random_prompts(seed=1, count=8)
    shared = shared_prefix_prompts(seed=2)
    longest = max(len(p) for p in prompts) + NEW_TOKENS
    settings = dict(dtype="float32", num_kv_blocks=-(-longest // 16) + 2, max_num_batched_tokens=32, max_num_seqs=4)
    with LLM(str(model_dir), **settings) as single:
        beams_tp1 = _beams(single, shared[0])
    with LLM(str(model_dir), tensor_parallel_size=2, **settings) as llm:
        assert_matches_reference(model_dir, prompts, generate(llm, prompts))
        assert llm.stats().num_preemptions > 0
        assert_matches_reference(model_dir, shared, generate(llm, shared))
        assert llm.stats().prefix_cache_hit_tokens > 0
        assert _beams(llm, shared[0]) == beams_tp1
        stats = llm.stats()
        assert stats.num_blocks_free == stats.num_blocks_total


@pytest.fixture(scope="module")
def awkward_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One KV head, an odd vocabulary, tied embeddings, biases on every projection."""
    return make_tiny_model(tmp_path_factory.mktemp("tp-awkward"), arch="llama", overrides={
        "num_key_value_heads": 1, "vocab_size": 2051, "tie_word_embeddings": True,
        "attention_bias": True, "mlp_bias": True})


def test_tp2_replicated_kv_head_odd_vocab_and_row_parallel_biases(awkward_model: Path) -> None:
    prompts = random_prompts(seed=3, count=8)
    # Rank 0 samples from the gathered logits: n > 1, logprobs and stop strings see the whole vocabulary as
    # at TP=1.
    sampled = SamplingParams(n=2, temperature=0.0, max_tokens=16, logprobs=3, stop=["e"])
    with LLM(str(awkward_model), dtype="float32") as single:
        want = single.generate("def f(x): return x", sampled)[0]
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("two ranks need two CPUs")
    with LLM(str(awkward_model), dtype="float32", tensor_parallel_size=2, cpu_bind=f"{cpus[0]},{cpus[1]}") as llm:
        assert llm.engine.model.tp.shm is not None  # the collectives go through shared memory
        (worker,) = llm.engine.workers.pids()
        assert (os.sched_getaffinity(0), os.sched_getaffinity(worker)) == ({cpus[0]}, {cpus[1]})
        assert llm.engine.model.num_kv_heads == 1  # each rank holds the one KV head
        assert llm.engine.model.layout.vocab_per_rank == 1026
        assert_matches_reference(awkward_model, prompts, generate(llm, prompts))
        got = llm.generate("def f(x): return x", sampled)[0]
        with pytest.raises(ValueError, match="prompt_logprobs is not supported with tensor_parallel_size > 1"):
            llm.generate("x", SamplingParams(prompt_logprobs=1))
    assert os.sched_getaffinity(0) == set(cpus)  # rank 0's CPUs came back
    for mine, theirs in zip(got.outputs, want.outputs, strict=True):
        assert (mine.token_ids, mine.text, mine.finish_reason) == (theirs.token_ids, theirs.text, theirs.finish_reason)
        for step, other in zip(mine.logprobs, theirs.logprobs, strict=True):
            assert step.keys() == other.keys()
            assert all(abs(step[t] - other[t]) < 1e-4 for t in step)


def test_tp_kv_cache_is_per_rank(tiny_model_dir: Callable[[str], Path]) -> None:
    """At the same per-rank budget, two ranks holding one of two KV heads each fit twice the blocks."""
    model_dir = str(tiny_model_dir("llama"))
    budget = 0.01
    with LLM(model_dir, dtype="float32", kv_cache_memory_gb=budget) as one, \
            LLM(model_dir, dtype="float32", kv_cache_memory_gb=budget, tensor_parallel_size=2) as two:
        per_block = [ModelRunner.bytes_per_block(llm.engine.model, 16, torch.float32) for llm in (one, two)]
        assert per_block[0] == 2 * per_block[1]
        for llm, size in zip((one, two), per_block):
            assert llm.stats().num_blocks_total == int(budget * (1 << 30)) // size
        # pagedllm plan counts what the engine allocates, per rank, by the same sharding rules.
        spec = resolve_model(model_dir)
        for size, tp in zip(per_block, (1, 2)):
            assert kv_bytes_per_token(spec, "float32", tp) * 16 == size


@pytest.mark.parametrize(("size", "message"), [
    (0, "expected a positive integer"),
    ("2", "expected a positive integer"),
    (3, "tensor_parallel_size=3 does not divide the model's 4 attention heads"),
])
def test_bad_tensor_parallel_size_fails_naming_it(size: object, message: str,
                                                   tiny_model_dir: Callable[[str], Path]) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_model_dir("llama")), dtype="float32", tensor_parallel_size=size)


def test_killed_worker_fails_the_step_naming_its_rank(tiny_model_dir: Callable[[str], Path]) -> None:
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", tensor_parallel_size=2)
    try:
        (worker,) = llm.engine.workers.pids()
        os.kill(worker, signal.SIGKILL)
        with pytest.raises(WorkerDied, match=rf"rank 1 \(pid {worker}\) was killed by SIGKILL"):
            llm.generate("def f(x):", SamplingParams(max_tokens=8))
    finally:
        llm.close()


GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.mark.slow
def test_a_second_tp_llm_names_the_open_one_and_takes_over_from_a_dropped_one(
        tiny_model_dir: Callable[[str], Path]) -> None:
    model = str(tiny_model_dir("llama"))
    first = LLM(model, tensor_parallel_size=2)
    (worker,) = first.engine.workers.pids()
    with pytest.raises(RuntimeError, match=r"LLM is still open in this process .* call close\(\) on it") as error:
        LLM(model, tensor_parallel_size=2)
    assert "\n" not in str(error.value)
    del error
    assert _alive(worker)
    expected = first.generate("def f(x):", GREEDY)[0].outputs[0].token_ids  # the open one is unharmed
    del first  # dropped without close(), as notebooks do
    second = LLM(model, tensor_parallel_size=2)
    try:
        assert not _alive(worker), "the dropped engine's worker is still running"
        assert second.generate("def f(x):", GREEDY)[0].outputs[0].token_ids == expected
    finally:
        second.close()


def test_workers_do_not_outlive_a_killed_engine(tiny_model_dir: Callable[[str], Path]) -> None:
    script = textwrap.dedent(f"""
        import sys, time
        from pagedllm import LLM
        llm = LLM({str(tiny_model_dir("llama"))!r}, dtype="float32", tensor_parallel_size=2)
        print(*llm.engine.workers.pids(), flush=True)
        time.sleep(600)
    """)
    engine = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(engine.stdout.readline())  # type: ignore[union-attr]
        assert _alive(worker)
        engine.kill()
        engine.wait()
        deadline = time.monotonic() + 10
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker), "the worker outlived its killed engine"
    finally:
        engine.kill()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
