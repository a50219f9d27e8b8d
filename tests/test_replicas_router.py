"""Replicas behind vllm-router, started the way docs/replicas.md tells users to.

Three tiny ``pagedllm serve`` replicas, each publishing KV cache events on its own endpoints.
``kv_aware`` must send requests that share a prefix to the replica that holds it (told apart
by each replica's own prefix-cache counters: which one's queries moved, and how many of those
tokens were hits); ``round_robin``, ``cache_aware`` and ``power_of_two`` must complete every
request. A replica answers malformed replay requests while it serves, and keeps serving.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import pytest
import requests
import zmq

from installed import strict
from kv_event_subscriber import replay
from serve_process import follow, kill, wait_ready
from pagedllm.core.kv_events import KVEventBatch
from pagedllm.platform.processes import free_port

pytestmark = [pytest.mark.tritonserver, pytest.mark.server]

ROUTER = shutil.which("vllm-router", path=str(Path(sys.executable).parent))
if ROUTER is None:
    if strict():  # .ci/run installed the test extras, vllm-router among them
        raise RuntimeError("vllm-router is not installed beside this interpreter (pip install vllm-router==0.1.17)")
    pytest.skip("vllm-router is not installed (pip install vllm-router==0.1.17)", allow_module_level=True)

BLOCK_SIZE = 16
STORY = ("Once upon a time in a land far away there lived a king who had three daughters, a great castle with many "
         "towers, a moat full of water and a dragon that slept under the bridge every winter. ")


@dataclass
class Replica:
    process: subprocess.Popen[str]
    ports: tuple[int, ...]  # grpc, http, metrics, openai, events, replay: a restart reuses them
    tmpdir: Path
    output: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:  # what the router routes to: the OpenAI door
        return f"http://127.0.0.1:{self.ports[3]}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.ports[2]}/metrics"

    @property
    def events(self) -> str:  # where a subscriber connects
        return f"tcp://127.0.0.1:{self.ports[4]}"

    @property
    def replay(self) -> str:
        return f"tcp://127.0.0.1:{self.ports[5]}"

    def metric(self, name: str) -> float:
        for line in requests.get(self.metrics_url, timeout=10).text.splitlines():
            if line.startswith(name + "{") and 'model="llm"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0


def start_replica(model: Path, tmpdir: Path, ports: tuple[int, ...] | None = None) -> Replica:
    ports = ports or tuple(free_port() for _ in range(6))
    grpc, http, metrics, port, events, replay = ports
    kv_events = (f'{{"enable_kv_cache_events": true, "endpoint": "tcp://*:{events}", '
                 f'"replay_endpoint": "tcp://*:{replay}"}}')
    command = [sys.executable, "-m", "pagedllm.cli", "serve", "--model", str(model), "--served-model-name", "tiny",
               "--engine-arg", "dtype=float32", "--engine-arg", "device=cpu", "--engine-arg", "num_kv_blocks=64",
               "--engine-arg", "max_model_len=512", "--engine-arg", f"block_size={BLOCK_SIZE}",
               "--engine-arg", "cpu_bind=off", "--kv-events-config", kv_events, "--host", "127.0.0.1",
               "--grpc-port", str(grpc), "--http-port", str(http), "--metrics-port", str(metrics),
               "--openai-port", str(port)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmpdir)}
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    replica = Replica(process, ports, tmpdir)
    follow(process, replica.output)
    return replica


@pytest.fixture(scope="module")
def replicas(tiny_model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Replica]]:
    model = tiny_model_dir("llama")
    started = [start_replica(model, tmp_path_factory.mktemp(f"replica{i}")) for i in range(3)]
    try:
        for replica in started:
            wait_ready(replica.process, replica.output)
        yield started
    finally:
        for replica in started:
            kill(replica.process)


def router_command(port: int, policy: str, replicas: list[Replica]) -> list[str]:
    """The documented recipe (docs/replicas.md): one --kv-event-source per replica for kv_aware."""
    command = [ROUTER, "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
               "--worker-urls", *(r.url for r in replicas), "--log-level", "warning"]
    if policy == "kv_aware":
        for replica in replicas:
            command += ["--kv-event-source", f"{replica.url}={replica.events}",
                        "--kv-event-replay-source", f"{replica.url}={replica.replay}"]
        command += ["--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", "tiny"]
    return command


@pytest.fixture
def router(replicas: list[Replica]) -> Iterator[Callable[[str], str]]:
    running: list[subprocess.Popen[str]] = []

    def start(policy: str) -> str:
        port = free_port()
        process = subprocess.Popen(router_command(port, policy, replicas), stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
        running.append(process)
        output: list[str] = []
        follow(process, output)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, "".join(output[-40:])
            try:
                if requests.get(f"{url}/health", timeout=5).status_code == 200:
                    return url
            except requests.ConnectionError:
                pass
            assert time.monotonic() < deadline, "".join(output[-40:])
            time.sleep(0.3)

    yield start
    for process in running:
        kill(process)


def complete(url: str, prompt: str) -> str:
    answer = requests.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 4},
                           timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["text"]


def counters(replicas: list[Replica]) -> list[tuple[float, float]]:
    """Each replica's (prefix-cache queries, hits), in tokens."""
    return [(r.metric("vllm:prefix_cache_queries_total"), r.metric("vllm:prefix_cache_hits_total")) for r in replicas]


