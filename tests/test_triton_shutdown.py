"""Ctrl-C on ``pagedllm serve`` with 64 streams running: bounded exit, nothing left behind."""
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

from pagedllm.platform.processes import free_port

from installed import need
need("tritonclient.grpc")
from shm_regions import kill_tree  # noqa: E402
from test_triton_server import StreamClient, make_inputs  # noqa: E402

pytestmark = [pytest.mark.tritonserver, pytest.mark.server]

REPO_ROOT = Path(__file__).resolve().parents[1]
NUM_STREAMS = 64


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _group_members(group: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == group:
                    members.append(int(entry.name))
            except ProcessLookupError:
                continue
    return members


def test_ctrl_c_with_64_streams_running_stops_everything(tiny_model_dir, tmp_path: Path) -> None:
    version = tmp_path / "repo" / "llm" / "1"
    version.mkdir(parents=True)
    (tmp_path / "repo" / "llm" / "config.pbtxt").write_text(
        (REPO_ROOT / "model_repository" / "llm" / "config.pbtxt").read_text())
    (version / "model.json").write_text(json.dumps({
        "model": str(tiny_model_dir("llama")), "dtype": "float32", "device": "cpu", "num_kv_blocks": 1100,
        "max_model_len": 1024, "max_num_seqs": 64}))
    grpc = free_port()
    serve = subprocess.Popen(
        [sys.executable, "-m", "pagedllm.cli", "serve", "--model-repository", str(tmp_path / "repo"),
         "--grpc-port", str(grpc), "--http-port", str(free_port()), "--metrics-port", str(free_port()),
         "--host", "127.0.0.1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    output: list[str] = []
    threading.Thread(target=lambda: output.extend(iter(serve.stdout.readline, "")), daemon=True).start()
    client = None
    try:
        deadline = time.monotonic() + 300
        while not any("Ctrl-C stops the server" in line for line in output):
            assert serve.poll() is None and time.monotonic() < deadline, "".join(output[-40:])
            time.sleep(0.2)
        (server_pid,) = _children(serve.pid)
        members = _group_members(server_pid)
        regions = [a.decode() for pid in members for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                   if b"shm_region" in a]
        assert len(members) >= 2 and regions, "expected tritonserver and its backend stub, with shared memory"

        client = StreamClient(f"127.0.0.1:{grpc}")
        params = {"temperature": 0, "max_tokens": 900, "ignore_eos": True}
        streams = [client.send(f"s{i}", make_inputs(f"def f{i}(x):", params, stream=True))
                   for i in range(NUM_STREAMS)]
        deadline = time.monotonic() + 120
        while not all(result.texts for result in streams):
            assert time.monotonic() < deadline, "the streams did not start"
            time.sleep(0.1)
        assert not any(result.done.is_set() for result in streams), "streams should still be running"

        serve.send_signal(signal.SIGINT)
        started = time.monotonic()
        try:  # a hang guard, not the property: the time is printed
            code = serve.wait(timeout=300)
        except subprocess.TimeoutExpired:
            raise AssertionError("pagedllm serve hung after SIGINT:\n" + "".join(output[-40:])) from None
        assert code == 0, "".join(output[-40:])
        print(f"pagedllm serve exited {time.monotonic() - started:.1f} s after SIGINT with {NUM_STREAMS} streams")
        # Every stream got its final response (an error saying why) rather than a cut connection.
        assert all(result.done.wait(60) for result in streams)
        assert all(result.error and "shutting down" in result.error for result in streams), streams[0].error
    finally:
        if client is not None:
            client.close()
        kill_tree(serve)  # only when the test failed before its SIGINT stopped everything
    left = [pid for pid in _group_members(server_pid) if Path(f"/proc/{pid}/stat").exists()
            and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
    assert left == []
    assert not [region for region in regions if (Path("/dev/shm") / region).exists()]
