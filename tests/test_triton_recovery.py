"""``pagedllm serve`` recovers from a dead engine (issue 14), against a real tritonserver.

One ``pagedllm serve`` process for the module, its supervision folder named by the
test (``PAGEDLLM_SUPERVISOR_DIR``) and fault injection on. The tests run in file
order, each starting from the state the previous one left:

1. ``kill -9`` of the backend stub with 16 streams running;
2. the engine loop dies (through the fault-injection hook) with 16 streams running;
3. the model's ``model.json`` is broken and the engine dies again: the reload fails
   and, with ``--max-reloads 1``, ``pagedllm serve`` exits non-zero naming the cause.

Times are printed (the issue asks for readiness false within 2 s and back within
30 s); the assertions only bound them generously, to avoid hangs.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from installed import need
need("tritonclient.grpc")
import shm_regions  # noqa: E402
from test_triton_server import StreamClient, StreamResult, make_inputs, greedy  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.platform.processes import child_pids, free_port  # noqa: E402
from pagedllm.serving.supervisor_folder import DIR_VARIABLE, FAULT_INJECTION_VARIABLE, SupervisorFolder  # noqa: E402

pytestmark = [pytest.mark.tritonserver, pytest.mark.server]

REPO_ROOT = Path(__file__).resolve().parents[1]
NUM_STREAMS = 16
# Streams long enough that none can end between being read as running and the kill, on any machine CI draws
# (with 200 tokens, a fast one once saw all 16 finish in that window); blocks for all of them at once.
ENGINE_ARGS = {"dtype": "float32", "device": "cpu", "max_model_len": 1024, "num_kv_blocks": 1100, "max_num_seqs": 32}


@dataclass
class Serve:
    process: subprocess.Popen[str]
    output: list[str]
    folder: SupervisorFolder
    model_json: Path
    grpc_url: str
    http_url: str
    metrics_url: str
    health_url: str

    def health(self) -> tuple[int, str]:
        response = requests.get(self.health_url, timeout=30)
        return response.status_code, response.text

    def ready(self) -> bool:
        try:
            return requests.get(f"{self.http_url}/v2/models/llm/ready", timeout=1).status_code == 200
        except requests.RequestException:
            return False

    def stub_pid(self) -> int:
        (server,) = child_pids(self.process.pid)
        stubs = [pid for pid in child_pids(server) if b"triton_python_backend_stub" in _cmdline(pid)]
        assert len(stubs) == 1, stubs
        return stubs[0]

    def restarts(self) -> float | None:
        for line in requests.get(self.metrics_url, timeout=10).text.splitlines():
            if line.startswith("pagedllm:engine_restarts_total{") and 'model="llm"' in line:
                return float(line.rsplit(" ", 1)[1])
        return None


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def wait_until(condition: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> float:
    """Seconds until ``condition()`` held; fails the test after ``timeout_s``."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, f"not within {timeout_s} s"
        time.sleep(interval_s)
    return time.monotonic() - started


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def offline(model_dir: Path) -> LLM:
    return LLM(model=str(model_dir), **ENGINE_ARGS)


