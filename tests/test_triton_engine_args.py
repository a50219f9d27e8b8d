"""model.json -> EngineConfig for the Triton backend; every mistake names the key."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedllm.core.config import EngineConfig
from pagedllm.serving.engine_args import load_engine_config


def write(folder: Path, content: object) -> Path:
    (folder / "model.json").write_text(content if isinstance(content, str) else json.dumps(content))
    return folder


def test_empty_object_serves_the_default_model(tmp_path: Path) -> None:
    assert load_engine_config(write(tmp_path, {})) == EngineConfig()


def test_values_become_engine_config_fields(tmp_path: Path) -> None:
    config = load_engine_config(write(tmp_path, {"block_size": 32, "max_num_seqs": 8, "kv_cache_memory_gb": 1,
                                                 "enable_prefix_caching": False, "dtype": "float32"}))
    assert (config.block_size, config.max_num_seqs, config.kv_cache_memory_gb) == (32, 8, 1)
    assert not config.enable_prefix_caching and config.dtype == "float32"


def test_relative_model_path_resolves_against_the_version_folder(tmp_path: Path) -> None:
    (tmp_path / "checkpoint").mkdir()
    config = load_engine_config(write(tmp_path, {"model": "checkpoint"}))
    assert config.model == str((tmp_path / "checkpoint").resolve())
    hub_style = load_engine_config(write(tmp_path, {"model": "org/not-a-local-folder"}))
    assert hub_style.model == "org/not-a-local-folder"


@pytest.mark.parametrize(
    ("content", "names"),
    [
        ({"blok_size": 16}, "blok_size"),
        ({"block_size": "16"}, "block_size"),
        ({"block_size": 24}, "block_size"),
        ({"enable_prefix_caching": 1}, "enable_prefix_caching"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"dtype": "float64"}, "dtype"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"cuda_graphs": True, "device": "cpu"}, "cuda_graphs"),
        ({"cuda_graphs": True, "attention_backend": "torch"}, "cuda_graphs"),
        ({"cuda_graphs": "yes"}, "cuda_graphs"),
        ("{broken", "not valid JSON"),
        ("[1]", "JSON object"),
    ],
)
def test_bad_engine_arguments_fail_naming_the_key(tmp_path: Path, content: object, names: str) -> None:
    with pytest.raises(ValueError, match="model.json") as error:
        load_engine_config(write(tmp_path, content))
    assert names in str(error.value)


def test_missing_file_is_reported(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="missing"):
        load_engine_config(tmp_path)
