"""EngineLoop against a small deterministic fake engine (and the real one, when it exists)."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest

from pagedllm.core.errors import EngineUnavailable, FailureKind
from pagedllm.engine.engine_loop import EngineLoop
from pagedllm.engine.request_timing import StepTimings
from pagedllm.engine.outputs import CompletionDelta, RequestOutput
from pagedllm.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class FakeStats:
    num_running: int
    num_blocks_used: int


class FakeEngine:
    """Emits token ``1000 + k`` (text ``"<prompt>k "``) per step per request until max_tokens; one block per request."""

    def __init__(self, fail_on_prompt: str | None = None) -> None:
        self.active: dict[str, list] = {}  # id -> [prompt, params, produced, aborted]
        self.steps = 0
        self.idle_checks = 0
        self.fail_on_prompt = fail_on_prompt
        self.thread_ids: set[int] = set()
        self.frozen = False  # while True, steps make no progress (keeps requests in flight)
        self.faulty_prompt: str | None = None  # such a request is ended alone with RequestOutput.error
        self.broken = False  # while True, has_unfinished_requests raises (kills the loop)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        self.thread_ids.add(threading.get_ident())
        if not prompt:
            raise ValueError("prompt: must not be empty")
        if params.max_tokens is not None and params.max_tokens > 50:
            raise ValueError(f"max_tokens={params.max_tokens} exceeds max_model_len 50")
        self.active[request_id] = [prompt, params, 0, False]

    def abort_request(self, request_id: str) -> None:
        self.thread_ids.add(threading.get_ident())
        if request_id in self.active:
            self.active[request_id][3] = True

    def has_unfinished_requests(self) -> bool:
        if self.broken:
            raise RuntimeError("engine state corrupted")
        self.idle_checks += 1
        return bool(self.active)

    def step(self) -> list[RequestOutput]:
        self.thread_ids.add(threading.get_ident())
        self.steps += 1
        if self.frozen:
            time.sleep(0.001)
        outputs = []
        for request_id, state in list(self.active.items()):
            prompt, params, produced, aborted = state
            if self.fail_on_prompt is not None and prompt == self.fail_on_prompt:
                raise RuntimeError("simulated kernel failure")
            if aborted:
                deltas = tuple(CompletionDelta(i, "", (), 0.0, None, "abort") for i in range(params.n))
                outputs.append(RequestOutput(request_id, prompt, (1, 2, 3), deltas, True))
                del self.active[request_id]
                continue
            if self.frozen:
                continue
            if prompt == self.faulty_prompt:
                outputs.append(RequestOutput(request_id, prompt, (1, 2, 3), (), True, error="token 7 is cursed"))
                del self.active[request_id]
                continue
            state[2] = produced + 1
            done = state[2] >= params.max_tokens
            deltas = tuple(CompletionDelta(i, f"{prompt}{produced} ", (1000 + produced,), -0.5 * state[2], None,
                                           "length" if done else None) for i in range(params.n))
            outputs.append(RequestOutput(request_id, prompt, (1, 2, 3), deltas, done))
            if done:
                del self.active[request_id]
        return outputs

    def stats(self) -> FakeStats:
        return FakeStats(len(self.active), len(self.active))


class Collector:
    def __init__(self) -> None:
        self.outputs: list[RequestOutput] = []
        self.errors: list[str] = []
        self.kinds: list[FailureKind] = []
        self.done = threading.Event()

    def on_output(self, output: RequestOutput) -> None:
        self.outputs.append(output)
        if output.finished:
            self.done.set()

    def on_error(self, message: str, kind: FailureKind) -> None:
        self.errors.append(message)
        self.kinds.append(kind)
        self.done.set()

    def text(self, index: int = 0) -> str:
        return "".join(d.text for o in self.outputs for d in o.outputs if d.index == index)


@pytest.fixture
def loop_and_engine():
    engine = FakeEngine()
    loop = EngineLoop(engine).start()
    yield loop, engine
    loop.stop()


def test_streams_every_delta_in_order_and_finishes(loop_and_engine) -> None:
    loop, engine = loop_and_engine
    sink = Collector()
    loop.submit("r1", "a", SamplingParams(max_tokens=4), sink.on_output)
    assert sink.done.wait(5)
    assert sink.text() == "a0 a1 a2 a3 "
    assert [o.finished for o in sink.outputs] == [False, False, False, True]
    assert sink.outputs[-1].outputs[0].finish_reason == "length"
    assert engine.thread_ids == {loop._thread.ident}


def test_bad_input_raises_in_the_submitter_and_the_loop_keeps_serving(loop_and_engine) -> None:
    loop, engine = loop_and_engine
    sink = Collector()
    with pytest.raises(ValueError, match="prompt"):
        loop.submit("bad", "", SamplingParams(max_tokens=2), sink.on_output)
    with pytest.raises(ValueError, match="max_tokens"):
        loop.submit("bad2", "x", SamplingParams(max_tokens=51), sink.on_output)
    assert loop.running
    loop.submit("good", "g", SamplingParams(max_tokens=2), sink.on_output)
    assert sink.done.wait(5)
    assert sink.text() == "g0 g1 "


def test_duplicate_request_id_is_rejected(loop_and_engine) -> None:
    loop, engine = loop_and_engine
    first, second = Collector(), Collector()
    engine.frozen = True
    loop.submit("same", "a", SamplingParams(max_tokens=40), first.on_output)
    with pytest.raises(ValueError, match="already in flight"):
        loop.submit("same", "b", SamplingParams(max_tokens=2), second.on_output)
    engine.frozen = False
    assert first.done.wait(5)


def test_many_threads_submit_concurrently_and_each_gets_its_own_stream(loop_and_engine) -> None:
    loop, engine = loop_and_engine
    sinks = {f"r{i}": Collector() for i in range(24)}

    def client(request_id: str) -> None:
        length = 1 + int(request_id[1:]) % 7
        loop.submit(request_id, request_id + ":", SamplingParams(max_tokens=length, n=1 + int(request_id[1:]) % 3),
                    sinks[request_id].on_output)

    threads = [threading.Thread(target=client, args=(rid,)) for rid in sinks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for request_id, sink in sinks.items():
        assert sink.done.wait(5)
        length, n = 1 + int(request_id[1:]) % 7, 1 + int(request_id[1:]) % 3
        expected = "".join(f"{request_id}:{k} " for k in range(length))
        assert [sink.text(i) for i in range(n)] == [expected] * n
    assert engine.active == {}


def test_abort_ends_the_request_with_an_abort_delta_and_frees_it(loop_and_engine) -> None:
    loop, engine = loop_and_engine
    sink = Collector()
    first_token = threading.Event()

    def on_output(output: RequestOutput) -> None:
        engine.frozen = True  # runs on the loop thread: no further tokens until the abort lands
        sink.on_output(output)
        first_token.set()

    loop.submit("r", "a", SamplingParams(max_tokens=50), on_output)
    assert first_token.wait(5)
    loop.abort("r")
    assert sink.done.wait(5)
    assert sink.outputs[-1].outputs[0].finish_reason == "abort"
    assert len(sink.outputs) == 2
    assert engine.active == {}
    loop.abort("r")  # aborting a finished request is a no-op
    loop.abort("never-existed")


def test_cancellation_callback_is_polled_and_aborts(loop_and_engine) -> None:
    loop, engine = loop_and_engine
    sink = Collector()
    cancelled = threading.Event()
    engine.frozen = True
    loop.submit("r", "a", SamplingParams(max_tokens=50), sink.on_output, is_cancelled=cancelled.is_set)
    cancelled.set()
    assert sink.done.wait(5)
    assert sink.outputs[-1].outputs[0].finish_reason == "abort"
    assert engine.active == {}


def test_stop_fails_in_flight_requests_and_refuses_new_ones() -> None:
    engine = FakeEngine()
    engine.frozen = True
    loop = EngineLoop(engine).start()
    with_error, without_error = Collector(), Collector()
    loop.submit("a", "a", SamplingParams(max_tokens=50), with_error.on_output, on_error=with_error.on_error)
    loop.submit("b", "b", SamplingParams(max_tokens=50, n=2), without_error.on_output)
    loop.stop()
    assert not loop.running
    assert with_error.errors == ["the model is shutting down"]
    assert with_error.kinds == [FailureKind.UNAVAILABLE]
    final = without_error.outputs[-1]
    assert final.finished and {d.finish_reason for d in final.outputs} <= {"abort"}
    assert engine.active == {}
    assert not loop.healthy and "shutting down" in loop.error
    with pytest.raises(EngineUnavailable, match="not running"):
        loop.submit("c", "c", SamplingParams(max_tokens=1), Collector().on_output)


def test_engine_failure_fails_in_flight_requests_but_not_the_loop() -> None:
    engine = FakeEngine(fail_on_prompt="boom")
    loop = EngineLoop(engine).start()
    try:
        doomed = Collector()
        loop.submit("x", "boom", SamplingParams(max_tokens=3), doomed.on_output, on_error=doomed.on_error)
        assert doomed.done.wait(5)
        assert doomed.errors and "simulated kernel failure" in doomed.errors[0]
        assert doomed.kinds == [FailureKind.ENGINE]
        engine.fail_on_prompt = None
        healthy = Collector()
        loop.submit("y", "ok", SamplingParams(max_tokens=2), healthy.on_output)
        assert healthy.done.wait(5)
        assert healthy.text() == "ok0 ok1 "
    finally:
        loop.stop()


def test_callback_exception_aborts_only_that_request(loop_and_engine) -> None:
    loop, engine = loop_and_engine

    def explode(output: RequestOutput) -> None:
        raise RuntimeError("client went away")

    loop.submit("bad", "a", SamplingParams(max_tokens=50), explode)  # aborted after its first delta
    sink = Collector()
    loop.submit("good", "g", SamplingParams(max_tokens=3), sink.on_output)
    assert sink.done.wait(5)
    deadline = time.monotonic() + 5
    while engine.active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.active == {}


def test_idle_loop_sleeps_instead_of_spinning(loop_and_engine) -> None:
    loop, engine = loop_and_engine
    sink = Collector()
    loop.submit("r", "a", SamplingParams(max_tokens=2), sink.on_output)
    assert sink.done.wait(5)
    # The loop may still be finishing its last pass on a stalled machine: wait until two readings
    # agree (a spinning loop never gets there), then it must stay asleep.
    deadline = time.monotonic() + 5
    before = (engine.idle_checks, engine.steps)
    while True:
        time.sleep(0.1)
        now = (engine.idle_checks, engine.steps)
        if now == before:
            break
        assert time.monotonic() < deadline, "the idle loop keeps checking for work"
        before = now
    time.sleep(0.3)
    assert (engine.idle_checks, engine.steps) == before


def test_a_stalled_engine_is_not_spun_and_still_sees_aborts(loop_and_engine) -> None:
    loop, engine = loop_and_engine
    engine.frozen = True  # work that cannot move: each step schedules nothing
    sink = Collector()
    loop.submit("stuck", "a", SamplingParams(max_tokens=50), sink.on_output)
    time.sleep(0.2)
    steps = engine.steps
    time.sleep(1.0)
    assert engine.steps - steps <= 4  # a retry every STALLED_RETRY_S (0.5 s), not a spin
    loop.abort("stuck")
    assert sink.done.wait(5)
    assert sink.outputs[-1].outputs[0].finish_reason == "abort"


def test_a_new_request_wakes_a_stalled_loop(loop_and_engine) -> None:
    loop, engine = loop_and_engine
    engine.frozen = True
    loop.submit("stuck", "a", SamplingParams(max_tokens=50), Collector().on_output)
    time.sleep(0.1)
    engine.frozen = False
    sink = Collector()
    loop.submit("fresh", "b", SamplingParams(max_tokens=2), sink.on_output)
    assert sink.done.wait(5)
    assert sink.text() == "b0 b1 "


def test_a_request_the_engine_ended_alone_gets_only_its_error(loop_and_engine) -> None:
    loop, engine = loop_and_engine
    engine.faulty_prompt = "bad"
    doomed, healthy = Collector(), Collector()
    loop.submit("x", "bad", SamplingParams(max_tokens=3), doomed.on_output, on_error=doomed.on_error)
    loop.submit("y", "ok", SamplingParams(max_tokens=3), healthy.on_output, on_error=healthy.on_error)
    assert doomed.done.wait(5) and healthy.done.wait(5)
    assert doomed.errors == ["token 7 is cursed"] and doomed.kinds == [FailureKind.REQUEST]
    assert doomed.outputs == []
    assert healthy.errors == [] and healthy.text() == "ok0 ok1 ok2 "


def test_without_on_error_the_engine_error_output_is_delivered(loop_and_engine) -> None:
    loop, engine = loop_and_engine
    engine.faulty_prompt = "bad"
    sink = Collector()
    loop.submit("x", "bad", SamplingParams(max_tokens=3), sink.on_output)
    assert sink.done.wait(5)
    assert sink.outputs[-1].error == "token 7 is cursed" and sink.outputs[-1].finished


def test_a_dead_loop_fails_its_requests_reports_why_and_refuses_new_ones() -> None:
    engine = FakeEngine()
    engine.frozen = True
    deaths: list[str] = []
    loop = EngineLoop(engine, on_death=deaths.append).start()
    sink = Collector()
    loop.submit("a", "a", SamplingParams(max_tokens=50), sink.on_output, on_error=sink.on_error)
    assert loop.healthy and loop.error is None
    engine.broken = True
    loop.abort("nothing")  # wakes the loop, which then trips over the engine
    assert sink.done.wait(5)
    assert sink.kinds == [FailureKind.UNAVAILABLE] and "engine state corrupted" in sink.errors[0]
    deadline = time.monotonic() + 5
    while loop.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not loop.healthy and "engine loop died" in loop.error and "engine state corrupted" in loop.error
    assert deaths == [loop.error]
    with pytest.raises(EngineUnavailable, match="engine state corrupted"):
        loop.submit("b", "b", SamplingParams(max_tokens=1), Collector().on_output)
    assert loop.stop(timeout_s=1)


def test_a_request_whose_admission_kills_the_loop_gets_its_answer() -> None:
    class Fault(BaseException):
        pass

    class FatalEngine(FakeEngine):
        def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
            if prompt == "fatal":
                raise Fault("admission blew up")
            super().add_request(request_id, prompt, params)

    loop = EngineLoop(FatalEngine()).start()
    with pytest.raises(EngineUnavailable, match="admission blew up"):
        loop.submit("x", "fatal", SamplingParams(max_tokens=2), Collector().on_output)
    assert not loop.healthy


def test_stop_is_bounded_when_a_step_hangs() -> None:
    release, inside = threading.Event(), threading.Event()

    class HangingEngine(FakeEngine):
        def step(self) -> list[RequestOutput]:
            inside.set()
            release.wait(60)
            return super().step()

    loop = EngineLoop(HangingEngine()).start()
    loop.submit_nowait("a", "a", SamplingParams(max_tokens=5), Collector().on_output)
    try:
        assert inside.wait(30), "the loop never entered a step"
        assert loop.stop(timeout_s=0.2) is False
        assert not loop.healthy
    finally:
        release.set()


def test_on_step_reports_stats_and_finished_request_timings() -> None:
    ticks = iter(range(10_000))
    reports: list[tuple[object, StepTimings]] = []
    engine = FakeEngine()
    loop = EngineLoop(engine, on_step=lambda stats, step: reports.append((stats, step)),
                      clock=lambda: float(next(ticks))).start()
    try:
        sink = Collector()
        loop.submit("r", "a", SamplingParams(max_tokens=4, n=2), sink.on_output)
        assert sink.done.wait(5)
    finally:
        loop.stop()
    assert reports[0] == (FakeStats(0, 0), StepTimings())
    timings = [t for _, step in reports for t in step.finished]
    assert len(timings) == 1
    timing = timings[0]
    assert timing.request_id == "r"
    assert timing.num_output_tokens == 8 and timing.num_token_steps == 4 and timing.num_prompt_tokens == 3
    assert timing.finish_reasons == ("length", "length")
    assert timing.arrival < timing.first_token < timing.last_token <= timing.finished
    assert timing.time_to_first_token == timing.first_token - timing.arrival
    assert timing.n == 2
    # Token latencies arrive with the step that saw them: the first token's, then one gap per later step.
    assert [x for _, step in reports for x in step.first_token_latencies] == [timing.time_to_first_token]
    gaps = [x for _, step in reports for x in step.inter_token_latencies]
    assert len(gaps) == 3 and sum(gaps) == timing.last_token - timing.first_token
    assert reports[-1][0] == FakeStats(0, 0)


def test_real_engine_streams_from_many_threads_exactly_as_offline(tiny_model_dir) -> None:
    from pagedllm import LLM
    from pagedllm.core.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.engine.outputs import FinalOutput

    model = str(tiny_model_dir("llama"))
    prompts = [f"def f{i}(x):" + " return x" * (i % 4) for i in range(12)]
    params = [SamplingParams(temperature=0, max_tokens=3 + i % 6) for i in range(12)]
    expected = LLM(model=model, dtype="float32", device="cpu").generate(prompts, params)
    engine = LLMEngine(EngineConfig(model=model, dtype="float32", device="cpu", num_kv_blocks=64))
    loop = EngineLoop(engine).start()
    try:
        sinks = [Collector() for _ in prompts]
        with pytest.raises(ValueError, match="max_tokens"):
            loop.submit("too-long", "x", SamplingParams(max_tokens=10**6), Collector().on_output)
        threads = [threading.Thread(target=loop.submit, args=(f"r{i}", prompts[i], params[i], sinks[i].on_output))
                   for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for sink, want in zip(sinks, expected):
            assert sink.done.wait(60)
            got = FinalOutput.start(sink.outputs[0], 1)
            for output in sink.outputs:
                got.add(output)
            assert got.outputs[0].token_ids == want.outputs[0].token_ids
            assert got.outputs[0].text == want.outputs[0].text
    finally:
        loop.stop()
    assert engine.stats().num_blocks_used == 0


def test_a_request_past_its_timeout_on_the_loop_clock_is_aborted_and_fails_with_timeout() -> None:
    now = [0.0]
    engine = FakeEngine()
    engine.frozen = True  # steps make no progress: only the timeout can end the request
    loop = EngineLoop(engine, clock=lambda: now[0]).start()
    try:
        bounded, unbounded = Collector(), Collector()
        loop.submit("bounded", "a", SamplingParams(max_tokens=4, timeout=5.0), bounded.on_output,
                    on_error=bounded.on_error)
        loop.submit("unbounded", "b", SamplingParams(max_tokens=4), unbounded.on_output, on_error=unbounded.on_error)
        assert not bounded.done.wait(0.2)  # the clock has not moved: still running
        now[0] = 5.0
        assert bounded.done.wait(5)
        assert bounded.kinds == [FailureKind.TIMEOUT]
        assert "timed out after 5 s (sampling_parameters.timeout)" in bounded.errors[0]
        assert not unbounded.done.is_set()  # no timeout: it waits on, whatever the clock says
        engine.frozen = False
        assert unbounded.done.wait(5) and unbounded.errors == []
    finally:
        loop.stop()


class WaitingEngine(FakeEngine):
    """Like ``EngineCoreProcess``: ``step`` waits for a step computed elsewhere (here: until released), and
    returns ``[]`` early when interrupted."""

    def __init__(self) -> None:
        super().__init__()
        self.released = threading.Event()
        self.interrupted = threading.Event()

    def interrupt(self) -> None:
        self.interrupted.set()

    def clear_interrupt(self) -> None:
        self.interrupted.clear()

    def step(self) -> list[RequestOutput]:
        while not self.released.is_set():
            if self.interrupted.is_set():
                return []
            time.sleep(0.001)
        return super().step()


def test_a_request_reaches_an_interruptible_engine_while_its_step_is_still_waiting() -> None:
    engine = WaitingEngine()
    loop = EngineLoop(engine).start()
    try:
        loop.submit("first", "a", SamplingParams(max_tokens=2), lambda output: None)
        # The loop now waits in step() for a step that is never released; the second request is
        # admitted anyway (submit returns once the engine has accepted it).
        second = loop.submit_nowait("second", "b", SamplingParams(max_tokens=2), lambda output: None)
        second.result(timeout=30)
        assert set(engine.active) == {"first", "second"}
        assert not engine.released.is_set()
    finally:
        engine.released.set()
        loop.stop()
