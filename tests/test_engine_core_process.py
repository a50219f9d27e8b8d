"""The engine core in a child process: same tokens as in-process, bad input still a ValueError, and a
killed child fails only the requests in flight; the next request gets a fresh engine."""
from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.core.config import EngineConfig
from pagedllm.engine.core_process import EngineCoreProcess
from pagedllm.engine.core_wire import decode_outputs, encode_outputs
from pagedllm.core.errors import FailureKind
from pagedllm.engine.engine_loop import EngineLoop
from pagedllm.engine.outputs import CompletionDelta, RequestOutput

PROMPTS = ["def add(a, b):", "import os\n", "class Tree:"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def config(tiny_model_dir: Callable[[str], Path]) -> EngineConfig:
    return EngineConfig(model=str(tiny_model_dir("llama")), dtype="float32", max_model_len=256, num_kv_blocks=64)


@pytest.fixture(scope="module")
def expected(config: EngineConfig) -> list[str]:
    llm = LLM(model=config.model, dtype="float32", max_model_len=256, num_kv_blocks=64)
    return [out.outputs[0].text for out in llm.generate(PROMPTS, GREEDY)]


class Collector:
    def __init__(self) -> None:
        self.text = ""
        self.prompts: set[tuple[str | None, tuple[int, ...]]] = set()  # every output's prompt fields
        self.error: tuple[str, FailureKind] | None = None
        self.done = threading.Event()

    def on_output(self, output: RequestOutput) -> None:
        self.text += "".join(delta.text for delta in output.outputs)
        self.prompts.add((output.prompt, tuple(output.prompt_token_ids)))
        if output.finished:
            self.done.set()

    def on_error(self, message: str, kind: FailureKind) -> None:
        self.error = (message, kind)
        self.done.set()


def submit(loop: EngineLoop, request_id: str, prompt: str, params: SamplingParams) -> Collector:
    collector = Collector()
    loop.submit(request_id, prompt, params, collector.on_output, on_error=collector.on_error)
    return collector


@pytest.mark.slow
def test_child_engine_serves_exact_tokens_and_recovers_from_being_killed(config: EngineConfig,
                                                                         expected: list[str]) -> None:
    core = EngineCoreProcess(config)
    loop = EngineLoop(core).start()
    try:
        results = [submit(loop, f"r{i}", prompt, GREEDY) for i, prompt in enumerate(PROMPTS)]
        assert all(r.done.wait(120) for r in results)
        assert [r.text for r in results] == expected
        # The prompt crosses the pipe once; every output still carries it, as in-process outputs do.
        tokenizer = core.tokenizer
        assert [r.prompts for r in results] == [{(p, tuple(tokenizer(p)["input_ids"]))} for p in PROMPTS]

        with pytest.raises(ValueError, match="n=1000"):
            loop.submit("bad", PROMPTS[0], SamplingParams(n=1000), lambda output: None)

        long = submit(loop, "long", PROMPTS[0], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
        os.kill(core._process.pid, signal.SIGKILL)
        assert long.done.wait(120), "the in-flight request hung after the engine died"
        assert long.error is not None and "engine core process died" in long.error[0]

        again = submit(loop, "again", PROMPTS[1], GREEDY)
        assert again.done.wait(300)
        assert again.error is None and again.text == expected[1]
        assert core.restarts == 1

        # Nothing in flight: the child computes no step, and only the interrupt ends the wait.
        loop.stop()
        returned: list[list[RequestOutput]] = []
        core.interrupt()
        waiting = threading.Thread(target=lambda: returned.append(core.step()), daemon=True)
        waiting.start()
        waiting.join(60)
        assert returned == [[]]
    finally:
        loop.stop()
        core.close()
    assert core._process.poll() is not None, "the child outlived close()"


def test_every_field_of_a_step_output_crosses_the_pipe() -> None:
    beam = CompletionDelta(1, " tree", (7, 8), -1.5, ({7: -0.5, 3: -1.0}, {8: -1.0}), "stop", -0.75)
    outputs = [RequestOutput("a", None, (), (CompletionDelta(0, "x", (5,), None, None, None), beam), True),
               RequestOutput("b", None, (), (), True, "the engine faulted on this request")]
    prompts = {"a": ("class Tree:", (1, 2, 3))}

    received = decode_outputs(pickle.loads(pickle.dumps(encode_outputs(outputs))), prompts)

    assert received == [dataclasses.replace(outputs[0], prompt="class Tree:", prompt_token_ids=(1, 2, 3)), outputs[1]]
