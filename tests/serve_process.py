"""A ``pagedllm serve`` child process in the tests: its output read on a thread, ready once it says so."""
from __future__ import annotations

import subprocess
import threading
import time

from shm_regions import kill_tree

READY_LINE = "Ctrl-C stops the server"


def follow(process: subprocess.Popen[str], output: list[str]) -> None:
    """Append the process's output lines to ``output`` as they come."""
    threading.Thread(target=lambda: output.extend(iter(process.stdout.readline, "")), daemon=True).start()


def wait_ready(process: subprocess.Popen[str], output: list[str], timeout_s: float = 300.0) -> None:
    """Until the server prints that it is up; fails with its last output if it exits or takes too long."""
    deadline = time.monotonic() + timeout_s
    while not any(READY_LINE in line for line in output):
        assert process.poll() is None and time.monotonic() < deadline, "".join(output[-40:])
        time.sleep(0.2)


def kill(process: subprocess.Popen[str]) -> None:
    """SIGKILL the server with tritonserver and the stubs under it, and remove the regions they leave."""
    kill_tree(process)
