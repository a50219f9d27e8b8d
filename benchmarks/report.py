"""What every benchmark prints and writes: machine header, markdown tables, JSON, plots."""
from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

DEFAULT_OUT = Path("docs/results")


def machine() -> dict[str, Any]:
    """Date, CPU, cores, threads, versions and the command: the context a number needs."""
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "versions": {name: _version(name) for name in ("pagedllm", "torch", "transformers", "tokenizers")},
        "git_commit": _git_commit(),
        "command": _command(),
    }


def header(title: str, info: dict[str, Any]) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in info["versions"].items())
    return (f"# {title}\n{info['date']} · {info['cpu']} · {info['cores']} cores, {info['torch_threads']} torch "
            f"thread(s) · Python {info['python']} · {versions}\n")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_json(path: Path, payload: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    return path


def save_plot(path: Path, draw: Callable[[Any], None], size: tuple[float, float] = (8.0, 4.5)) -> Path:
    """Draw on a fresh Agg figure (no display needed) and write it as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(figsize=size)
    try:
        draw(axes)
        figure.tight_layout()
        figure.savefig(path, dpi=110)
    finally:
        plt.close(figure)
    return path


def set_threads(threads: int | None) -> None:
    """Pin torch's intra-op threads; every engine in one run then gets the same CPU share.

    On a busy 2-core machine two threads contend with other processes and a
    step can run several times slower, so the benchmarks default to one.
    """
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads={threads} is invalid: expected >= 1")
        torch.set_num_threads(threads)


def _command() -> str:
    if Path(sys.argv[0]).name == "pagedllm":
        return shlex.join(["pagedllm", *sys.argv[1:]])
    return shlex.join(["python", *sys.orig_argv[1:]])


def _cell(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    try:
        result = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() or None
