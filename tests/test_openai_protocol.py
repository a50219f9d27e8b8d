"""OpenAI request bodies -> sampling parameters, and the 400s that never reach Triton (no server needed)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from installed import need
need("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from pagedllm.serving.openai.app import build_app  # noqa: E402
from pagedllm.serving.openai.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402
from pagedllm.serving.openai.served_models import ServedModel  # noqa: E402

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def http(tiny_model_dir: Callable[[str], Path]) -> Iterator[TestClient]:
    """The app over a model whose tokenizer has no chat template; nothing listens at the gRPC address."""
    model = ServedModel.load("plain", "llm", tiny_model_dir("llama"))
    with TestClient(build_app("127.0.0.1:1", [model])) as client:
        yield client


def test_chat_fields_become_vllm_sampling_parameters() -> None:
    request = ChatCompletionRequest(model="m", messages=USER, max_tokens=5, max_completion_tokens=9, stop="\n",
                                    temperature=0.5, seed=1, logprobs=True, top_logprobs=3, n=2, ignore_eos=True)
    assert request.sampling_parameters() == {"n": 2, "stop": ["\n"], "max_tokens": 9, "temperature": 0.5, "seed": 1,
                                             "ignore_eos": True, "logprobs": 3}
    assert ChatCompletionRequest(model="m", messages=USER, logprobs=True).sampling_parameters()["logprobs"] == 0
    assert "logprobs" not in ChatCompletionRequest(model="m", messages=USER).sampling_parameters()
    with pytest.raises(ValueError, match="^top_logprobs: requires logprobs"):
        ChatCompletionRequest(model="m", messages=USER, top_logprobs=2).sampling_parameters()


def test_completions_default_to_16_tokens_and_take_one_prompt() -> None:
    request = CompletionRequest(model="m", prompt=["only"], logprobs=2, top_p=0.9)
    assert request.sampling_parameters() == {"n": 1, "max_tokens": 16, "top_p": 0.9, "logprobs": 2}
    assert request.prompt_text() == "only"
    with pytest.raises(ValueError, match="^prompt: a list must hold exactly one prompt"):
        CompletionRequest(model="m", prompt=["a", "b"]).prompt_text()


def test_content_parts_are_joined_and_other_parts_refused() -> None:
    request = ChatCompletionRequest(model="m", messages=[
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert request.messages[0].template_message() == {"role": "user", "content": "ab"}
    image = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": [{"type": "image_url"}]}])
    with pytest.raises(ValueError, match="^messages: only text content parts"):
        image.messages[0].template_message()


@pytest.mark.parametrize(("route", "body", "status", "param"), [
    ("/v1/chat/completions", {"model": "plain", "messages": USER}, 400, "messages"),  # no chat template
    ("/v1/chat/completions", {"model": "plain", "messages": USER, "tools": []}, 400, "tools"),
    ("/v1/chat/completions", {"model": "plain", "messages": []}, 400, "messages"),
    ("/v1/completions", {"model": "plain", "prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": "plain", "prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"model": "other", "prompt": "x"}, 404, "model"),
])
def test_refusals_are_openai_error_json_naming_the_field(http: TestClient, route: str, body: dict, status: int,
                                                         param: str) -> None:
    response = http.post(route, json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"]
    assert error["type"] == ("invalid_request_error" if status == 400 else "not_found_error")


def test_requests_are_503_while_triton_cannot_be_reached(http: TestClient) -> None:
    assert http.get("/health").status_code == 503
    response = http.post("/v1/completions", json={"model": "plain", "prompt": "x"})
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "service_unavailable_error"
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["plain"]


def test_a_template_that_writes_bos_does_not_get_a_second_one(tiny_model_dir: Callable[[str], Path]) -> None:
    loaded = ServedModel.load("bos", "llm", tiny_model_dir("llama"))
    template = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"
    model = dataclasses.replace(loaded, tokenizer=dataclasses.replace(loaded.tokenizer, chat_template=template))
    prompt = model.chat_prompt([{"role": "user", "content": "hi"}])
    assert prompt == "[user] hi"
    bos_id = model.tokenizer.tokenizer.token_to_id(model.tokenizer.bos_token)
    assert model.tokenizer.encode(prompt).count(bos_id) == 1


def test_unknown_fields_are_ignored_and_logged_once_known_ones_stay_strict(
        http: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    # What vllm-router adds to every request it forwards (SGLang's fields), plus a name no other test uses.
    router_fields = {"no_stop_trim": True, "return_text_in_logprobs": True, "protocol_test_unique_field": [1]}
    with caplog.at_level("WARNING", logger="pagedllm.serving.openai.ignored_fields"):
        for _ in range(2):
            for route, body in (("/v1/completions", {"model": "plain", "prompt": "x"}),
                                ("/v1/chat/completions", {"model": "plain", "messages": USER})):
                response = http.post(route, json={**body, **router_fields})
                # Past validation: the completion is refused only because no Triton listens, the chat only
                # because this tokenizer has no chat template.
                assert response.status_code == (503 if route == "/v1/completions" else 400), response.text
                assert response.json()["error"].get("param") != "protocol_test_unique_field"
    logged = [r.getMessage() for r in caplog.records if "protocol_test_unique_field" in r.getMessage()]
    assert len(logged) == 1 and "ignoring" in logged[0]
    for body, param in (({"n": "many"}, "n"), ({"stream_options": {"include_usage": True, "extra": 1}}, "stream_options"),
                        ({"max_tokens": 0}, "max_tokens")):
        response = http.post("/v1/completions", json={"model": "plain", "prompt": "x", **router_fields, **body})
        assert response.status_code == 400 and response.json()["error"]["param"].startswith(param), response.text


def test_the_names_remembered_for_logging_are_bounded() -> None:
    from pagedllm.serving.openai import ignored_fields

    ignored_fields.note_ignored_fields("/v1/completions", (f"flood_{i}" for i in range(10 * ignored_fields.MAX_REMEMBERED_NAMES)))
    assert len(ignored_fields._logged) <= ignored_fields.MAX_REMEMBERED_NAMES
