"""Backend folder assembly, NGC install, and the example repository's config."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from pagedllm.serving.backend_dir import SHIM_SOURCE, assemble_backend_dir, install_backend
from pagedllm.serving.cli import config_pbtxt, write_example_repository
from pagedllm.serving.triton_files import find_triton_files

REPO_ROOT = Path(__file__).resolve().parents[1]


def tensors(config: str) -> set[tuple[str, str, str]]:
    pattern = r'name: "(\w+)"\s+data_type: (\w+)\s+dims: \[\s*(-?\d+)\s*\]'
    return set(re.findall(pattern, config))


def test_generated_config_declares_the_bundled_tensors() -> None:
    bundled = (REPO_ROOT / "model_repository" / "llm" / "config.pbtxt").read_text()
    assert tensors(config_pbtxt()) == tensors(bundled)
    assert len(tensors(bundled)) == 18  # vllm_backend's 15, prompt_logprobs, lora_name, sparse_additional_outputs
    for config in (bundled, config_pbtxt()):
        assert 'backend: "pagedllm"' in config and "decoupled: true" in config and "max_batch_size: 0" in config


def test_example_repository_layout(tmp_path: Path) -> None:
    root = write_example_repository(tmp_path, {"block_size": 32})
    assert (root / "llm" / "config.pbtxt").read_text() == config_pbtxt()
    assert (root / "llm" / "1" / "model.json").read_text().strip().startswith("{")


def test_install_backend_writes_only_the_shim(tmp_path: Path) -> None:
    (tmp_path / "python").mkdir()
    path = install_backend(tmp_path)
    assert path == tmp_path.resolve() / "pagedllm" / "model.py"
    assert path.read_text() == SHIM_SOURCE == "from pagedllm.serving.triton.model import TritonPythonModel\n"
    assert sorted(p.name for p in (tmp_path / "pagedllm").iterdir()) == ["model.py"]


def test_install_backend_rejects_a_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="backends_dir"):
        install_backend(tmp_path / "nope")


def test_assembled_backend_dir_has_the_python_backend_and_an_executable_stub(tmp_path: Path) -> None:
    try:
        files = find_triton_files()
    except FileNotFoundError:
        pytest.skip("nvidia-pytriton wheel not installed")
    root = assemble_backend_dir(tmp_path / "backends", files)
    python_dir = root / "python"
    assert sorted(p.name for p in python_dir.iterdir()) == [
        "libtriton_python.so", "triton_python_backend_stub", "triton_python_backend_utils.py"]
    assert os.access(python_dir / "triton_python_backend_stub", os.X_OK)
    assert (root / "pagedllm" / "model.py").read_text() == SHIM_SOURCE
