"""``pagedllm serve`` as the README runs it, with the gRPC client example, then Ctrl-C."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.platform.processes import free_port
from shm_regions import kill_tree

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.tritonserver
@pytest.mark.server
def test_serve_then_grpc_client_example_then_ctrl_c(tiny_model_dir, tmp_path: Path) -> None:
    model = tiny_model_dir("llama")
    version = tmp_path / "repo" / "llm" / "1"
    version.mkdir(parents=True)
    (tmp_path / "repo" / "llm" / "config.pbtxt").write_text(
        (REPO_ROOT / "model_repository" / "llm" / "config.pbtxt").read_text())
    (version / "model.json").write_text(json.dumps({"model": str(model), "dtype": "float32", "device": "cpu",
                                                    "num_kv_blocks": 32, "max_model_len": 128}))
    grpc, http, metrics = free_port(), free_port(), free_port()
    serve = subprocess.Popen(
        [sys.executable, "-m", "pagedllm.cli", "serve", "--model-repository", str(tmp_path / "repo"),
         "--grpc-port", str(grpc), "--http-port", str(http), "--metrics-port", str(metrics), "--host", "127.0.0.1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(iter(serve.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300
        while not any("Ctrl-C stops the server" in line for line in output):
            assert serve.poll() is None and time.monotonic() < deadline, "".join(output[-40:])
            time.sleep(0.2)
        assert any(f"gRPC     127.0.0.1:{grpc}" in line for line in output)
        client = subprocess.run(
            [sys.executable, str(REPO_ROOT / "client_examples" / "grpc_stream_client.py"), "def fibonacci(n):",
             "--url", f"127.0.0.1:{grpc}", "--max-tokens", "12"],
            capture_output=True, text=True, timeout=120,
        )
        assert client.returncode == 0, client.stderr
        expected = LLM(model=str(model), dtype="float32", device="cpu").generate(
            ["def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text
        assert client.stdout.rstrip("\n") == "def fibonacci(n):" + expected.rstrip("\n")
        assert "12 tokens" in client.stderr
        serve.send_signal(signal.SIGINT)
        assert serve.wait(timeout=120) == 0, "".join(output[-40:])
        reader.join(10)
        assert any("stopping tritonserver" in line for line in output)
    finally:
        kill_tree(serve)  # only when the test failed before its SIGINT stopped everything


@pytest.mark.tritonserver
@pytest.mark.server
def test_stop_reaps_the_stub_of_a_server_that_died(tiny_model_dir, tmp_path: Path) -> None:
    from pagedllm.serving.server import TritonServer

    version = tmp_path / "llm" / "1"
    version.mkdir(parents=True)
    bundled = REPO_ROOT / "model_repository" / "llm" / "config.pbtxt"
    (tmp_path / "llm" / "config.pbtxt").write_text(bundled.read_text())
    (version / "model.json").write_text(json.dumps({"model": str(tiny_model_dir("llama")), "device": "cpu",
                                                    "num_kv_blocks": 16, "max_model_len": 64}))
    server = TritonServer(tmp_path).start()
    group = server._process.pid
    stubs = [p for p in Path("/proc").iterdir()
             if p.name.isdigit() and p.name != str(group) and _group_of(p) == group]
    regions = [a.decode() for p in stubs for a in (p / "cmdline").read_bytes().split(b"\0") if b"shm_region" in a]
    assert stubs and regions, "the model's backend stub should be running in the server's process group"
    os.kill(group, signal.SIGKILL)  # the server dies without unloading: its stub is orphaned
    server._process.wait()
    assert any(_group_of(p) == group for p in stubs)
    server.stop()
    deadline = time.monotonic() + 10
    while any(_group_of(p) == group for p in stubs) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_group_of(p) == group for p in stubs)
    assert not any((Path("/dev/shm") / region).exists() for region in regions)


def _group_of(proc: Path) -> int | None:
    try:
        return os.getpgid(int(proc.name))
    except (ProcessLookupError, ValueError):
        return None
