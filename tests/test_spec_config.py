"""``speculative_config`` as vLLM spells it: in EngineConfig / LLM(...), model.json and ``pagedllm serve
--speculative-config``; every bad value fails the load naming its field, and what speculation does not
do is refused by name."""
from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.cli import build_parser
from pagedllm.core.config import EngineConfig
from pagedllm.serving.cli import generated_repository, serve_main
from pagedllm.serving.engine_args import load_engine_config
from pagedllm.core.speculative_config import SpeculativeConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def test_a_dict_becomes_a_speculative_config_with_vllm_defaults() -> None:
    config = EngineConfig.from_dict({"speculative_config": NGRAM}).speculative_config
    assert config == SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=4,
                                       prompt_lookup_min=2)
    # vLLM: one lookup bound given, the other takes its value; neither, both are 5.
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
                                   ).prompt_lookup_min == 3
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2}
                                   ).prompt_lookup_max == 2
    both = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2}')
    assert (both.prompt_lookup_min, both.prompt_lookup_max) == (5, 5)
    assert EngineConfig().speculative_config is None


@pytest.mark.parametrize(("value", "field"), [
    ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method='eagle'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens=0"),
    ({"method": "ngram", "num_speculative_tokens": True}, "speculative_config.num_speculative_tokens=True"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "speculative_config.prompt_lookup_min=0"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3},
     "speculative_config.prompt_lookup_max=3"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "/draft"}, "speculative_config.model='/draft'"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": ""}, "speculative_config.model=''"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": -1},
     "speculative_config.disable_by_batch_size=-1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_acceptance_rate": 1.5},
     "speculative_config.disable_by_acceptance_rate=1.5"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "draft_confidence_threshold": -0.1},
     "speculative_config.draft_confidence_threshold=-0.1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_confidence_threshold": 0.3},
     "speculative_config.draft_confidence_threshold=0.3"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "draft_dtype": "fp8"}, "speculative_config.draft_dtype='fp8'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_dtype": "bfloat16"},
     "speculative_config.draft_dtype='bfloat16'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown speculative_config key(s) ['lookahead']"),
    ({"num_speculative_tokens": 2}, "speculative_config.method is required"),
    ("[1]", "must be a JSON object"),
    ("{nope", "not valid JSON"),
])
def test_bad_values_fail_naming_the_field(tmp_path: Path, value: object, field: str) -> None:
    with pytest.raises(ValueError) as error:
        EngineConfig(speculative_config=value)  # type: ignore[arg-type]
    assert field in str(error.value)
    (tmp_path / "model.json").write_text(json.dumps({"speculative_config": value}))
    with pytest.raises(ValueError) as from_file:
        load_engine_config(tmp_path)
    assert "model.json" in str(from_file.value) and (field in str(from_file.value) or "wrong type" in str(from_file.value))


def test_model_json_carries_it(tmp_path: Path) -> None:
    (tmp_path / "model.json").write_text(json.dumps({"speculative_config": NGRAM}))
    assert load_engine_config(tmp_path).speculative_config == SpeculativeConfig.parse(NGRAM)


def serve_args(*argv: str):
    return build_parser(load_benches=False).parse_args(["serve", *argv])


def test_serve_flag_lands_in_model_json(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    model = tiny_model_dir("llama")
    repository = generated_repository(serve_args("--model", str(model), "--speculative-config", json.dumps(NGRAM)),
                                      tmp_path)
    assert json.loads((repository / "llm" / "1" / "model.json").read_text())["speculative_config"] == NGRAM


@pytest.mark.parametrize(("flag", "message"), [
    ('{"method": "ngram", "num_speculative_tokens": 0}', "speculative_config.num_speculative_tokens=0"),
    ("{nope", "--speculative-config is not valid JSON"),
])
def test_a_bad_serve_flag_fails_before_tritonserver(tiny_model_dir: Callable[[str], Path], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str], flag: str, message: str) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert serve_main(serve_args("--model", str(tiny_model_dir("llama")), "--speculative-config", flag)) == 2
    assert message in capsys.readouterr().err


def test_the_engine_refuses_what_speculation_does_not_do(tiny_model_dir: Callable[[str], Path]) -> None:
    model = str(tiny_model_dir("llama"))
    with pytest.raises(ValueError, match="scheduling=static"):
        LLM(model=model, scheduling="static", speculative_config=NGRAM)
    llm = LLM(model=model, dtype="float32", speculative_config=NGRAM)
    with pytest.raises(ValueError, match="beam_width=2 is not supported with speculative_config"):
        llm.generate("def f(", SamplingParams(beam_width=2, temperature=0.0, max_tokens=4))
    assert not llm.engine.has_unfinished_requests()
