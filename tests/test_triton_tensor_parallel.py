"""``pagedllm serve`` with ``tensor_parallel_size: 2`` on a real tritonserver: exact streams, and its faults.

One server for the module, run in file order: streams through tritonclient gRPC and
the OpenAI endpoint equal the offline engine's greedy text; ``kill -9`` of the stub
leaves no worker behind; ``kill -9`` of the worker fails the running streams naming
its rank, after which the server serves exact tokens again and counts the restart;
a worker that dies right after every restart is a crash loop, and ``pagedllm serve``
exits 1 naming it. A second server shows that SIGINT with streams in flight ends
every process and leaves no shared-memory region behind (the time is printed).

Each restart reloads a two-rank engine (~30 s on two busy cores), so the default run
keeps the exact streams and the killed worker (the crash-loop rule itself is unit-tested in
``test_triton_recovery_units.py``); ``pytest --full`` adds the killed stub, the
crash loop and the SIGINT server.
"""
from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests

from installed import need

need("tritonclient.grpc")
import shm_regions  # noqa: E402
from test_triton_recovery import (ENGINE_ARGS, Serve, check_cut_or_whole, close_all, in_flight,  # noqa: E402
                                  start_serve, start_streams, stop_serve, wait_until)
from test_triton_server import StreamClient, greedy, make_inputs  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.engine.core_process import CHILD_MARKER  # noqa: E402
from pagedllm.executor.workers import WORKER_MARKER  # noqa: E402
from pagedllm.platform.processes import child_pids, free_port  # noqa: E402

pytestmark = [pytest.mark.tritonserver, pytest.mark.server]

MAX_RELOADS = 2  # the killed worker of one test, then the crash loop of the next
full_only = pytest.mark.full  # a restart costs ~30 s


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def offline(model_dir: Path) -> LLM:
    return LLM(model=str(model_dir), **ENGINE_ARGS)


def _start(model_dir: Path, root: Path, openai_port: int | None = None) -> Serve:
    extra = ["--openai-port", str(openai_port)] if openai_port is not None else []
    # Every death in this module comes soon after the last restart: each is a crash loop.
    return start_serve(root, {"model": str(model_dir), "tensor_parallel_size": 2, **ENGINE_ARGS},
                       "--max-reloads", str(MAX_RELOADS), "--crash-loop-s", "3600", *extra)


