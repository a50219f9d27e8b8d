"""Shared pytest fixtures.

``tiny_model_dir`` (session scope) is a factory: ``tiny_model_dir("qwen2")``
returns the directory of a tiny random-weight checkpoint of that architecture
("llama", "mistral", "qwen2" or "qwen3"; seed 0, size "tiny"), built with
``pagedllm.testing.tiny_model.make_tiny_model`` on first use and reused for the rest
of the test session. Treat the directory as read-only: other tests share it.
Each build takes about a second (tokenizer training plus weights).

The run fails if it leaves Python-backend shared-memory regions in ``/dev/shm``
that no process maps (``no_shared_memory_left_behind``): a test that kills a server
or a stub removes what it leaves (``shm_regions``).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import full_run
import installed
import shm_regions

from pagedllm.serving.triton_files import find_triton_files
from pagedllm.testing.tiny_model import make_tiny_model

# The suite runs beside its own tritonserver processes on a 2-core machine; with
# more busy threads than cores, OpenMP's spin-waiting makes small torch ops up
# to 30x slower, so the test process computes on one thread.
torch.set_num_threads(1)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(full_run.OPTION, action="store_true", default=False,
                     help="also run the long matrices (tests marked full, and the modules' full parametrizations)")


def pytest_configure(config: pytest.Config) -> None:
    full_run.set_full(config.getoption(full_run.OPTION))  # before the test modules are imported


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``full`` tests without ``--full``, ``gpu`` tests without CUDA, and ``tritonserver`` tests where the
    wheel's server is not installed (that one fails under .ci/run)."""
    if not full_run.full():
        for item in items:
            if item.get_closest_marker("full") is not None:
                item.add_marker(pytest.mark.skip(reason="pytest --full runs it"))
    if not torch.cuda.is_available():
        for item in items:
            if item.get_closest_marker("gpu") is not None:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
    try:
        find_triton_files()
    except FileNotFoundError as error:
        if installed.strict():  # .ci/run installed the wheel: its absence is a broken install, not a skip
            raise pytest.UsageError(f"{installed.STRICT_VARIABLE}=1 and the tritonserver wheel is missing: {error}")
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


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left_behind() -> Iterator[None]:
    before = shm_regions.present()
    yield
    left = shm_regions.orphans(before)
    if left:
        pytest.fail(f"the run left {len(left)} shared-memory region(s) in {shm_regions.SHM} that no process maps: "
                    f"{sorted(left)} (a test killed a server or stub without removing them; another run on this "
                    "machine at the same time can leave them too)", pytrace=False)
