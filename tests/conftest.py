"""Shared pytest fixtures.

``tiny_model_dir`` (session scope) is a factory: ``tiny_model_dir("qwen2")``
returns the directory of a tiny random-weight checkpoint of that architecture
("llama", "mistral", "qwen2" or "qwen3"; seed 0, size "tiny"), built with
``pagedllm.testing.tiny_model.make_tiny_model`` on first use and reused for the rest
of the test session. Treat the directory as read-only: other tests share it.
Each build takes about a second (tokenizer training plus weights).
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pagedllm.serving.triton_files import find_triton_files
from pagedllm.testing.tiny_model import make_tiny_model

# The suite runs beside its own tritonserver processes on a 2-core machine; with
# more busy threads than cores, OpenMP's spin-waiting makes small torch ops up
# to 30x slower, so the test process computes on one thread.
torch.set_num_threads(1)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "tritonserver: needs the tritonserver binary of the nvidia-pytriton wheel")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``@pytest.mark.tritonserver`` tests where the wheel's server is not installed."""
    try:
        find_triton_files()
    except FileNotFoundError:
        skip = pytest.mark.skip(reason="nvidia-pytriton wheel (tritonserver) not installed")
        for item in items:
            if "tritonserver" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    built: dict[str, Path] = {}

    def build(arch: str) -> Path:
        if arch not in built:
            built[arch] = make_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch=arch)
        return built[arch]

    return build
