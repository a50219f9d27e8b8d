"""Hub ids as ``model``: resolved from a local hub cache offline, revisions honoured, local folders first.

The cache is built here (``pagedllm.testing.hub_cache``); the hub client reads its
settings at import, so the in-process tests point its constants at the temp cache and
the ``HF_HOME`` test runs a fresh interpreter with the environment set.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import huggingface_hub.constants
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.core.model_source import resolve_model_dir
from pagedllm.serving.engine_args import load_engine_config
from pagedllm.testing.hub_cache import add_to_hub_cache

REPO_ID = "pagedllm-test/tiny-llama"
GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROMPT = "def fibonacci(n):"


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty hub cache that the hub client uses, offline."""
    cache = tmp_path / "hf_home" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


def greedy_text(model: str, **engine_args: object) -> str:
    llm = LLM(model=model, dtype="float32", device="cpu", num_kv_blocks=16, max_model_len=64, **engine_args)
    return llm.generate([PROMPT], GREEDY)[0].outputs[0].text


def test_a_cached_hub_id_serves_the_same_tokens_as_its_folder(hub: Path, tiny_model_dir: Callable[[str], Path]) -> None:
    local = tiny_model_dir("llama")
    snapshot = add_to_hub_cache(hub, REPO_ID, local)
    assert resolve_model_dir(REPO_ID) == snapshot
    assert greedy_text(REPO_ID) == greedy_text(str(local))


def test_revision_picks_the_branch(hub: Path, tiny_model_dir: Callable[[str], Path]) -> None:
    main = add_to_hub_cache(hub, REPO_ID, tiny_model_dir("llama"))
    other = add_to_hub_cache(hub, REPO_ID, tiny_model_dir("qwen2"), branch="v2")
    assert resolve_model_dir(REPO_ID, "v2") == other != main
    assert resolve_model_dir(REPO_ID, "main") == main
    assert greedy_text(REPO_ID, revision="v2") == greedy_text(str(tiny_model_dir("qwen2")))


def test_the_tokenizer_may_be_a_hub_id(hub: Path, tiny_model_dir: Callable[[str], Path]) -> None:
    local = tiny_model_dir("llama")
    add_to_hub_cache(hub, REPO_ID, local)
    assert greedy_text(str(local), tokenizer=REPO_ID, revision="main") == greedy_text(str(local))
    with pytest.raises(ValueError, match=r"tokenizer='pagedllm-test/absent' is not a local directory"):
        LLM(model=str(local), tokenizer="pagedllm-test/absent", dtype="float32", device="cpu", num_kv_blocks=16)


def test_model_json_may_name_a_hub_id(hub: Path, tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    add_to_hub_cache(hub, REPO_ID, tiny_model_dir("llama"))
    version = tmp_path / "llm" / "1"
    version.mkdir(parents=True)
    (version / "model.json").write_text(json.dumps({"model": REPO_ID, "revision": "main"}))
    config = load_engine_config(version)
    assert (config.model, config.revision) == (REPO_ID, "main")
    assert resolve_model_dir(config.model, config.revision).parent.parent.name == "models--pagedllm-test--tiny-llama"


def test_a_local_folder_wins_over_a_hub_id_of_the_same_name(hub: Path, tiny_model_dir: Callable[[str], Path],
                                                           tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    add_to_hub_cache(hub, REPO_ID, tiny_model_dir("llama"))
    monkeypatch.chdir(tmp_path)
    Path(REPO_ID).mkdir(parents=True)
    assert resolve_model_dir(REPO_ID) == Path(REPO_ID)


def test_unknown_ids_and_missing_folders_name_the_field(hub: Path) -> None:
    with pytest.raises(ValueError, match=r"model='pagedllm-test/absent' .*could not be resolved.*LocalEntryNotFound"):
        resolve_model_dir("pagedllm-test/absent")
    with pytest.raises(ValueError, match=r"revision 'v9'"):
        resolve_model_dir(REPO_ID, "v9")
    with pytest.raises(ValueError, match=r"tokenizer='/no/such/folder' is not a Hugging Face checkpoint directory"):
        resolve_model_dir("/no/such/folder", field="tokenizer")


def test_hf_home_and_hf_hub_offline_come_from_the_environment(tiny_model_dir: Callable[[str], Path],
                                                             tmp_path: Path) -> None:
    snapshot = add_to_hub_cache(tmp_path / "hf_home" / "hub", REPO_ID, tiny_model_dir("llama"))
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    code = f"from pagedllm.core.model_source import resolve_model_dir; print(resolve_model_dir({REPO_ID!r}))"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()) == snapshot