@pytest.fixture(scope="module")
def openai_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def serve(model_dir: Path, openai_port: int, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    running = _start(model_dir, tmp_path_factory.mktemp("tp-serve"), openai_port)
    try:
        yield running
    finally:
        stop_serve(running)
        print("".join(line for line in running.output if "pagedllm" in line or "rror" in line)[-6000:])


def descendants(pid: int) -> list[int]:
    found, frontier = [], [pid]
    while frontier:
        children = [child for parent in frontier for child in child_pids(parent)]
        found += children
        frontier = children
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def workers(serve: Serve) -> list[int]:
    return [pid for pid in descendants(serve.process.pid) if WORKER_MARKER in _cmdline(pid)]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def expected_text(offline: LLM, prompt: str, tokens: int) -> str:
    return offline.generate([prompt], SamplingParams(temperature=0, max_tokens=tokens))[0].outputs[0].text


def grpc_text(serve: Serve, prompt: str, tokens: int) -> str:
    client = StreamClient(serve.grpc_url)
    try:
        result = client.send(f"r-{time.monotonic_ns()}", make_inputs(prompt, greedy(tokens), stream=True))
        assert result.done.wait(120), "no final response"
    finally:
        client.close()
    assert result.error is None, result.error
    return result.text()


def test_tp2_streams_the_offline_tokens_over_grpc_and_openai(serve: Serve, offline: LLM, openai_port: int) -> None:
    assert len(workers(serve)) == 1
    for prompt in ("def fibonacci(n):", "import os\n"):
        assert grpc_text(serve, prompt, 32) == expected_text(offline, prompt, 32)
        answer = requests.post(f"http://127.0.0.1:{openai_port}/v1/completions", timeout=120, json={
            "model": "llm", "prompt": prompt, "max_tokens": 32, "temperature": 0})
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == expected_text(offline, prompt, 32)


@full_only
def test_a_killed_stub_leaves_no_worker_behind(serve: Serve) -> None:
    (worker,) = workers(serve)
    stubs = [pid for pid in descendants(serve.process.pid) if b"triton_python_backend_stub" in
             Path(f"/proc/{pid}/cmdline").read_bytes()]
    regions = shm_regions.named_by(stubs[:1])
    os.kill(stubs[0], signal.SIGKILL)
    wait_until(lambda: not _alive(worker), timeout_s=15)
    wait_until(serve.ready, timeout_s=240, interval_s=0.2)
    shm_regions.remove_unmapped(regions)  # the killed stub's region: tritonserver does not remove it


def test_a_killed_worker_fails_the_streams_naming_its_rank_and_the_engine_comes_back(serve: Serve,
                                                                                    offline: LLM) -> None:
    wait_until(serve.ready, timeout_s=240, interval_s=0.2)
    wait_until(lambda: len(workers(serve)) == 1, timeout_s=60)
    restarts_before = serve.restarts() or 0
    clients, results = start_streams(serve)
    try:
        running = in_flight(results)
        (worker,) = workers(serve)
        os.kill(worker, signal.SIGKILL)
        for result in results:
            assert result.done.wait(60), "a stream hung after its worker died"
        wait_until(lambda: not serve.ready(), timeout_s=30)
        wait_until(serve.ready, timeout_s=240, interval_s=0.2)
    finally:
        close_all(clients)
    check_cut_or_whole(running, results, offline, causes=("tensor-parallel worker rank 1", "SIGKILL"))
    assert grpc_text(serve, "class Value:", 20) == expected_text(offline, "class Value:", 20)
    wait_until(lambda: serve.restarts() == restarts_before + 1, timeout_s=30, interval_s=0.2)


@full_only
def test_a_worker_that_dies_after_every_restart_ends_serve_naming_the_cause(serve: Serve) -> None:
    for _ in range(MAX_RELOADS):  # the previous test's death already counted as one
        wait_until(lambda: serve.process.poll() is not None or (len(workers(serve)) == 1 and serve.ready()),
                   timeout_s=240, interval_s=0.2)
        if serve.process.poll() is not None:
            break  # serve gave up
        os.kill(workers(serve)[0], signal.SIGKILL)
        client = StreamClient(serve.grpc_url)
        try:  # the death is noticed at the next step: give it one
            client.send(f"trigger-{time.monotonic_ns()}", make_inputs("while", greedy(8), stream=True)).done.wait(60)
        finally:
            client.close()
    code = serve.process.wait(240)
    output = "".join(serve.output)
    assert code == 1, output[-3000:]
    assert f"gave up after {MAX_RELOADS} failed restarts in a row" in output and "crash loop" in output, output[-3000:]
    assert "tensor-parallel worker rank 1" in output, output[-3000:]


@full_only
def test_sigint_with_streams_in_flight_ends_every_process_and_leaves_no_shm(model_dir: Path,
                                                                             tmp_path: Path) -> None:
    serve = _start(model_dir, tmp_path)
    try:
        processes = [serve.process.pid, *descendants(serve.process.pid)]
        # Other servers may run beside this test: only the regions this server's processes map are its own.
        regions = {line.split()[-1] for pid in processes for line in _maps(pid) if "/dev/shm/" in line}
        assert regions, "the server maps no shared-memory region: nothing to check"
        assert any(WORKER_MARKER in _cmdline(pid) for pid in processes)
        assert any(CHILD_MARKER in _cmdline(pid) for pid in processes)
        clients, results = start_streams(serve)
        try:
            in_flight(results)
            started = time.monotonic()
            serve.process.send_signal(signal.SIGINT)
            # Hang guards, not the property: every process ends, and the time is printed.
            serve.process.wait(300)
            wait_until(lambda: not any(_alive(pid) for pid in processes), timeout_s=60)
            print(f"\nevery process of the TP server ended {time.monotonic() - started:.1f} s after SIGINT")
        finally:
            close_all(clients)
    finally:
        stop_serve(serve)
    left = sorted(region for region in regions if Path(region).exists())
    assert not left, f"shared memory left behind: {left}"


def _maps(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:
        return []