def served_by(replicas: list[Replica], before: list[tuple[float, float]], timeout_s: float = 30.0) -> tuple[int, float]:
    """The replica whose prefix-cache queries moved past ``before`` (its metrics publish just after the step), and
    the fraction of the request's tokens it found cached."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = counters(replicas)
        moved = [i for i, (after, then) in enumerate(zip(now, before)) if after[0] > then[0]]
        if moved:
            assert len(moved) == 1, (now, before)
            (queries, hits), (queries_before, hits_before) = now[moved[0]], before[moved[0]]
            return moved[0], (hits - hits_before) / (queries - queries_before)
        assert time.monotonic() < deadline, "no replica took the request"
        time.sleep(0.1)


def test_kv_aware_sends_shared_prefixes_to_the_replica_that_holds_them(
        replicas: list[Replica], router: Callable[[str], str]) -> None:
    tenants = {0: "Tenant zero asks: " + STORY * 2, 1: "Tenant one wonders: " + STORY * 2,
               2: "Tenant two would like to know: " + STORY * 2}
    # The router first: vllm-router replays a source's missed batches only after a gap in what it received,
    # so it learns what a replica cached before it subscribed only as those blocks are stored again.
    url = router("kv_aware")
    time.sleep(1.0)  # its subscriptions in place
    for holder, prefix in tenants.items():  # each replica gets one tenant's prefix, not through the router
        complete(replicas[holder].url, prefix + "Warm up.")
    time.sleep(0.5)  # the events on their way
    # Without the events the router sends a request no replica holds to the least loaded one, the same one for
    # every tenant here (one at a time): two of the three tenants would land on the wrong replica.
    for turn in range(3):
        for holder in (2, 1, 0):
            before = counters(replicas)
            complete(url, tenants[holder] + f"Question {turn}?")
            replica, hit_fraction = served_by(replicas, before)
            assert replica == holder, f"tenant {holder}, turn {turn}"
            # The replica's own view: the tenant's prefix came from its cache (a stranger's holds none of it).
            assert hit_fraction > 0.8, f"tenant {holder}, turn {turn}: {hit_fraction:.0%} of its tokens were hits"


@pytest.mark.full  # a second kv_aware router (~10 s)
def test_a_router_that_subscribes_late_catches_up_through_replay(
        replicas: list[Replica], router: Callable[[str], str]) -> None:
    """vllm-router asks a replica's replay socket for what it missed when the next live batch shows a gap in the
    sequence numbers: blocks cached before it subscribed are known once the replica publishes anything."""
    tenants = {holder: f"Late tenant {holder} says: " + STORY * 2 for holder in range(3)}
    for holder, prefix in tenants.items():  # cached before any router subscribed
        complete(replicas[holder].url, prefix + "Warm up.")
    url = router("kv_aware")
    time.sleep(1.0)  # its subscriptions in place
    for replica in replicas:  # one new batch from each replica (blocks of another prompt): a gap in what it saw
        complete(replica.url, f"Nudge for {replica.url}: " + STORY)
    time.sleep(0.5)  # the replays on their way
    for holder in (2, 1, 0):
        before = counters(replicas)
        complete(url, tenants[holder] + "Question?")
        replica, hit_fraction = served_by(replicas, before)
        assert replica == holder and hit_fraction > 0.8, f"tenant {holder}: replica {replica}, {hit_fraction:.0%}"


def test_malformed_replay_requests_while_serving_get_the_end_marker_and_the_replica_keeps_serving(
        replicas: list[Replica]) -> None:
    replica = replicas[0]
    malformed = ([b"no delimiter"], [b"", b"short"], [b"", b"12345678", b"extra"])
    end_marker = [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
    context = zmq.Context()
    try:
        with ThreadPoolExecutor(3) as pool:  # requests in flight while the replay socket is abused
            texts = [pool.submit(complete, replica.url, f"Busy {i}: " + STORY) for i in range(3)]
            for request in malformed:
                dealer = context.socket(zmq.DEALER)
                dealer.setsockopt(zmq.LINGER, 0)
                dealer.connect(replica.replay)
                dealer.send_multipart(request)
                assert dealer.poll(10_000), request
                assert dealer.recv_multipart() == end_marker, request
                dealer.close(linger=0)
            flood = context.socket(zmq.DEALER)  # past the replay socket's MAXMSGSIZE: dropped, unanswered
            flood.setsockopt(zmq.LINGER, 0)
            flood.connect(replica.replay)
            flood.send_multipart([b"", b"x" * 100_000])
            assert not flood.poll(1000)
            flood.close(linger=0)
            assert all(isinstance(text.result(timeout=120), str) for text in texts)
    finally:
        context.term()
    assert isinstance(complete(replica.url, "And after: " + STORY), str)
    batches = replay(replica.replay, 0)  # a well-formed request still replays this life from its first batch
    assert [seq for _, seq, _ in batches] == list(range(len(batches)))
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    assert type(decoder.decode(batches[0][2]).events[0]).__name__ == "AllBlocksCleared"


@pytest.mark.parametrize("policy", ["round_robin", "cache_aware", "power_of_two"])
def test_the_same_replicas_serve_the_other_policies(replicas: list[Replica], router: Callable[[str], str],
                                                    policy: str) -> None:
    url = router(policy)
    prompts = [f"Request {i} of {policy}: " + STORY for i in range(6)]
    with ThreadPoolExecutor(3) as pool:
        texts = list(pool.map(lambda prompt: complete(url, prompt), prompts))
    assert all(isinstance(text, str) for text in texts) and len(texts) == len(prompts)


@pytest.mark.full  # kills and restarts a replica (~1 min)
def test_a_replica_killed_under_load_ends_its_streams_the_router_recovers_and_the_restart_clears(
        replicas: list[Replica], router: Callable[[str], str], tiny_model_dir: Callable[[str], Path]) -> None:
    """Runs last in this module: it kills replica 1 and leaves a restarted one in its place."""
    url = router("round_robin")
    first_chunks = threading.Semaphore(0)

    def stream(index: int) -> str:
        body = {"model": "tiny", "prompt": f"Stream {index}: " + STORY, "max_tokens": 400, "ignore_eos": True,
                "stream": True}
        seen_first = False
        try:
            with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=60) as answer:
                lines = answer.iter_lines()
                chunks = [next(lines, b"")]
                seen_first = True
                first_chunks.release()
                chunks += list(lines)
            return "done" if answer.status_code == 200 and b"data: [DONE]" in chunks else "error"
        except (requests.RequestException, ValueError):
            return "error"
        finally:
            if not seen_first:
                first_chunks.release()

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(stream, i) for i in range(6)]
        for _ in futures:  # every stream is under way
            assert first_chunks.acquire(timeout=60)
        victim = replicas[1]
        kill(victim.process)  # SIGKILL: tritonserver and the engine die with it
        outcomes = [future.result(timeout=120) for future in futures]  # every stream ends, one way or the other
    assert set(outcomes) <= {"done", "error"} and "done" in outcomes
    # The router stops sending traffic to the dead replica: every later request completes on the other one.
    for i in range(4):
        complete(url, f"After the fault {i}: " + STORY)
    # The replica comes back on its ports; its first batch of events clears what the dead one held.
    time.sleep(2)  # its tritonserver and stubs gone, their ports free
    restarted = start_replica(tiny_model_dir("llama"), victim.tmpdir, victim.ports)
    replicas[1] = restarted
    wait_ready(restarted.process, restarted.output)
    first = replay(restarted.replay, 0)[0]
    assert first[1] == 0
    decoded = msgspec.msgpack.Decoder(KVEventBatch).decode(first[2])
    assert [type(event).__name__ for event in decoded.events] == ["AllBlocksCleared"]
