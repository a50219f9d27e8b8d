"""``pagedllm serve --model / --engine-arg / --served-model-name``: the generated repository and early refusals.

No tritonserver here: these check what happens before it would start (the end-to-end
run is ``test_openai_server.py``).
"""
from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from pagedllm.cli import build_parser
from pagedllm.serving.cli import generated_repository, parse_engine_args, serve_main


def serve_args(*argv: str):
    return build_parser(load_benches=False).parse_args(["serve", *argv])


def test_engine_args_are_json_when_they_parse_else_strings() -> None:
    assert parse_engine_args(["max_model_len=128", "dtype=float32", "enable_prefix_caching=false",
                              "kv_cache_memory_gb=0.5", "revision=v1.0"]) == {
        "max_model_len": 128, "dtype": "float32", "enable_prefix_caching": False, "kv_cache_memory_gb": 0.5,
        "revision": "v1.0"}
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        parse_engine_args(["dtype"])


def test_the_generated_repository_serves_the_folder_with_the_engine_args(
        tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    model = tiny_model_dir("llama")
    repository = generated_repository(serve_args("--model", str(model), "--engine-arg", "max_model_len=64"), tmp_path)
    assert json.loads((repository / "llm" / "1" / "model.json").read_text()) == {
        "max_model_len": 64, "model": str(model.resolve())}
    assert 'backend: "pagedllm"' in (repository / "llm" / "config.pbtxt").read_text()


@pytest.mark.parametrize(("extra", "message"), [
    (["--engine-arg", "block_sise=16"], "block_sise"),
    (["--engine-arg", "max_model_len=many"], "max_model_len"),
    (["--engine-arg", "model=/elsewhere"], "pass the model with --model"),
    (["--model-repository", "."], "exclude each other"),
    (["--kv-events-config", "{not json"], "--kv-events-config: not valid JSON"),
    (["--kv-events-config", '{"enable_kv_cache_events": true, "hwm": 0}'], "kv_events_config.hwm=0 is invalid"),
    (["--kv-events-config", "{}", "--engine-arg", "kv_events_config={}"], "pass one"),
    (["--health-port", "70000"], "--health-port must be a port number in [0, 65535], got 70000"),
    (["--openai-port", "-1"], "--openai-port must be a port number in [0, 65535], got -1"),
])
def test_bad_model_flags_fail_before_tritonserver_and_leave_no_scratch(
        tiny_model_dir: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], extra: list[str], message: str) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert serve_main(serve_args("--model", str(tiny_model_dir("llama")), *extra)) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_model_flags_without_model_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert serve_main(serve_args("--served-model-name", "x")) == 2
    assert "go with --model" in capsys.readouterr().err
    assert serve_main(serve_args("--model", "/no/such/folder")) == 2
    assert "model='/no/such/folder' is not a Hugging Face checkpoint directory" in capsys.readouterr().err


def test_kv_events_config_becomes_the_engine_argument(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    events = {"enable_kv_cache_events": True, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}
    repository = generated_repository(serve_args("--model", str(tiny_model_dir("llama")), "--kv-events-config",
                                                 json.dumps(events)), tmp_path)
    assert json.loads((repository / "llm" / "1" / "model.json").read_text())["kv_events_config"] == events