def start_serve(root: Path, model_json: dict[str, object], *args: str) -> Serve:
    """``pagedllm serve`` of one model ``llm`` (its ``model.json`` as given) with a supervision folder and fault
    injection, on free ports; returns once it says it is ready (``stop_serve`` ends it)."""
    version = root / "repo" / "llm" / "1"
    version.mkdir(parents=True)
    (root / "repo" / "llm" / "config.pbtxt").write_text(
        (REPO_ROOT / "model_repository" / "llm" / "config.pbtxt").read_text())
    (version / "model.json").write_text(json.dumps(model_json))
    (root / "supervision").mkdir()
    grpc, http, metrics, health = free_port(), free_port(), free_port(), free_port()
    env = {**os.environ, DIR_VARIABLE: str(root / "supervision"), FAULT_INJECTION_VARIABLE: "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "pagedllm.cli", "serve", "--model-repository", str(root / "repo"), "--host", "127.0.0.1",
         "--grpc-port", str(grpc), "--http-port", str(http), "--metrics-port", str(metrics),
         "--health-port", str(health), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    output: list[str] = []
    threading.Thread(target=lambda: output.extend(iter(process.stdout.readline, "")), daemon=True).start()
    running = Serve(process, output, SupervisorFolder(root / "supervision"), version / "model.json",
                    f"127.0.0.1:{grpc}", f"http://127.0.0.1:{http}", f"http://127.0.0.1:{metrics}/metrics",
                    f"http://127.0.0.1:{health}/health")
    deadline = time.monotonic() + 300
    while not any("Ctrl-C stops the server" in line for line in output):
        if process.poll() is not None or time.monotonic() > deadline:
            stop_serve(running)
            raise AssertionError("".join(output[-40:]))
        time.sleep(0.2)
    return running


def stop_serve(serve: Serve) -> None:
    """SIGINT, as a user's Ctrl-C; killed if it has not exited within a minute."""
    if serve.process.poll() is None:
        serve.process.send_signal(signal.SIGINT)
        try:
            serve.process.wait(60)
        except subprocess.TimeoutExpired:
            shm_regions.kill_tree(serve.process)


@pytest.fixture(scope="module")
def serve(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    # The deaths here are the tests' own, each after the server came back: not a crash loop.
    running = start_serve(tmp_path_factory.mktemp("recovery"), {"model": str(model_dir), **ENGINE_ARGS},
                          "--max-reloads", "1", "--crash-loop-s", "0")
    try:
        yield running
    finally:
        stop_serve(running)
        print("".join(line for line in running.output
                      if "pagedllm" in line or "error" in line or "loading" in line)[-6000:])


STREAM_TOKENS = 1000


def stream_prompt(i: int) -> str:
    return f"def f{i}(x):"


def start_streams(serve: Serve) -> tuple[list[StreamClient], list[StreamResult]]:
    clients = [StreamClient(serve.grpc_url) for _ in range(NUM_STREAMS)]
    results = [client.send(f"s{i}", make_inputs(stream_prompt(i), greedy(STREAM_TOKENS, ignore_eos=True), stream=True))
               for i, client in enumerate(clients)]
    wait_until(lambda: all(result.texts for result in results), timeout_s=120)
    return clients, results


def in_flight(results: list[StreamResult]) -> list[StreamResult]:
    """The streams still running, read just before the engine is killed: only they must fail. On a fast
    machine a 200-token stream can finish while the others are still starting (CI saw it once)."""
    running = [result for result in results if not result.done.is_set()]
    assert running, "every stream finished before the engine was killed: the test checks nothing"
    return running


def check_cut_or_whole(running: list[StreamResult], results: list[StreamResult], offline: LLM,
                       causes: tuple[str, ...], any_of: tuple[str, ...] = ()) -> None:
    """The engine's death must cut some of the streams read as running, each with an error naming
    every one of ``causes`` (and one of ``any_of``, when given); any other stream must have finished
    whole. A stream a token or two from its end can still finish: the loop dies at its next step, not
    at once, and a final response already on the wire reaches its client after a SIGKILL (CI saw each
    once)."""
    cut = [result for result in running if result.error is not None]
    assert cut, "no stream running when the engine was killed was failed by it"
    print(f"\n{len(cut)} of {len(running)} running streams were cut; their errors: "
          f"{sorted({result.error for result in cut})}")
    for result in cut:
        assert all(cause in result.error for cause in causes), result.error
        assert not any_of or any(cause in result.error for cause in any_of), result.error
    whole = SamplingParams(temperature=0, max_tokens=STREAM_TOKENS, ignore_eos=True)
    for i, result in enumerate(results):
        if result.error is None:
            expected = offline.generate([stream_prompt(i)], whole)[0].outputs[0].text
            assert result.text() == expected, f"stream s{i} ended early without an error"


def close_all(clients: list[StreamClient]) -> None:
    for client in clients:
        try:
            client.close()
        except Exception:  # a client whose server went away may fail to close its stream cleanly
            pass


def check_serving_again(serve: Serve, offline: LLM, restarts: float) -> None:
    prompt = "class Value:"
    expected = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=20))[0].outputs[0].text
    client = StreamClient(serve.grpc_url)
    try:
        result = client.send("after", make_inputs(prompt, greedy(20), stream=True))
        assert result.done.wait(120), "no final response after the restart"
    finally:
        client.close()
    assert result.error is None and result.text() == expected
    seen: list[float | None] = []
    try:
        wait_until(lambda: seen.append(serve.restarts()) or seen[-1] == restarts, timeout_s=30, interval_s=0.2)
    except AssertionError:
        raise AssertionError(f"pagedllm:engine_restarts_total: expected {restarts}, saw {sorted(set(map(str, seen)))}")


