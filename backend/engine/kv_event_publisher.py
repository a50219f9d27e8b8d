"""Publish KV cache events over ZMQ exactly as vLLM's ``ZmqEventPublisher`` does, without ever blocking a step.

Wire (``vllm/distributed/kv_events.py``): a PUB socket sends multipart messages
``[topic, seq, payload]``: ``seq`` an 8-byte big-endian counter starting at 0 for each engine
incarnation, ``payload`` a msgpack ``EventBatch`` (``pagedllm.core.kv_events``). An optional
ROUTER socket replays buffered batches: a client (REQ, or DEALER sending an empty delimiter)
sends the first sequence number it wants as 8 big-endian bytes and receives
``[b"", topic, seq, payload]`` for each buffered batch from there on, then the end marker
``[b"", b"", seq=-1, b""]``.

The engine's step only puts the batch on a bounded queue (``put_nowait``): encoding, sending
and replay all happen on this publisher's own thread, and a PUB socket drops, never waits,
for a subscriber that is slow or gone (its ``hwm``). When the queue is full (the thread has
fallen behind), the batch is dropped and ``publish`` says so; the engine then publishes a
snapshot of its whole cache once there is room, so a subscriber never stays wrong.

A replay request that is not ``[identity, b"", 8 bytes]`` gets only the end marker, and a
message longer than ``MAX_REPLAY_REQUEST_BYTES`` closes that client's connection (ZMQ's
``MAXMSGSIZE``): neither reaches the engine.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from itertools import count

import msgspec
import zmq

from pagedllm.core.kv_events import EventBatch, KVCacheEvent, KVEventBatch
from pagedllm.core.kv_events_config import KVEventsConfig

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MAX_REPLAY_REQUEST_BYTES = 64
_POLL_S = 0.05


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: wildcard addresses, ipc:// and inproc:// are bound; any other address is connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """One engine's event stream; ``publish`` from the engine's thread, ``close`` when the engine stops."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self._topic = config.topic.encode()
        self._rank = data_parallel_rank
        self._queue: queue.Queue[EventBatch | None] = queue.Queue(maxsize=config.queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket | None = None
        try:
            if is_bind_endpoint(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.MAXMSGSIZE, MAX_REPLAY_REQUEST_BYTES)
                # A whole replay (every buffered batch and the end marker) fits in one client's queue.
                self._replay.setsockopt(zmq.SNDHWM, config.buffer_steps + 1)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as error:
            self._close_sockets()
            raise ValueError(f"kv_events_config: cannot open {config.endpoint!r}"
                             f"{'' if config.replay_endpoint is None else f' / {config.replay_endpoint!r}'}: {error}"
                             ) from error
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or config.endpoint
        self.replay_endpoint = (None if self._replay is None
                                else self._replay.getsockopt_string(zmq.LAST_ENDPOINT) or config.replay_endpoint)
        self._closing = False
        self._malformed = 0
        self._thread = threading.Thread(target=self._run, name="pagedllm-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: Sequence[KVCacheEvent]) -> bool:
        """Queue one batch; False (and nothing queued) when the queue is full."""
        batch = KVEventBatch(ts=time.time(), events=list(events), data_parallel_rank=self._rank)
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            return False
        return True

    def close(self, timeout_s: float = 1.0) -> None:
        """Send what is queued (up to ``timeout_s``), then close the sockets; idempotent."""
        if self._closing:
            return
        self._closing = True
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._close_sockets()

    def _close_sockets(self) -> None:
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(linger=0)
        self._context.term()

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        sequence = count()
        while True:
            if self._replay is not None:
                self._serve_replays()
            try:
                batch = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if self._closing:
                    return
                continue
            if batch is None:
                return
            try:
                seq = next(sequence)
                payload = encoder.encode(batch)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
            except zmq.Again:  # a connected PUB (to a relay) at its high-water mark: replay still has it
                pass
            except Exception:
                log.exception("publishing a KV event batch failed")
                continue
            self._buffer.append((seq, payload))

    def _serve_replays(self) -> None:
        assert self._replay is not None
        while True:
            try:
                frames = self._replay.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._answer(frames)
            except zmq.ZMQError as error:  # the client went away or its queue is full: its problem alone
                log.debug("KV event replay answer dropped: %s", error)

    def _answer(self, frames: list[bytes]) -> None:
        assert self._replay is not None
        client = frames[0]
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            # Warned once: a client sending garbage in a loop must not fill the log.
            (log.debug if self._malformed else log.warning)(
                "ignoring a malformed KV event replay request (%d frames); answering with the end marker only",
                len(frames))
            self._malformed += 1
        else:
            start = int.from_bytes(frames[2], "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload),
                                                flags=zmq.NOBLOCK)
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""), flags=zmq.NOBLOCK)
