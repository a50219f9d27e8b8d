"""Hostile constraints fail alone, or compile off the step path while other requests keep stepping."""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import pagedllm.core.structured_outputs_params as constraint_limits
from pagedllm import LLM, SamplingParams
from pagedllm.engine.outputs import RequestOutput


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Callable[[str], Path]) -> LLM:
    return LLM(str(tiny_model_dir("qwen2")), dtype="float32", max_model_len=256, structured_outputs_compile_timeout_s=0.3)


def deeply_nested_schema(depth: int) -> str:
    text = '{"type": "integer"}'
    for _ in range(depth):
        text = '{"type": "object", "properties": {"a": %s}, "required": ["a"]}' % text
    return text


def run_all(llm: LLM, requests: dict[str, SamplingParams]) -> list[RequestOutput]:
    for request_id, params in requests.items():
        llm.engine.add_request(request_id, f"prompt of {request_id}", params)
    outputs = []
    while llm.engine.has_unfinished_requests():
        outputs.extend(llm.engine.step())
    return outputs


@pytest.mark.parametrize("constraint, reason", [
    ({"json": {"type": "object", "properties": {f"key{i}": {"type": "string"} for i in range(34_000)}}},
     "at most 65536"),  # a 1 MB schema
    ({"json": deeply_nested_schema(1000)}, "nested 2001 levels deep"),
    ({"json": {"enum": [f"value-{i}" for i in range(100_000)]}}, "at most 65536"),
])
def test_oversized_constraints_are_refused_before_the_engine(constraint: dict[str, object], reason: str) -> None:
    with pytest.raises(ValueError, match=reason) as error:
        SamplingParams(structured_outputs=constraint)
    assert "SamplingParams.structured_outputs.json" in str(error.value)


def test_a_schema_xgrammar_rejects_fails_that_request_alone(llm: LLM) -> None:
    outputs = run_all(llm, {
        "bad": SamplingParams(max_tokens=8, structured_outputs={"json": {"type": "objectx"}}),
        "good": SamplingParams(max_tokens=8, temperature=0.0),
    })
    (bad,) = [o for o in outputs if o.request_id == "bad"]
    assert bad.finished and bad.invalid_input
    assert "SamplingParams.structured_outputs.json was rejected by xgrammar" in (bad.error or "")
    assert "objectx" in (bad.error or "")
    good = [o for o in outputs if o.request_id == "good"]
    assert good[-1].finished and good[-1].error is None
    assert sum(len(d.token_ids) for o in good for d in o.outputs) == 8
    assert llm.stats().num_blocks_free == llm.stats().num_blocks_total


# Before the slow compiles below: they keep the compile workers busy for a while after their tests.
def test_the_same_constraint_compiles_once(llm: LLM) -> None:
    schema = json.dumps({"type": "object", "properties": {"k": {"enum": ["a", "b"]}}, "required": ["k"]})
    params = SamplingParams(max_tokens=20, temperature=0.0, structured_outputs={"json": schema})
    first = llm.engine.structured._compiler.submit(params.structured_outputs)
    outputs = llm.generate(["one", "two"], [params, params])
    assert llm.engine.structured._compiler.submit(params.structured_outputs) is first
    assert all(json.loads(o.outputs[0].text)["k"] in ("a", "b") for o in outputs)


def test_a_slow_compile_times_out_while_other_streams_keep_stepping(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    # Nested 160 objects deep, a schema compiles for about two seconds here: let it past the nesting limit.
    monkeypatch.setattr(constraint_limits, "MAX_SCHEMA_NESTING", 1000)
    slow = SamplingParams(max_tokens=4, structured_outputs={"json": deeply_nested_schema(160)})
    stream = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    alone_gap, _, _ = longest_gap(llm, {"alone": stream})
    gap, tokens_while_compiling, slow_output = longest_gap(llm, {"slow": slow, "stream": stream})
    assert slow_output is not None and slow_output.invalid_input
    assert "did not compile within 0.3 s" in (slow_output.error or "")
    assert tokens_while_compiling >= 1  # the other stream stepped while the grammar compiled
    # Recorded, not asserted (timing): the stream's longest gap between tokens, beside the compile and alone.
    print(f"longest gap between the stream's tokens: {gap * 1e3:.1f} ms beside a compiling grammar, "
          f"{alone_gap * 1e3:.1f} ms alone")


def longest_gap(llm: LLM, requests: dict[str, SamplingParams]) -> tuple[float, int, RequestOutput | None]:
    """Run ``requests`` to the end: the longest wall-clock gap between outputs of the unconstrained one, its
    tokens received before the constrained one ended, and the constrained one's last output."""
    for request_id, params in requests.items():
        llm.engine.add_request(request_id, f"prompt of {request_id}", params)
    last_seen, gap, tokens, constrained = None, 0.0, 0, None
    while llm.engine.has_unfinished_requests():
        for output in llm.engine.step():
            if requests[output.request_id].structured_outputs is not None:
                constrained = output
                continue
            now = time.perf_counter()
            gap = gap if last_seen is None else max(gap, now - last_seen)
            last_seen = now
            if constrained is None:
                tokens += sum(len(d.token_ids) for d in output.outputs)
    return gap, tokens, constrained


def test_a_request_aborted_while_compiling_ends_with_abort(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(constraint_limits, "MAX_SCHEMA_NESTING", 1000)
    llm.engine.add_request("aborted", "prompt", SamplingParams(structured_outputs={"json": deeply_nested_schema(90)}))
    llm.engine.abort_request("aborted")
    (output,) = llm.engine.step()
    assert output.finished and [d.finish_reason for d in output.outputs] == ["abort"]
    assert not llm.engine.has_unfinished_requests()