def test_a_killed_stub_fails_its_streams_and_the_server_comes_back(serve: Serve, offline: LLM) -> None:
    assert serve.ready()
    restarts_before = serve.restarts() or 0
    assert serve.health() == (200, "ok")
    clients, results = start_streams(serve)
    try:
        running = in_flight(results)
        stub = serve.stub_pid()
        stub_regions = shm_regions.named_by([stub])
        os.kill(stub, signal.SIGKILL)
        try:
            not_ready_after = wait_until(lambda: not serve.ready(), timeout_s=10)
            status, reason = serve.health()  # the liveness route runs a real step, which cannot happen now
            assert status == 503 and "model 'llm'" in reason
            for result in results:
                assert result.done.wait(60), "a stream hung after its engine died"
            back_after = wait_until(serve.ready, timeout_s=180, interval_s=0.2)
        finally:
            # The killed stub's region: tritonserver does not remove it. Removed even when a check fails, so
            # that one failure is not also read as a leak at the end of the run.
            shm_regions.remove_unmapped(stub_regions)
    finally:
        close_all(clients)
    print(f"\nkill -9: not ready after {not_ready_after:.2f} s, ready again after {not_ready_after + back_after:.1f} s")
    # The supervisor restarts tritonserver, so a cut stream sees its server go (gRPC UNAVAILABLE); one whose
    # response tritonserver failed first reads that the stub is not healthy.
    check_cut_or_whole(running, results, offline, causes=(), any_of=("StatusCode.UNAVAILABLE", "not healthy"))
    check_serving_again(serve, offline, restarts=restarts_before + 1)
    assert serve.health() == (200, "ok")
    assert stub_regions, "the stub named no shared-memory region"
    causes = [line for line in serve.output if "pagedllm: " in line and "restart #" in line]
    died = [line for line in causes if "backend stub of model 'llm'" in line and "died:" in line]
    # Usually the supervisor finds the stub gone and says so; if tritonserver went down with it
    # before the supervisor looked, the logged cause is that (CI saw a restart without a "died:" line
    # once; the output is in the message to tell which).
    assert died or any("tritonserver is not running" in line for line in causes), \
        "the restart's cause was not logged:\n" + "\n".join(serve.output[-60:])
    # The supervisor names the signal when it reads the dead stub before tritonserver reaps it;
    # on a loaded machine tritonserver can reap it first, and the status is then unknown.
    if died:
        assert any("killed by signal 9" in line or "exit status unknown" in line for line in died), died


def test_a_dead_engine_loop_fails_its_streams_and_the_model_is_reloaded(serve: Serve, offline: LLM) -> None:
    # Counted from here: the server is shared with the other tests of this module, whichever of them ran,
    # and one that failed may have left it restarting.
    wait_until(serve.ready, timeout_s=180, interval_s=0.2)
    restarts_before = serve.restarts() or 0
    clients, results = start_streams(serve)
    try:
        running = in_flight(results)
        serve.folder.request_engine_death("llm")
        not_ready_after = wait_until(lambda: not serve.ready(), timeout_s=10)
        for result in results:
            assert result.done.wait(60), "a stream hung after its engine died"
        back_after = wait_until(serve.ready, timeout_s=180, interval_s=0.2)
    finally:
        close_all(clients)
    print(f"\nloop death: not ready after {not_ready_after:.2f} s, ready again after "
          f"{not_ready_after + back_after:.1f} s")
    check_cut_or_whole(running, results, offline, causes=("injected engine death", "the engine is restarting"))
    check_serving_again(serve, offline, restarts=restarts_before + 1)
    assert any("injected engine death" in line and "reloading model 'llm'" in line for line in serve.output)


def test_a_reload_that_keeps_failing_makes_serve_exit_naming_the_cause(serve: Serve) -> None:
    wait_until(serve.ready, timeout_s=180, interval_s=0.2)
    serve.model_json.write_text(json.dumps({**json.loads(serve.model_json.read_text()), "max_num_seqz": 8}))
    client = StreamClient(serve.grpc_url)
    try:
        serve.folder.request_engine_death("llm")  # the hook fires at the next step: give it one
        client.send("trigger", make_inputs("while", greedy(8), stream=True)).done.wait(60)
    finally:
        client.close()
    code = serve.process.wait(240)
    output = "".join(serve.output)
    assert code == 1, output[-3000:]
    assert "gave up after 1 failed restarts in a row" in output and "max_num_seqz" in output, output[-3000:]
